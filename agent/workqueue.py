"""The hand-off from the training thread to the shipper thread, without waking it.

A ``queue.Queue`` wakes its consumer on every ``put``: the training thread
releases a lock the shipper sleeps on, the OS schedules the shipper at once,
and on a busy machine the training thread waits for its core and for the GIL
the shipper now holds. Measured on a shared 2-core machine, that one
``put_nowait`` cost milliseconds on every flush and cadence step.

:class:`WorkQueue` is a bounded ``collections.deque`` (append and popleft are
atomic under the GIL) that the shipper *polls*: it looks every ``poll_s``
seconds (and sends heartbeats in between), so the training thread's ``put``
is an append and nothing else (a backlog wakes it, see ``WAKE_BACKLOG``).
Shipping is ``poll_s`` later at most; only
``put(..., wake=True)`` (closing, not a training step) wakes it at once.
The interface is the part of ``queue.Queue`` the agent uses.

Example::

    >>> from gradwatch.agent.workqueue import WorkQueue
    >>> q = WorkQueue(2)
    >>> q.put_nowait("a"); q.put_nowait("b")
    >>> q.put_nowait("c")
    Traceback (most recent call last):
    ...
    queue.Full
    >>> q.get(timeout=0.0), len(q)
    ('a', 1)
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# How often an idle shipper looks for work: the most a batch waits to be sent.
POLL_S = 0.02
# A backlog this long wakes the shipper at once. A loop whose steps are far
# shorter than POLL_S / flush_every fills the agent's few staging buffers
# (``pool_size``, 4) between two polls, and what finds no buffer is dropped;
# waking only under such a backlog keeps the common put a plain append.
WAKE_BACKLOG = 2


class WorkQueue:
    """Bounded FIFO: the training thread appends, the shipper thread polls."""

    def __init__(self, maxsize: int, poll_s: float = POLL_S) -> None:
        self.maxsize = maxsize
        self._items: deque[Any] = deque()
        self._poll_s = poll_s
        self._wake = threading.Event()
        # Held by the consumer's pops and the producer's evict(), never by a put.
        self._taking = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Any) -> None:
        """Append ``item``; ``queue.Full`` when ``maxsize`` items wait. Never blocks; wakes
        the consumer only when ``WAKE_BACKLOG`` items wait (a fast loop, see above)."""
        if len(self._items) >= self.maxsize:
            raise queue.Full
        self._items.append(item)
        if len(self._items) >= WAKE_BACKLOG:
            self._wake.set()

    def put(self, item: Any, timeout: float = 0.0, wake: bool = True) -> None:
        """Append ``item``, waiting up to ``timeout`` s for room; wake the consumer."""
        end = time.monotonic() + timeout
        while len(self._items) >= self.maxsize:
            if time.monotonic() >= end:
                raise queue.Full
            time.sleep(min(self._poll_s, max(0.0, end - time.monotonic())))
        self._items.append(item)
        if wake:
            self._wake.set()

    def evict(self, droppable: Callable[[Any], bool]) -> Any | None:
        """Take out the oldest waiting item ``droppable`` says may go, None if none.

        The producer's way to make room for a newer item (agent/buffer.py). The
        consumer's pops take the same lock, so no item is taken while it is judged, and
        the others keep their order. The caller waits for one pop at most; the consumer
        waits while ``droppable`` runs (on the drop path only, never on a put).
        """
        items = self._items
        with self._taking:
            for i in range(len(items)):
                if droppable(items[i]):
                    item = items[i]
                    del items[i]
                    return item
        return None

    def get_nowait(self) -> Any:
        try:
            with self._taking:
                return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float) -> Any:
        """The oldest item, polling for up to ``timeout`` s; ``queue.Empty`` after that."""
        end = time.monotonic() + timeout
        while True:
            try:
                with self._taking:
                    return self._items.popleft()
            except IndexError:
                pass
            left = end - time.monotonic()
            if left <= 0:
                raise queue.Empty
            if self._wake.wait(min(left, self._poll_s)):
                self._wake.clear()
