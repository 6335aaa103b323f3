"""A durable outbox: every notification is stored before it is sent, then sent until it lands.

:class:`~gradwatch.collector.outbox_store.Outbox` is one SQLite table
(``<data_dir>/outbox.sqlite3``, WAL; in memory when there is no data dir) of
``(sink, id, body, state, attempts, created_at, next_attempt_at)``.
:class:`OutboxSink` is a :class:`Sink` over it: ``notify`` routes the
transition and inserts a row (a local insert, never the network); a worker
thread takes due rows, sends them through a *channel* (which formats the HTTP
request: generic webhook, Slack, PagerDuty, Alertmanager) and an injected
transport, and marks each delivered, or reschedules it with exponential backoff
and jitter (``Retry-After`` honoured). A notification is given up only when it
is older than ``max_age`` (24 h by default), even when the receiver rejects it
(a 4xx is usually a misconfiguration someone fixes; it is logged as a warning).
On start the worker resumes every pending row, so a collector killed with
``kill -9`` and started again with the same data dir delivers what it had not.
The id of a row is ``<alert id>:<state>``: the same notification is stored, and
sent, once.

Bounded and fair between jobs: at most ``max_pending`` pending rows per sink.
Past that one row is dropped (counted and logged) per row stored, chosen in
this **eviction order**: (1) the lowest severity pending (``info`` before
``warning`` before ``critical``), so a critical alert is never evicted while a
warning or info is pending; (2) among those, a row of the job holding the most
of them (ties: the job whose oldest row is oldest), so a flood of one job's
notifications evicts its own rows, not another job's page; (3) within that
job, its oldest. The row being sent is never the one dropped. Many jobs of one
row each (a job-name flood) still evict the oldest first: the collector's
``max_jobs`` bound limits how many such jobs can alert at once.

"Job" here is the sharing unit: the alert's job, or under CurveZMQ the key
that reports it (the server sets ``share_of``), so one key with many jobs
holds one share. Sink bandwidth is shared the same way: due rows are sent
critical first, and
within one severity round-robin across jobs (each job's oldest due row, then
each job's second, ...), so a job with thousands of pending notifications
delays another job's alert by at most one row per job, not by its backlog.
Finished rows are kept for ``max_age`` (they remember what was sent) and then
pruned.

A full or unwritable disk does not stop alerting: the first failed write is
logged once as an error and counted (``errors``), the rows are copied into
memory and the outbox carries on there (``durable`` turns False), so alerts
are still delivered, but no longer survive a restart until the collector is
restarted on a writable data dir.

Example::

    from gradwatch.collector.outbox import OutboxSink
    from gradwatch.collector.outbox_store import Outbox
    from gradwatch.collector.webhook import WebhookChannel

    outbox = Outbox.open(Path("/var/lib/gradwatch"))
    sink = OutboxSink("webhook-0", WebhookChannel("https://hooks.example.com/x"), outbox)
    sink.start()
    # for transition in engine.observe(step): sink.notify(transition)
    sink.close(timeout=5.0)
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gradwatch.collector.ingest import RateLimitedLog
from gradwatch.collector.outbox_store import (
    DEFAULT_MAX_AGE_S,
    DURABLE_RETRY,
    PRUNE_EVERY_S,
    Outbox,
    Pending,
)
from gradwatch.collector.routing import Router, TokenBucket
from gradwatch.collector.sinks import NOTIFY_STATES, SinkStats, alert_payload, idempotency_key
from gradwatch.collector.webhook import (
    HttpRequest,
    HttpResponse,
    RetryPolicy,
    Transport,
    is_retryable,
    retry_delay,
    urllib_transport,
)

log = logging.getLogger(__name__)


class Channel(Protocol):
    """Formats one stored notification as the HTTP request of one kind of receiver."""

    target: str  # where it goes, safe to log (URLs masked)

    def request(
        self, notification_id: str, alert: Mapping[str, Any], now: float
    ) -> HttpRequest: ...


class OutboxSink:
    """A :class:`Sink` that stores every notification, then delivers it from a worker thread.

    ``router`` decides which alerts this sink sends and paces it (see
    :mod:`gradwatch.collector.routing`). The sink owns ``outbox`` and closes
    it; several sinks share one file through one ``Outbox`` each. A sink made
    without one gets its own in-memory outbox.
    """

    def __init__(
        self,
        name: str,
        channel: Channel,
        outbox: Outbox | None = None,
        *,
        transport: Transport = urllib_transport,
        router: Router | None = None,
        retry: RetryPolicy = DURABLE_RETRY,
        max_age: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self.channel = channel
        self.outbox = outbox if outbox is not None else Outbox()
        self.router = router or Router(name=name)
        self._transport = transport
        self._retry = retry
        self._max_age = max_age
        self._clock = clock
        self._jitter = jitter
        self._bucket = TokenBucket(self.router.policy.rate_per_minute)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._counts = {"delivered": 0, "failed": 0, "dropped": 0, "retries": 0}
        self._log = RateLimitedLog(log, every=100)  # a flood drops one row per alert stored
        # Whose share of the outbox an alert's job is: the job itself, or (set by the
        # server under CurveZMQ) the key it reports with.
        self.share_of: Callable[[str], str] = str
        self._next_prune = 0.0
        self._closed = False
        self._sending: str | None = None  # the row id the worker is sending now

    # ---------------------------------------------------------------- Sink API

    def start(self) -> None:
        if self._thread is None:
            resumed = self.outbox.resume(self.name, self._clock())
            if resumed:
                log.info(
                    "%s: resuming %d undelivered notification(s) from the outbox",
                    self.name,
                    resumed,
                )
            self._thread = threading.Thread(
                target=self._run, name=f"gradwatch-{self.name}", daemon=True
            )
            self._thread.start()

    def notify(self, transition: Any) -> None:
        """Store a firing or resolved transition this sink routes; never touches the network."""
        if transition.current not in NOTIFY_STATES or self._closing.is_set():
            return
        alert = transition.alert
        now = self._clock()
        if not self.router.admit(alert, now):
            return
        self._admitted(alert)
        body = json.dumps(alert_payload(alert), allow_nan=False, separators=(",", ":"))
        try:
            inserted, dropped = self.outbox.put(
                self.name,
                idempotency_key(alert),
                body,
                now,
                sending=self._sending,
                job=self.share_of(str(alert.job)),
                severity=str(alert.severity),
            )
        except sqlite3.Error as exc:
            log.error(
                "%s: cannot store alert %s in the outbox (%s); it is lost. Check the "
                "data dir's disk space and permissions",
                self.name,
                alert.rule,
                exc,
            )
            self._count("dropped")
            return
        if dropped:
            self._count("dropped", dropped)
            self._log.warning(
                "outbox_full",
                "%s: outbox full (%d pending), dropped %d "
                "notification(s), least severe of the job holding the most "
                "first (stored: %s of job %r); %s is down or too slow",
                self.name,
                self.outbox.max_pending,
                dropped,
                alert.rule,
                alert.job,
                self.channel.target,
            )
        if inserted:
            self._wake.set()

    def close(self, timeout: float) -> None:
        """Stop the worker within ``timeout``; what is pending stays in the outbox."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "%s: still sending after %.1fs at shutdown; giving up", self.name, timeout
                )
                return  # the worker still uses the outbox; the process is exiting anyway
        if self._closed:
            return
        self._closed = True
        left = self.outbox.pending(self.name)
        if left and self.outbox.durable:
            log.warning(
                "%s: %d notification(s) not yet delivered at shutdown; they are sent "
                "when the collector starts again with the same data dir",
                self.name,
                left,
            )
        elif left:
            self._count("dropped", left)
            log.warning(
                "%s: %d notification(s) not delivered at shutdown are lost (the outbox "
                "was in memory); set a writable data_dir to keep them across restarts",
                self.name,
                left,
            )
        self.outbox.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> SinkStats:
        with self._lock:
            return self._stats()

    def wait_for(self, predicate: Callable[[SinkStats], bool], timeout: float) -> SinkStats:
        """Block until ``predicate(stats())`` holds; return the stats or raise ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(stats := self._stats()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{self.name}: condition not met within {timeout}s; stats now {stats}"
                    )
                self._changed.wait(remaining)
            return stats

    def _stats(self) -> SinkStats:
        try:
            queued = self.outbox.pending(self.name)
        except sqlite3.Error:  # closed at shutdown: nothing is queued any more
            queued = 0
        return SinkStats(queued=queued, **self._counts)

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            closing = self._closing.is_set()
            try:
                wait = self.deliver_due(final=closing)
            except Exception:  # a bug here must not stop delivery for good
                log.exception("%s: delivery pass failed; retrying", self.name)
                wait = 1.0
            if closing:
                return
            self._wake.wait(wait)
            self._wake.clear()

    def deliver_due(self, final: bool = False) -> float:
        """Send what is due now; return the seconds until more is due.

        The worker thread calls this in a loop; tests and embedders without a
        thread may call it directly. ``final``: one last pass at shutdown.
        """
        now = self._clock()
        for row in self.outbox.due(self.name, now):
            if self._closing.is_set() and not final:
                return 0.0
            wait = self._bucket.take()
            if wait > 0:
                return wait  # rate limited: the rest waits in the outbox
            self._attempt(row)
        if final:
            return 0.0
        now = self._clock()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            self.outbox.prune(now - self._max_age)
        wait = self._periodic(now)
        if self.outbox.due(self.name, now, limit=1):
            return 0.0
        when = self.outbox.next_due(self.name)
        if when is not None:
            wait = min(wait, max(0.0, when - now))
        return wait

    def _admitted(self, alert: Any) -> None:
        """Hook: ``alert`` passed this sink's routing (called on the notifying thread)."""

    def _periodic(self, now: float) -> float:
        """Extra work subclasses do on the worker thread; return seconds until it is due again."""
        return PRUNE_EVERY_S

    def _attempt(self, row: Pending) -> None:
        now = self._clock()
        response: HttpResponse | None = None
        self._sending = row.id
        try:
            request = self.channel.request(row.id, json.loads(row.body), now)
            response = self._transport(request)
            problem = f"HTTP {response.status}"
        except Exception as exc:  # any transport failure is a failed attempt
            problem = str(exc) or type(exc).__name__
        finally:
            self._sending = None
        now = self._clock()
        if response is not None and 200 <= response.status < 300:
            self.outbox.finish(row, "delivered", now)
            self._count("delivered")
            log.debug("%s: delivered %s", self.name, row.id)
            return
        age = now - row.created_at
        if age >= self._max_age:
            self.outbox.finish(row, "failed", now)
            self._count("failed")
            log.warning(
                "%s: gave up on notification %s after %d attempt(s) over %.0fs, last: "
                "%s; check that %s is up and accepts this request",
                self.name,
                row.id,
                row.attempts + 1,
                age,
                problem,
                self.channel.target,
            )
            return
        delay = retry_delay(self._retry, row.attempts + 1, response, now, self._jitter)
        self.outbox.reschedule(row, now + delay, now)
        self._count("retries")
        if row.attempts == 0 and not is_retryable(response):
            # A rejection is usually a receiver-side misconfiguration (route, token) that an
            # operator fixes within the max age: retried like an outage, but said loudly.
            log.warning(
                "%s: %s rejected notification %s with %s; retrying until it is %.0fs "
                "old. Check the URL, credentials and the receiver's logs",
                self.name,
                self.channel.target,
                row.id,
                problem,
                self._max_age,
            )
        else:
            log.debug("%s: %s for %s, retrying in %.2fs", self.name, problem, row.id, delay)

    def _count(self, outcome: str, n: int = 1) -> None:
        with self._changed:
            self._counts[outcome] += n
            self._changed.notify_all()
