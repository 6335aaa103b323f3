"""Hard bounds on what senders can make the collector keep or do, and a fair share of its time.

Everything the collector keeps from its input has a bound, and what would
exceed it is refused, counted by reason (``gradwatch_ingest_refused_total``)
and by the job or key that caused it (``gradwatch_ingest_refused_by_sender_total``,
the worst :data:`TOP_SENDERS` offenders), and logged, rate-limited. Defaults
are in :class:`Bounds` and documented in SECURITY.md.

Two checks per message, both before the costly part:

* :meth:`Admission.allow`, before decoding, from the job read off the header:
  a **fair share of the ingest thread's time**. Each sender (the job; under
  CurveZMQ the key) has a token bucket in seconds of ingest work, refilled at
  ``ingest_share / active senders`` per second and charged with the time its
  messages actually took (:meth:`Admission.charge`). The buckets only bite
  while the ingest thread is contended (busy more than ``ingest_share`` of the
  last second) *and* another sender is active: alone, a job may use the whole
  thread (a 16,384-rank job is one sender) and runs up no debt, so it gets its
  share, not less, once another sender shows up. Under a flood, a light
  job (a real one: one small batch per flush) stays within its share; a
  flooding one runs dry, and its messages are then dropped after a header read
  (~tens of microseconds) instead of costing rules evaluation. A new sender's
  bucket starts with a tenth of a second of its share, not a whole burst, so
  many fresh senders cannot each spend a burst. Under contention a batch is
  let in only if its sender's tokens cover its expected cost (its rows times
  that sender's measured seconds per row), so a sender cannot take a large
  batch on credit.
  Messages of jobs not admitted yet
  share one bucket (``(new)``), so a job-name bomb costs one sender's share.
  ZeroMQ serves its connections round-robin, so a real agent's message waits
  behind at most one admitted message per flooding connection, and an admitted
  message is bounded by ``max_rows_per_batch`` rows.
* :meth:`Admission.admit`, after decoding and before any state is touched:
  jobs (in all, and per CurveZMQ key), ranks per job, rows per batch, layers
  per schema, and the process's resident memory (no new jobs or ranks above
  ``max_memory_bytes``).

Example::

    >>> admission = Admission(Bounds(max_jobs=1), clock=lambda: 0.0, rss=lambda: 0)
    >>> from gradwatch.wire import Heartbeat
    >>> admission.admit(Heartbeat("a", 0, 1, "i", 0.0, 0, 0))
    >>> admission.admit(Heartbeat("b", 0, 1, "i", 0.0, 0, 0))
    'jobs'
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradwatch.collector.auth import PREAMBLE_BYTES
from gradwatch.collector.ingest import RateLimitedLog
from gradwatch.wire import Batch, Event, Heartbeat
from gradwatch.wire.messages import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

MiB = 1024 * 1024
NEW = "(new)"  # the shared bucket of senders not admitted yet
TOP_SENDERS = 20  # senders named in the per-sender refusal metric
MAX_OFFENDERS = 1024  # senders whose refusals are counted by name (the rest as "other")
ACTIVE_S = 5.0  # a sender is active (takes a share) this long after its last message
RSS_EVERY_S = 0.1  # /proc/self/statm costs ~10 us: checked often, overshoot stays small
BUSY_WINDOW_S = 1.0  # the ingest thread's utilisation is averaged over about this long
ROW_COST_S = 5e-4  # the first guess of ingest seconds per row (measured from then on)
NEW_CREDIT_S = 0.1  # a new sender's bucket starts with this many seconds of its share
REASONS = ("jobs", "jobs_per_key", "ranks", "rows", "layers", "memory", "share")


@dataclass(frozen=True, slots=True)
class Bounds:
    """The limits; each has a ``CollectorConfig`` field of the same name."""

    max_jobs: int = 256
    max_jobs_per_key: int = 64
    max_ranks_per_job: int = 16_384
    max_layers_per_schema: int = 16_384
    max_rows_per_batch: int = 256
    max_memory_bytes: int = 1536 * MiB
    ingest_share: float = 0.8  # of the ingest thread's time, split among active senders
    ingest_burst_seconds: float = 0.5

    @classmethod
    def of(cls, config: Any) -> Bounds:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})


@dataclass(slots=True)
class _Job:
    key: str
    since: float
    ranks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    last: float
    row_cost: float = ROW_COST_S  # this sender's measured ingest seconds per batch row


def peek(header: bytes) -> tuple[str | None, int]:
    """The job and row count a message's header frame names (one JSON parse, no decoding)."""
    if len(header) > MAX_HEADER_BYTES:
        return None, 0  # the wire decoder refuses it
    try:
        body = json.loads(header[PREAMBLE_BYTES:])
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return None, 0
    if not isinstance(body, dict):
        return None, 0
    return job_rows(body)


def job_rows(header: dict[str, Any]) -> tuple[str | None, int]:
    """The job and row count of a header already parsed (``peek`` without the parse)."""
    job, steps = header.get("job"), header.get("steps")
    return (job if isinstance(job, str) else None), (len(steps) if isinstance(steps, list) else 0)


def current_rss() -> int:
    """Resident memory of this process now (Linux), else its peak; bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class Admission:
    """The bounds and the fair share; see the module doc. Thread-safe."""

    def __init__(
        self,
        bounds: Bounds,
        clock: Callable[[], float] = time.monotonic,
        rss: Callable[[], int] = current_rss,
    ) -> None:
        self.bounds = bounds
        self._clock, self._rss_of = clock, rss
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._per_key: Counter[str] = Counter()
        self._buckets: dict[str, _Bucket] = {}
        self._recent: OrderedDict[str, float] = OrderedDict()  # see _current
        self._refused: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self._by_sender: Counter[tuple[str, str]] = Counter()
        self._rss, self._rss_at = 0, -float("inf")
        self._busy, self._busy_at = 0.0, clock()  # decaying sum of ingest seconds
        self._log = RateLimitedLog(log)

    # ------------------------------------------------------------ the share

    def unit(self, job: str | None, key: str = "") -> str:
        """Who pays for a message: its key under CURVE, else its job (``(new)`` if unknown)."""
        if key:
            return key
        with self._lock:
            return self._unit(job)

    def _unit(self, job: str | None) -> str:
        return job if job is not None and job in self._jobs else NEW

    def decide(self, job: str | None, key: str = "", rows: int = 0) -> str | None:
        """``unit`` and ``allow`` in one call (one lock): who pays, or None when refused."""
        now = self._clock()
        with self._lock:
            unit = key or self._unit(job)
            if self._allowed(unit, rows, now):
                return unit
        self._refuse_share(unit)
        return None

    def allow(self, unit: str, rows: int = 0) -> bool:
        """False (counted) when the thread is contended and ``unit``'s share does not
        cover the message (``rows`` rows: the expected cost of a batch)."""
        now = self._clock()
        with self._lock:
            if self._allowed(unit, rows, now):
                return True
        self._refuse_share(unit)
        return False

    def _allowed(self, unit: str, rows: int, now: float) -> bool:
        bucket = self._bucket(unit, now)
        return (
            self._utilisation(now) < self.bounds.ingest_share
            or bucket.tokens > min(rows * bucket.row_cost, self.bounds.ingest_burst_seconds)
            or self._alone(unit, now)
        )

    def _refuse_share(self, unit: str) -> None:
        self._count(
            "share",
            unit,
            "dropped messages of %s: it used more than its share of "
            "the collector's time (%.0f%% split among %d active senders); it is "
            "sending faster than the collector can judge",
            unit,
            100 * self.bounds.ingest_share,
            self.active(),
        )

    def charge(self, unit: str, seconds: float, rows: int = 0) -> None:
        """Take the ingest time one message of ``unit`` (``rows`` rows) cost from its bucket."""
        now = self._clock()
        with self._lock:
            bucket = self._bucket(unit, now)
            if rows:  # per sender: one sender's costly rows do not make another's look costly
                bucket.row_cost += 0.2 * (seconds / rows - bucket.row_cost)
            # Alone, the time it took was nobody else's: it leaves no debt that would
            # starve it (a 16,384-rank job is one sender) once another sender shows up.
            bucket.tokens = (
                max(0.0, bucket.tokens - seconds)
                if self._alone(unit, now)
                else bucket.tokens - seconds
            )
            bucket.last = now
            self._recent[unit] = now
            self._recent.move_to_end(unit)
            self._utilisation(now)
            self._busy += seconds

    def utilisation(self) -> float:
        """The share of the last second or so the ingest thread spent handling messages."""
        with self._lock:
            return self._utilisation(self._clock())

    def _utilisation(self, now: float) -> float:
        elapsed = now - self._busy_at
        if elapsed > 0:
            self._busy *= (
                max(0.0, 1.0 - elapsed / BUSY_WINDOW_S) if elapsed < BUSY_WINDOW_S else 0.0
            )
            self._busy_at = now
        return self._busy / BUSY_WINDOW_S

    def active(self) -> int:
        now = self._clock()
        with self._lock:
            return self._active(now)

    def _active(self, now: float) -> int:
        return max(1, len(self._current(now)))

    def _alone(self, unit: str, now: float) -> bool:
        """No sender but ``unit`` is active: nobody to share the thread with."""
        recent = self._current(now)
        return not recent or (len(recent) == 1 and unit in recent)

    def _current(self, now: float) -> OrderedDict[str, float]:
        """The active senders (a message within ``ACTIVE_S``), least recent first.

        Kept in order of their last message, so the inactive ones are at the
        front: O(1) per message, amortised, however many senders there are (it
        was a scan of every bucket, three times per message). The clock is
        monotonic (``time.monotonic``).
        """
        recent = self._recent
        while recent:
            unit, last = next(iter(recent.items()))
            if now - last < ACTIVE_S:
                break
            del recent[unit]
        return recent

    def _bucket(self, unit: str, now: float) -> _Bucket:
        bucket = self._buckets.get(unit)
        burst = self.bounds.ingest_burst_seconds
        rate = self.bounds.ingest_share / self._active(now)
        if bucket is None:
            if len(self._buckets) > self.bounds.max_jobs + 1:
                self._prune(now)
            # A tenth of a second of its share: many fresh senders cannot each spend a burst.
            bucket = self._buckets[unit] = _Bucket(min(burst, rate * NEW_CREDIT_S), now, now)
            self._recent[unit] = now
            self._recent.move_to_end(unit)
            return bucket
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        return bucket

    def _prune(self, now: float) -> None:
        for unit in [u for u, b in self._buckets.items() if now - b.last >= ACTIVE_S]:
            del self._buckets[unit]

    # ------------------------------------------------------------ the bounds

    def admit(self, message: Batch | Heartbeat | Event, key: str = "") -> str | None:
        """The reason ``message`` must be refused (counted and logged), or ``None``."""
        b = self.bounds
        job, rank = message.job, message.rank
        if isinstance(message, Batch):
            if len(message.steps) > b.max_rows_per_batch:
                return self._refuse(
                    "rows",
                    job,
                    "dropped a batch of %d rows from job %r "
                    "(max_rows_per_batch %d); lower the agent's flush_every",
                    len(message.steps),
                    job,
                    b.max_rows_per_batch,
                )
            schema = message.schema
            if schema is not None and len(schema.layers) > b.max_layers_per_schema:
                return self._refuse(
                    "layers",
                    job,
                    "dropped a schema of %d layers from job %r "
                    "(max_layers_per_schema %d); raise it if the model really "
                    "has that many parameter tensors",
                    len(schema.layers),
                    job,
                    b.max_layers_per_schema,
                )
        with self._lock:
            known = self._jobs.get(job)
            if known is not None and rank in known.ranks:
                return None
            full = self._memory_full()
            if known is None:
                reason = (
                    "memory"
                    if full
                    else "jobs"
                    if len(self._jobs) >= b.max_jobs
                    else "jobs_per_key"
                    if key and self._per_key[key] >= b.max_jobs_per_key
                    else None
                )
                if reason is None:
                    known = self._jobs[job] = _Job(key, self._clock())
                    self._per_key[key] += 1
            else:
                reason = (
                    "memory"
                    if full
                    else "ranks"
                    if len(known.ranks) >= b.max_ranks_per_job
                    else None
                )
            if reason is None:
                assert known is not None
                known.ranks.add(rank)
                return None
        return self._refuse(
            reason, key or job, _WHY[reason], job, rank, key or "-", self._limit(reason)
        )

    def may_grow(self, job: str, rank: int, key: str = "") -> bool:
        """Whether a new schema of ``job`` may be compiled and cached (False: counted)."""
        with self._lock:
            full = self._memory_full()
        if full:
            self._refuse(
                "memory", key or job, _WHY["memory"], job, rank, key or "-", self._limit("memory")
            )
        return not full

    def sender_of(self, job: str) -> str:
        """Who ``job``'s share is: its CurveZMQ key when it came with one, else the job."""
        with self._lock:
            known = self._jobs.get(job)
        return known.key if known is not None and known.key else job

    def forget(self, job: str) -> None:
        """The collector forgot ``job`` (silent or finished): its slot is free again."""
        with self._lock:
            known = self._jobs.pop(job, None)
            if known is not None:
                self._per_key[known.key] -= 1
                if self._per_key[known.key] <= 0:
                    del self._per_key[known.key]
            self._buckets.pop(job, None)
            self._recent.pop(job, None)

    def retain(self, live: set[str], grace_s: float = 10.0) -> list[str]:
        """Forget admitted jobs the collector's state never took up (every message of
        theirs was refused further on, e.g. an unknown schema): they must not hold a
        ``max_jobs`` slot for good. Returns them."""
        now = self._clock()
        with self._lock:
            stale = [
                job
                for job, known in self._jobs.items()
                if job not in live and now - known.since > grace_s
            ]
        for job in stale:
            self.forget(job)
        return stale

    def jobs(self) -> int:
        with self._lock:
            return len(self._jobs)

    def rss(self) -> int:
        with self._lock:
            self._memory_full()
            return self._rss

    def memory_full(self) -> bool:
        """Whether the process is over ``max_memory_bytes`` (resident memory, re-read at most
        every ``RSS_EVERY_S``)."""
        with self._lock:
            return self._memory_full()

    def refused(self) -> dict[str, int]:
        with self._lock:
            return dict(self._refused)

    def offenders(self, n: int = TOP_SENDERS) -> list[tuple[str, str, int]]:
        """The ``n`` (sender, reason) pairs refused most, as (sender, reason, count)."""
        with self._lock:
            return [(who, reason, count) for (who, reason), count in self._by_sender.most_common(n)]

    def _memory_full(self) -> bool:
        now = self._clock()
        if now - self._rss_at >= RSS_EVERY_S:
            self._rss, self._rss_at = self._rss_of(), now
        return self._rss > self.bounds.max_memory_bytes

    def _limit(self, reason: str) -> int:
        b = self.bounds
        return {
            "jobs": b.max_jobs,
            "jobs_per_key": b.max_jobs_per_key,
            "ranks": b.max_ranks_per_job,
            "memory": b.max_memory_bytes // MiB,
        }[reason]

    def _refuse(self, reason: str, who: str, message: str, *args: object) -> str:
        self._count(reason, who, message, *args)
        return reason

    def _count(self, reason: str, who: str, message: str, *args: object) -> None:
        with self._lock:
            self._refused[reason] += 1
            if (who, reason) in self._by_sender or len(self._by_sender) < MAX_OFFENDERS:
                self._by_sender[(who, reason)] += 1
            else:
                self._by_sender[("other", reason)] += 1
        self._log.warning(reason, message, *args)


_WHY = {
    "jobs": "dropped messages of job %r rank %d (key %s): the collector already tracks "
    "max_jobs=%d jobs; raise max_jobs, or run a collector per team",
    "jobs_per_key": "dropped messages of job %r rank %d: key %s already reports "
    "max_jobs_per_key=%d jobs; raise it or give the team another key",
    "ranks": "dropped messages of job %r rank %d (key %s): the job already has "
    "max_ranks_per_job=%d ranks; raise it if the job is really that large",
    "memory": "dropped messages of job %r rank %d (key %s): the collector uses more than "
    "max_memory_bytes (%d MiB), so it admits no new job or rank; raise it or "
    "lower max_jobs",
}
