"""Decode raw wire frames into the records (``Step``, ``Eval``) the rules read.

``Ingest`` is pure: no sockets, no clock, no threads of its own. It turns one
multipart message into steps, heartbeats and events (an ``eval`` event also
into an ``Eval``, see :func:`eval_of`), and keeps what decoding
needs between messages: per (job, rank, incarnation) schema caches, the last
batch ``seq`` (a gap means lost batches) and the agent's cumulative ``dropped``
count (deltas feed a counter). Nothing that arrives on the socket can make it
raise: every rejected message is counted by reason and logged, rate-limited.
A batch's values become rows through its schema's plan (:mod:`gradwatch.collector.rows`).

Example::

    import numpy as np
    from gradwatch.collector.ingest import Ingest
    from gradwatch.wire import Batch, Schema, encode

    ingest = Ingest()
    schema = Schema(id=1, columns=("loss",), layers=("w",))
    values = np.array([[2.5, 0.1]], "<f4").tobytes()
    batch = Batch("run-1", 0, 1, 1, 0, "inc", 0, (7,), (0.0,), values, schema)
    out = ingest.feed(encode(batch))
    assert out.steps[0].loss == 2.5
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradwatch.collector.rows import Plan, compile_plan, quiet_rows, stats_rows, step_rows
from gradwatch.collector.twins import TwinRanks
from gradwatch.rules.step import Eval, QuietRows, Stats, Step
from gradwatch.wire import (
    Batch,
    Event,
    Heartbeat,
    Schema,
    WireVersionError,
    decode,
    row_width,
)

log = logging.getLogger(__name__)

KINDS = ("batch", "heartbeat", "event")
# "internal" is a collector bug while handling a valid message (see Server).
REASONS = ("malformed", "oversized", "unknown_schema", "version", "internal")
LOG_EVERY = 1000
MAX_STREAMS = 65_536
MAX_SCHEMAS_PER_STREAM = 16
MAX_SHARED_PLANS = 1024  # distinct schemas across all streams
MAX_TRAIN_MODE_MODULES = 256  # names kept from one eval event; the rest are counted, not named
# JSON has no NaN/Inf: agents send non-finite event numbers as these strings.
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

Frames = Sequence[bytes | memoryview]


@dataclass(frozen=True, slots=True)
class Ingested:
    """What one message turned into (usually one kind only; an eval event also fills ``evals``)."""

    steps: tuple[Step, ...] = ()
    heartbeats: tuple[Heartbeat, ...] = ()
    events: tuple[Event, ...] = ()
    evals: tuple[Eval, ...] = ()  # the ``eval`` events among ``events``, decoded
    stats: tuple[Stats, ...] = ()  # from batches of a cadence-statistics schema
    # Batches without layers of a job judged as a whole, as columns (only when
    # ``feed(quiet=True)``; otherwise their rows are in ``steps``).
    quiet: tuple[QuietRows, ...] = ()


NOTHING = Ingested()


@dataclass(frozen=True, slots=True)
class IngestStats:
    """A consistent snapshot of the counters, for exposition."""

    messages: Mapping[str, int]
    rejected: Mapping[str, int]
    agent_dropped: Mapping[str, int]
    lost_batches: Mapping[str, int]
    # Heartbeats of a rank that went back to another live agent's (collector/twins.py).
    twin_agents: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Stream:
    """Decoding state of one agent instance (job, rank, incarnation)."""

    plans: OrderedDict[int, Plan] = field(default_factory=OrderedDict)
    last_seq: int | None = None
    dropped: int | None = None


class RateLimitedLog:
    """Log the first occurrence of each key, then every ``every``-th."""

    def __init__(self, logger: logging.Logger, every: int = LOG_EVERY) -> None:
        self._logger = logger
        self._every = every
        self._seen: Counter[str] = Counter()

    def warning(self, key: str, message: str, *args: object) -> None:
        self._seen[key] += 1
        count = self._seen[key]
        if count == 1 or count % self._every == 0:
            self._logger.warning(message + " [%s: %d so far]", *args, key, count)


class Ingest:
    """Turns multipart frames into steps; counts and logs whatever it rejects."""

    def __init__(
        self,
        max_message_bytes: int = 16 * 1024 * 1024,
        max_streams: int = MAX_STREAMS,
        admit: Callable[[Batch | Heartbeat | Event], str | None] | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        # Bounds checked after decoding, before any cache or state grows
        # (collector/limits.py); it counts and logs what it refuses.
        self.admit = admit
        # Asked before a schema not seen before is compiled and cached (memory bound).
        self.may_grow: Callable[[str, int], bool] | None = None
        self._max_streams = max_streams
        self._streams: OrderedDict[tuple[str, int, str], _Stream] = OrderedDict()
        self._plans: OrderedDict[Schema, Plan] = OrderedDict()  # LRU, see _shared_plan
        self._lock = threading.Lock()
        self._messages: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
        self._rejected: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self._dropped: Counter[str] = Counter()
        self._lost: Counter[str] = Counter()
        self._log = RateLimitedLog(log)
        self._twins = TwinRanks()

    def feed(
        self, frames: Frames, header: dict[str, Any] | None = None, quiet: bool = False
    ) -> Ingested:
        """Decode one message. Never raises: bad input is counted and dropped.

        ``header``: the header frame's JSON object when the caller already parsed
        it (``gradwatch.wire.messages.header_object``), so it is parsed once.
        ``quiet``: a batch without layers of a multi-rank job comes back as
        ``Ingested.quiet`` columns instead of one ``Step`` per row.
        """
        try:
            size = sum(memoryview(frame).nbytes for frame in frames)
            if size > self.max_message_bytes:
                self.reject(
                    "oversized",
                    "dropped a message of %d bytes (limit %d); raise "
                    "max_message_bytes or lower the agent's flush_every",
                    size,
                    self.max_message_bytes,
                )
                return NOTHING
            message = decode(frames, header)
        except WireVersionError as exc:
            self.reject("version", "dropped a message: %s", exc)
            return NOTHING
        except Exception as exc:  # WireError, or anything decode() failed to foresee
            self.reject(
                "malformed",
                "dropped a malformed message: %s (only gradwatch agents "
                "of a matching version should send to this endpoint)",
                exc,
            )
            return NOTHING
        try:
            if self.admit is not None and self.admit(message) is not None:
                return NOTHING
            return self._dispatch(message, quiet)
        except Exception as exc:
            self.reject(
                "internal",
                "failed to decode a valid %s message: %r; please report this as a gradwatch bug",
                type(message).__name__,
                exc,
            )
            return NOTHING

    def peek_steps(self, frames: Frames, header: dict[str, Any] | None = None) -> tuple[Step, ...]:
        """The rows of a step batch of a stream already known here, touching no state.

        For the collector's early look at a batch (collector/priority.py) before
        it is handled in turn: no counters, sequence or caches change, and a
        batch this cannot read at once (malformed, oversized, of a stream or
        schema not seen yet, cadence statistics) gives ``()``: it is judged
        when handled. Never raises.
        """
        try:
            if sum(memoryview(frame).nbytes for frame in frames) > self.max_message_bytes:
                return ()
            batch = decode(frames, header)
            if not isinstance(batch, Batch):
                return ()
            with self._lock:
                stream = self._streams.get((batch.job, batch.rank, batch.incarnation))
            plan = None if stream is None else stream.plans.get(batch.schema_id)
            if (
                plan is None
                or plan.stats
                or (batch.schema is not None and batch.schema != plan.schema)
                or row_width(batch) != plan.schema.width
            ):
                return ()
            return step_rows(batch, plan)
        except Exception:  # a bad message is counted when it is handled, not here
            return ()

    def reject(self, reason: str, message: str, *args: object) -> None:
        """Count one dropped message under ``reason`` and log it, rate-limited."""
        with self._lock:
            self._rejected[reason] += 1
        self._log.warning(reason, message, *args)

    def forget(self, job: str) -> None:
        """Drop every cache and per-job counter of ``job`` (it went silent)."""
        with self._lock:
            for key in [key for key in self._streams if key[0] == job]:
                del self._streams[key]
            self._dropped.pop(job, None)
            self._lost.pop(job, None)

    def stats(self) -> IngestStats:
        with self._lock:
            return IngestStats(
                dict(self._messages),
                dict(self._rejected),
                dict(self._dropped),
                dict(self._lost),
                dict(self._twins.counts),
            )

    # ------------------------------------------------------------ per kind

    def _dispatch(self, message: Batch | Heartbeat | Event, quiet: bool = False) -> Ingested:
        if isinstance(message, Heartbeat):
            self._count_message("heartbeat")
            stream = self._stream(message.job, message.rank, message.incarnation)
            self._track_dropped(stream, message.job, message.rank, message.dropped)
            with self._lock:  # stats() copies its counts from another thread
                other = self._twins.heartbeat(message.job, message.rank, message.incarnation)
            if other is not None:
                self._log.warning(
                    f"twin_agents:{message.job}/{message.rank}",
                    "job %r rank %d is reported by two live agents (incarnations %s and %s "
                    "take turns): two processes train as one rank, and their steps reach "
                    "the rules as one interleaved stream; give each process its own rank= "
                    "and world= in watch(), or its own job name",
                    message.job,
                    message.rank,
                    other,
                    message.incarnation,
                )
            return Ingested(heartbeats=(message,))
        if isinstance(message, Event):
            self._count_message("event")
            evals = (eval_of(message),) if message.kind == "eval" else ()
            return Ingested(events=(message,), evals=evals)
        self._count_message("batch")
        return self._batch(message, quiet)

    def _batch(self, batch: Batch, quiet: bool) -> Ingested:
        stream = self._stream(batch.job, batch.rank, batch.incarnation)
        self._track_seq(stream, batch)
        self._track_dropped(stream, batch.job, batch.rank, batch.dropped)
        plan = self._plan(stream, batch)
        if plan is None and batch.schema is not None:
            return NOTHING  # a new schema refused by the memory bound, counted there
        if plan is None:
            self.reject(
                "unknown_schema",
                "dropped a batch of job %r rank %d: schema %d is "
                "unknown (the collector started after the agent sent it); this "
                "clears when the agent next resends its schema",
                batch.job,
                batch.rank,
                batch.schema_id,
            )
            return NOTHING
        if row_width(batch) != plan.schema.width:
            self.reject(
                "malformed",
                "dropped a batch of job %r rank %d: rows of %d values "
                "but schema %d has %d; the agent is sending inconsistent data",
                batch.job,
                batch.rank,
                row_width(batch),
                plan.schema.id,
                plan.schema.width,
            )
            return NOTHING
        if plan.stats:
            return Ingested(stats=stats_rows(batch, plan))
        if quiet and plan.first_layer == plan.schema.width and batch.shards and batch.world > 1:
            return Ingested(quiet=(quiet_rows(batch, plan),))  # rules.assembly.assembles
        return Ingested(steps=step_rows(batch, plan))

    def _plan(self, stream: _Stream, batch: Batch) -> Plan | None:
        plans = stream.plans
        if batch.schema is None:
            plan = plans.get(batch.schema_id)
        else:
            plan = plans.get(batch.schema.id)
            # Agents resend schemas periodically: recompile only when one changed.
            if plan is None or plan.schema != batch.schema:
                plan = self._shared_plan(batch.schema, batch.job, batch.rank)
                if plan is None:
                    return None  # refused and counted by may_grow
                plans[batch.schema.id] = plan
        if plan is not None:
            plans.move_to_end(plan.schema.id)
            while len(plans) > MAX_SCHEMAS_PER_STREAM:
                plans.popitem(last=False)
        return plan

    def _shared_plan(self, schema: Schema, job: str, rank: int) -> Plan | None:
        """One compiled plan per distinct schema, shared by every rank that sends it.

        Every rank of a job sends the same layer names; sharing them saves a copy
        of ~1,000 strings per rank (tens of MiB at thousands of ranks). None when
        a new one would grow memory past its bound (``may_grow``).
        """
        with self._lock:
            plan = self._plans.get(schema)
            if plan is None and self.may_grow is not None and not self.may_grow(job, rank):
                return None
            if plan is None:
                plan = self._plans[schema] = compile_plan(schema)
                while len(self._plans) > MAX_SHARED_PLANS:
                    self._plans.popitem(last=False)
            else:
                self._plans.move_to_end(schema)
            return plan

    # ------------------------------------------------------------ bookkeeping

    def _stream(self, job: str, rank: int, incarnation: str) -> _Stream:
        key = (job, rank, incarnation)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = _Stream()
                # Bounded whatever arrives: the least recently heard-from goes first.
                while len(self._streams) > self._max_streams:
                    self._streams.popitem(last=False)
            else:
                self._streams.move_to_end(key)
            return stream

    def _track_seq(self, stream: _Stream, batch: Batch) -> None:
        last = stream.last_seq
        if last is not None and batch.seq > last + 1:
            lost = batch.seq - last - 1
            with self._lock:
                self._lost[batch.job] += lost
            self._log.warning(
                "lost",
                "%d batch(es) of job %r rank %d never arrived here (seq %d then %d): "
                "lost in transit (check the network and receive_hwm), or sent while this "
                "collector was down to the other collector of an HA pair",
                lost,
                batch.job,
                batch.rank,
                last,
                batch.seq,
            )
        if last is None or batch.seq > last:
            stream.last_seq = batch.seq

    def _track_dropped(self, stream: _Stream, job: str, rank: int, dropped: int) -> None:
        # The agent's count is cumulative per incarnation; the first report
        # counts whole because those drops happened whether or not we saw them.
        delta = dropped - (stream.dropped or 0)
        if delta <= 0:
            return
        stream.dropped = dropped
        with self._lock:
            self._dropped[job] += delta
        self._log.warning(
            "agent_dropped",
            "job %r rank %d could not ship %d step(s) "
            "(queue full or no collector listening); raise the agent's queue "
            "size or check that the collector keeps up",
            job,
            rank,
            delta,
        )

    def _count_message(self, kind: str) -> None:
        with self._lock:
            self._messages[kind] += 1


def eval_of(event: Event) -> Eval:
    """The ``Eval`` an ``eval`` event describes; fields of the wrong type are left out.

    ``loss`` and numeric fields may be numbers or the strings "nan", "inf" and
    "-inf"; ``train_mode_modules`` is a list of module names (the first
    ``MAX_TRAIN_MODE_MODULES`` strings are kept).
    """
    fields = dict(event.fields)
    loss = _number(fields.pop("loss", None))
    modules = fields.pop("train_mode_modules", None)
    named = (
        tuple(m for m in modules if isinstance(m, str))[:MAX_TRAIN_MODE_MODULES]
        if isinstance(modules, list)
        else ()
    )
    metrics = {
        key: value
        for key, value in ((k, _number(v)) for k, v in fields.items())
        if value is not None
    }
    return Eval(
        job=event.job,
        step=event.step,
        time=event.time,
        rank=event.rank,
        loss=loss,
        metrics=metrics,
        train_mode_modules=named,
    )


def _number(value: object) -> float | None:
    if isinstance(value, str):
        return _NONFINITE.get(value.strip().lower())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # a JSON integer beyond float range
            return math.inf if value > 0 else -math.inf
    return None
