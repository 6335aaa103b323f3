"""The ``process_*`` metrics, read off the scrape's thread.

prometheus-client's default registry carries a ``ProcessCollector``
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
``process_open_fds``, ...) that reads ``/proc/self`` on every scrape. Its
reads are cheap (15-20 ms of CPU), but each file read releases the GIL and
must win it back from the ingest thread: during a flush burst of 16,384
batches, measured on a 2-core machine, that one collector kept a scrape
waiting 1.0-1.4 s (75-110 ms of its own CPU), the only part of the scrape
over a second (issue 17; ``benchmarks/collector_load.py`` at
``--layout pp=4,dp=512,tp=8``).

:class:`ProcessMetrics` serves the same families from a thread that reads
them every ``refresh_seconds`` while scrapes keep coming (values at most
that plus one read old; it stops after ``IDLE_S`` without a scrape and the
next scrape reads inline again). The server swaps it in for the default
registry's collector while it runs (:func:`serve_off_thread`) and puts the
original back when it stops.

Example::

    from prometheus_client import REGISTRY
    restore = serve_off_thread(REGISTRY)
    ...
    restore()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # a read every second while scraped: counters at most ~1 s behind
STALE_S = 10.0  # a reading older than this (the thread is stuck) is not served
IDLE_S = 150.0  # longer than Prometheus' default 1 m scrape interval and the common 2 m


class ProcessMetrics(Collector):
    """``inner``'s families, read by a background thread while scrapes keep coming."""

    def __init__(
        self,
        inner: Collector,
        refresh_seconds: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self._refresh_s = refresh_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._reading: tuple[float, list[Metric]] | None = None
        self._wanted = 0.0  # clock time of the last scrape
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.read = threading.Event()  # set after each background read

    def describe(self) -> Iterable[Metric]:
        # The inner collector's families: the registry checks their names for clashes.
        return list(self.inner.collect())

    def collect(self) -> Iterable[Metric]:
        now = self._clock()
        with self._lock:
            self._wanted = now
            reading = self._reading
            if not self._closed.is_set() and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._refresh, name="gradwatch-process-metrics", daemon=True
                )
                self._thread.start()
        if reading is None or now - reading[0] > STALE_S:
            return list(self.inner.collect())  # the first scrape, or the thread is stuck
        return reading[1]

    def close(self, timeout: float = 1.0) -> None:
        self._closed.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _refresh(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                if self._clock() - self._wanted > IDLE_S:
                    self._thread = None
                    return
            began = self._clock()
            try:
                families = list(self.inner.collect())
            except Exception as exc:  # never kill the thread: scrapes read inline meanwhile
                log.warning(
                    "reading the process metrics failed: %r; scrapes read them inline until "
                    "it works again",
                    exc,
                )
                families = None
            if families is not None:
                with self._lock:
                    self._reading = (began, families)
                self.read.set()
            if self._closed.wait(max(0.0, self._refresh_s - (self._clock() - began))):
                return


def serve_off_thread(registry: CollectorRegistry) -> Callable[[], None]:
    """Swap prometheus-client's process collector in ``registry`` (the default one
    holds it) for a :class:`ProcessMetrics` over it; returns what puts it back."""
    original = prometheus_client.PROCESS_COLLECTOR
    try:
        registry.unregister(original)
    except KeyError:
        return lambda: None  # not in this registry (a test's own, or removed by the user)
    wrapped = ProcessMetrics(original)
    registry.register(wrapped)

    def restore() -> None:
        wrapped.close()
        registry.unregister(wrapped)
        registry.register(original)

    return restore
