"""Messages received ahead of their turn, and a bounded priority lane for batches with a NaN.

A NaN is a one-step catastrophe: it should page when its batch arrives, not
after every rank's report of the step has been assembled, nor behind a flush
burst of 16,384 batches the ingest thread is still working through (issue 17).

The server's receive loop takes what has arrived on its socket into a bounded
:class:`Inbox` (oldest first; the header parsed once, as the handling needs it
anyway) and handles the messages from there in arrival order, as before. A
batch whose header carries the agent's ``nonfinite`` hint (docs/wire.md) is
also *looked at* as it is taken in: if its sender has priority left
(:class:`PriorityLane`), the pipeline decodes it at once and pages its first
non-finite row (``Pipeline.early``); it is still handled in its place
afterwards, so the per-rank state, sequence numbers and assembly see every
message in order. The page comes from decoded values only: a hint on a batch
whose values are all finite pages nothing (counted as ``finite``).

The lane is bounded per sender (the job; under CurveZMQ the key: who pays in
collector/limits.py): a token bucket of :data:`PRIORITY_BURST` looks refilled
at :data:`PRIORITY_RATE` per second, so a sender that flags every batch gets a
few looks per second and the rest of its batches wait their turn, as everyone's
do. Every look and every flag over the share is counted
(``gradwatch_ingest_priority_total{outcome}``), the senders over their share by
name (``gradwatch_ingest_priority_over_share_by_sender_total``) and logged,
rate-limited, with who sent them. A real NaN in a large data-parallel job flags
every rank's batch; the first looks page it and the rest count as over the share.

Example::

    lane = PriorityLane()
    inbox = Inbox()
    if lane.take("run-42"):
        lane.count("run-42", pipeline.early(frames, header))
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradwatch.collector.auth import CurveAuth
from gradwatch.collector.ingest import RateLimitedLog
from gradwatch.collector.limits import Admission, job_rows, peek
from gradwatch.collector.pipeline import Pipeline
from gradwatch.collector.subscriptions import sender_of
from gradwatch.wire.messages import flagged, header_object

log = logging.getLogger(__name__)

PRIORITY_RATE = 2.0  # looks per second per sender: a NaN needs one to page
PRIORITY_BURST = 8.0  # looks a sender may take at once (a bucket starts full)
MAX_LANE_SENDERS = 1024  # buckets kept; beyond it the idle full ones are dropped
LOOKAHEAD_MESSAGES = 20_000  # a 16,384-rank flush burst fits (issue 17)
LOOKAHEAD_BYTES = 64 * 1024 * 1024  # of frames held ahead of their turn, at most
# ... and at most this share of max_memory_bytes: the inbox sits on top of what the
# admission's memory bound counts (it gates new jobs and ranks, not messages in flight),
# so a flood must not carry the process past max_memory_bytes through it (issue 15).
LOOKAHEAD_MEMORY_SHARE = 1 / 16
MESSAGE_OVERHEAD = 512  # bytes per held message beyond its frames (Frame, Received, deque)
TOP_SENDERS = 20  # senders named in the over-share metric
HINT = b'"nonfinite":1'  # wire.messages.NONFINITE_FIELD set, as the agent's encoder writes it
RECEIVE_EVERY = 32  # messages handled between looks at what arrived (a flagged NaN waits ~5 ms)
OUTCOMES = ("paged", "no_page", "finite", "amp", "shared", "unread", "over_share")


@dataclass(slots=True)
class Received:
    """One message taken off the socket and waiting for its turn."""

    parts: Sequence[Any]  # zmq.Frame
    head: bytes  # the header frame
    # Its JSON object (``wire.messages.header_object``), parsed on arrival only when
    # the header carries the nonfinite hint; else when it is handled.
    header: dict[str, Any] | None
    sender: str  # the CurveZMQ key ("" without CURVE)
    nbytes: int


class Inbox:
    """Messages received ahead of handling, oldest first, bounded in count and bytes."""

    def __init__(
        self, max_messages: int = LOOKAHEAD_MESSAGES, max_bytes: int = LOOKAHEAD_BYTES
    ) -> None:
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self.squeezed = False  # the process is over its memory bound: hold only a few
        self._queue: deque[Received] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._queue)

    def room(self) -> bool:
        """Whether another message may be taken in (else it waits in ZeroMQ's queue)."""
        if self.squeezed:
            # Over max_memory_bytes the lookahead shrinks to one receive's worth, as before
            # the inbox: what arrives waits in ZeroMQ's queue, bounded by its HWM.
            return len(self._queue) < RECEIVE_EVERY
        return len(self._queue) < self.max_messages and self._bytes < self.max_bytes

    def put(self, item: Received) -> None:
        self._queue.append(item)
        self._bytes += item.nbytes

    def pop(self) -> Received | None:
        if not self._queue:
            return None
        item = self._queue.popleft()
        self._bytes -= item.nbytes
        return item


class PriorityLane:
    """Per-sender token buckets of early looks, and what the looks found. Thread-safe."""

    def __init__(
        self,
        rate: float = PRIORITY_RATE,
        burst: float = PRIORITY_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # sender -> (tokens, at)
        self._outcomes: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))
        self._over: Counter[str] = Counter()
        self._log = RateLimitedLog(log)

    def take(self, sender: str) -> bool:
        """Whether ``sender`` may have one more batch looked at ahead of its turn.

        False is counted (``over_share``) and logged with the sender's name.
        """
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(sender, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            allowed = tokens >= 1.0
            if len(self._buckets) >= MAX_LANE_SENDERS and sender not in self._buckets:
                self._prune(now)
            self._buckets[sender] = (tokens - 1.0 if allowed else tokens, now)
            if allowed:
                return True
            self._outcomes["over_share"] += 1
            if sender in self._over or len(self._over) < MAX_LANE_SENDERS:
                self._over[sender] += 1
            else:
                self._over["other"] += 1
        self._log.warning(
            f"over_share:{sender}",  # senders are bounded: admitted jobs or allowed keys
            "batches of %r flagged non-finite beyond its priority share (%g per second) "
            "wait their turn; a NaN across many ranks does this, and so does a sender "
            "that flags every batch",
            sender,
            self.rate,
        )
        return False

    def count(self, outcome: str) -> None:
        """Count what one look found (``Pipeline.early``'s outcome)."""
        with self._lock:
            self._outcomes[outcome] += 1

    def outcomes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outcomes)

    def over_share(self, n: int = TOP_SENDERS) -> list[tuple[str, int]]:
        """The ``n`` senders with most flagged batches over their share."""
        with self._lock:
            return self._over.most_common(n)

    def _prune(self, now: float) -> None:
        full = [
            s
            for s, (tokens, at) in self._buckets.items()
            if tokens + (now - at) * self.rate >= self.burst
        ]
        for sender in full:
            del self._buckets[sender]


class Intake:
    """Socket -> inbox -> pipeline, in arrival order; flagged batches looked at on arrival.

    Runs on the server's ingest thread (``drain``); the server sets ``auth`` once
    its socket is bound.
    """

    def __init__(self, pipeline: Pipeline, admission: Admission) -> None:
        self.pipeline, self.admission = pipeline, admission
        memory = int(admission.bounds.max_memory_bytes * LOOKAHEAD_MEMORY_SHARE)
        self.inbox = Inbox(max_bytes=min(LOOKAHEAD_BYTES, memory))
        self.lane = PriorityLane()
        self.auth: CurveAuth | None = None
        self.sender = ""  # the CurveZMQ key of the message being handled ("" without CURVE)

    def drain(self, sock: zmq.Socket[Any], more: Callable[[int], bool]) -> None:
        """Handle messages in arrival order while ``more(handled)``, taking in what
        arrived meanwhile every ``RECEIVE_EVERY``."""
        handled = 0
        inbox = self.inbox
        while more(handled):
            if handled % RECEIVE_EVERY == 0 or not inbox:
                self._receive(sock)
            item = inbox.pop()
            if item is None:
                return
            handled += 1
            self._handle(item)

    def _receive(self, sock: zmq.Socket[Any]) -> None:
        """Take what has arrived into the inbox (bounded); look at flagged batches at once."""
        inbox, lane = self.inbox, self.lane
        inbox.squeezed = self.admission.memory_full()
        while inbox.room():
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            sender = ""
            if self.auth is not None:
                if not self.auth.permits(parts):
                    self.pipeline.handle((), refused=True)  # counted by the allow-list check
                    continue
                sender = sender_of(parts[0])
            head = parts[0].bytes
            # The header is held twice (its frame and this copy); both count.
            nbytes = len(head) + sum(len(p) for p in parts) + MESSAGE_OVERHEAD
            item = Received(parts, head, None, sender, nbytes)
            inbox.put(item)
            # A byte search, not a parse: queued messages keep no JSON objects (memory,
            # and the garbage collector's work); the handling parses each header once.
            # Inside a JSON string the quotes would be escaped, so only the key matches.
            if HINT not in head:
                continue
            header = item.header = header_object(head)
            if header is None or not flagged(header):
                continue
            job, _ = job_rows(header)
            unit = self.admission.unit(job, sender)  # who pays, as for its handling
            if lane.take(unit):
                began = time.perf_counter()
                lane.count(self.pipeline.early([part.buffer for part in parts], header))
                self.admission.charge(unit, time.perf_counter() - began)

    def _handle(self, item: Received) -> None:
        # Who pays for this message's ingest time (collector/limits.py): a sender over
        # its share is refused here, after one header parse, before any decoding;
        # the decoder reuses that parse.
        self.sender = item.sender
        header = item.header if item.header is not None else header_object(item.head)
        job, rows = peek(item.head) if header is None else job_rows(header)
        unit = self.admission.decide(job, item.sender, rows)
        if unit is None:
            self.pipeline.handle((), refused=True)
            return
        began = time.perf_counter()
        self.pipeline.handle([part.buffer for part in item.parts], header=header)
        self.admission.charge(unit, time.perf_counter() - began, rows)


class PriorityMetrics:
    """The lane's counters and the inbox depth, built at scrape time."""

    def __init__(self, lane: PriorityLane, inbox: Inbox) -> None:
        self._lane, self._inbox = lane, inbox

    def collect(self) -> Iterator[Metric]:
        outcomes = CounterMetricFamily(
            "gradwatch_ingest_priority",
            "Batches flagged non-finite by their sender, by what the early look found "
            "(paged, no_page, finite, amp, shared, unread) or over_share (waited their turn).",
            labels=["outcome"],
        )
        for outcome, count in sorted(self._lane.outcomes().items()):
            outcomes.add_metric([outcome], count)
        yield outcomes
        over = CounterMetricFamily(
            "gradwatch_ingest_priority_over_share_by_sender",
            f"Flagged batches over the priority share, of the {TOP_SENDERS} senders "
            "(job, or CurveZMQ key) with most.",
            labels=["sender"],
        )
        for sender, count in self._lane.over_share():
            over.add_metric([sender[:128]], count)
        yield over
        yield GaugeMetricFamily(
            "gradwatch_ingest_lookahead_messages",
            "Messages received and waiting for their turn in the ingest thread.",
            value=len(self._inbox),
        )
