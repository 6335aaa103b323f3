"""Assemble one job-wide step from every rank's report, exactly, with no collective in the job.

Each rank's agent sends, per layer, the L2 norm of *its* gradient (its shard
under FSDP/ZeRO, the whole all-reduced gradient under DDP) and declares how
many ranks one replica's gradients are split across (``shards``, docs/wire.md).
The :class:`Assembler` squares the norms in float64 and adds one report per
shard, so a layer's assembled norm is the global norm the job would compute
with an all-reduce. Rank ``r`` holds shard ``r % shards`` (DDP: every rank
holds shard 0, so any one rank suffices).

A step is emitted, in step order per job, as soon as every rank heard from
(a step or a heartbeat, :meth:`Assembler.heard`) has reported it and every
shard is in; the job's first step waits for the whole world. Ranks never heard
from by then are not waited for (a DDP job may run the agent on one rank only).
A known rank that misses ``deadline_seconds`` (counted from the step's first
report) is marked absent, and steps stop waiting for it until it reports a step
that is still being assembled. A layer whose shards did not all arrive
is left out of the emitted step -- a partial sum would look like vanishing
gradients -- unless it is already non-finite, which one shard proves. A
replica whose values are non-finite while another replica's are not (a faulty
device) makes those layers non-finite. Reports of a step already emitted are
counted as late and dropped, except their non-finite values, which go out as
a step of their own (a NaN is never lost). A rank whose step
goes backwards (a restart or rollback) restarts the job's assembly.

The loss is the mean over the reporting ranks (each rank's own batch); lr,
loss scale and scalars come from the lowest reporting rank; ``blame`` names,
per non-finite layer (and "loss"), the rank where it went non-finite first
(earliest step; within a step a rank whose own loss is non-finite, since an
all-reduce spreads its NaN to every rank's gradients, then the earliest agent
time), for the alert's ``rank``.

Cadence statistics are assembled the same way: weight norms add as sums of
squares, and update ratios through ||dw||^2 = (ratio * ||w||)^2 per shard.

Pure (no I/O; the clock is injected), so ``gradwatch replay`` assembles a
recorded trace exactly as the collector did live. Not thread-safe: the
collector calls it from its ingest thread.

Example::

    asm = Assembler(deadline_seconds=5.0, clock=time.monotonic)
    for step in ingested.steps:
        for whole in asm.add(step):
            engine.observe(whole)
    for whole in asm.expire():        # about once a second
        engine.observe(whole)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from gradwatch.rules.step import Stats, Step, nonfinite_layers
from gradwatch.wire.census import roles_for

MAX_PENDING_STEPS = 256  # per job and kind: beyond it the oldest is emitted as is
MAX_BLAMED = 64  # layers named in one step's blame

Record = Step | Stats


def assembles(record: Record) -> bool:
    """Whether ``record`` belongs to a job the collector judges as a whole."""
    return record.shards > 0 and record.world > 1


@dataclass(slots=True)
class AssemblyCounts:
    """Cumulative counters of one job, for exposition (``Assembler.counts`` hands out copies)."""

    steps: int = 0        # steps emitted
    incomplete: int = 0   # emitted at the deadline without every expected rank
    inexact: int = 0      # emitted with some layers left out (a shard missing)
    late: int = 0         # reports of a step already emitted, dropped
    restarts: int = 0


@dataclass(slots=True)
class _Pending:
    """One step (or cadence sample) being assembled."""

    step: int
    first: float  # collector clock at its first report
    layers: tuple[str, ...]
    index: dict[str, int]
    acc: np.ndarray  # per layer: sum of squares over shards (weights for stats)
    seen: np.ndarray  # per layer: shard reports added
    shards_seen: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    lowest: Record | None = None
    last_time: float = 0.0
    loss_sum: float = 0.0
    loss_n: int = 0
    skipped: bool = False
    updates: np.ndarray | None = None  # stats: per layer sum of ||dw||^2
    updates_seen: np.ndarray | None = None
    # Reports with something non-finite: (agent time, rank, layers, loss non-finite).
    bad: list[tuple[float, int, frozenset[str], bool]] = field(default_factory=list)


@dataclass(slots=True)
class _Stream:
    """Assembly state of one job and one kind (steps or stats)."""

    world: int
    shards: int
    pending: dict[int, _Pending] = field(default_factory=dict)
    emitted: int = -1
    absent: set[int] = field(default_factory=set)
    known: set[int] = field(default_factory=set)  # ranks heard from (steps or heartbeats)
    rank_step: dict[int, int] = field(default_factory=dict)
    first_bad: dict[str, int] = field(default_factory=dict)
    counts: AssemblyCounts = field(default_factory=AssemblyCounts)


class Assembler:
    """Per job: rank reports in, whole steps out, in step order; see the module docstring."""

    def __init__(self, deadline_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline_seconds = deadline_seconds
        self._clock = clock
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._heard: dict[str, set[int]] = {}

    def add(self, record: Record) -> list[Record]:
        """Take one rank's step or stats; return the records that became whole (maybe none)."""
        kind = "step" if isinstance(record, Step) else "stats"
        stream = self._stream(record, kind)
        previous = stream.rank_step.get(record.rank)
        if previous is not None and record.step < previous and record.step <= stream.emitted:
            # This rank went back in time: a restart or rollback. Finish what was
            # pending (the old timeline), then assemble anew from here.
            out = [self._emit(stream, p) for p in self._drain(stream)]
            stream.emitted = record.step - 1
            stream.absent.clear()
            stream.first_bad.clear()
            stream.counts.restarts += 1
        else:
            out = []
        stream.rank_step[record.rank] = record.step
        stream.known.add(record.rank)
        if record.step <= stream.emitted:
            stream.counts.late += 1
            late = _late_nonfinite(stream, record)
            return out + ([late] if late is not None else [])
        pending = stream.pending.get(record.step)
        if pending is None:
            pending = stream.pending[record.step] = _new(record, self._clock())
        stream.absent.discard(record.rank)  # it reports a step still being assembled
        _add(pending, record, stream.shards)
        out += self._ready(stream)
        return out

    def heard(self, job: str, rank: int) -> None:
        """``rank`` of ``job`` is alive (a heartbeat): its steps are waited for from now on.

        Agents heartbeat before their first step, so a job's first steps wait
        for every running rank rather than being judged on whichever came first.
        """
        heard = self._heard.setdefault(job, set())
        if rank not in heard:
            heard.add(rank)
            for kind in ("step", "stats"):
                stream = self._streams.get((job, kind))
                if stream is not None:
                    stream.known.add(rank)

    def expire(self) -> list[Record]:
        """Emit the steps whose deadline passed; call about once a second."""
        out: list[Record] = []
        for stream in self._streams.values():
            out += self._ready(stream)
        return out

    def flush(self) -> list[Record]:
        """Emit everything still pending, as is (the end of a replayed trace)."""
        out: list[Record] = []
        for stream in self._streams.values():
            out += [self._emit(stream, pending) for pending in self._drain(stream)]
        return out

    def counts(self) -> dict[str, AssemblyCounts]:
        """Per job, the step stream's counters (for ``gradwatch_assembly_*``)."""
        return {job: replace(stream.counts) for (job, kind), stream in self._streams.items()
                if kind == "step"}

    def absent(self, job: str) -> frozenset[int]:
        """Ranks of ``job`` that missed a deadline and have not reported since."""
        stream = self._streams.get((job, "step"))
        return frozenset(stream.absent) if stream is not None else frozenset()

    def forget(self, job: str) -> None:
        for kind in ("step", "stats"):
            self._streams.pop((job, kind), None)
        self._heard.pop(job, None)

    # ------------------------------------------------------------ internals

    def _stream(self, record: Record, kind: str) -> _Stream:
        key = (record.job, kind)
        stream = self._streams.get(key)
        if stream is None or (stream.world, stream.shards) != (record.world, record.shards):
            # A new job, or one relaunched at another scale: start over.
            stream = self._streams[key] = _Stream(record.world, record.shards)
            stream.known |= {r for r in self._heard.get(record.job, ()) if r < record.world}
        return stream

    def _ready(self, stream: _Stream) -> list[Record]:
        out: list[Record] = []
        now = self._clock()
        while stream.pending:
            low = min(stream.pending)
            pending = stream.pending[low]
            complete = _complete(stream, pending)
            if not complete and now - pending.first < self.deadline_seconds \
                    and len(stream.pending) <= MAX_PENDING_STEPS:
                break
            del stream.pending[low]
            if not complete:
                # Stop waiting for known ranks that did not make it. Ranks never heard
                # from are not waited for after the first step either: not running an
                # agent is a choice (DDP on rank 0 only), not an outage.
                stream.absent |= stream.known - pending.ranks
                stream.counts.incomplete += 1
            out.append(self._emit(stream, pending))
        return out

    @staticmethod
    def _drain(stream: _Stream) -> Iterator[_Pending]:
        while stream.pending:
            yield stream.pending.pop(min(stream.pending))

    def _emit(self, stream: _Stream, pending: _Pending) -> Record:
        stream.emitted = max(stream.emitted, pending.step)
        exact = pending.seen >= stream.shards
        norms = np.sqrt(pending.acc)
        keep = exact | ~np.isfinite(norms)
        stream.counts.inexact += not keep.all()
        stream.counts.steps += 1
        layers = pending.layers if keep.all() else tuple(
            name for name, k in zip(pending.layers, keep.tolist(), strict=True) if k)
        kept = norms if keep.all() else norms[keep]
        kept.flags.writeable = False
        lowest = pending.lowest
        assert lowest is not None
        if isinstance(lowest, Stats):
            return replace(lowest, layers=layers, weight_norms=kept,
                           update_ratios=_ratios(pending, keep, norms, stream.shards),
                           assembled=len(pending.ranks), time=pending.last_time)
        loss = pending.loss_sum / pending.loss_n if pending.loss_n else None
        # The total needs every layer exactly, unless a non-finite layer already decides it.
        total = float(np.sqrt(pending.acc.sum())) if exact.all() or not np.isfinite(
            pending.acc).all() else None
        grad_norm = lowest.grad_norm if lowest.grad_norm_logged else total
        return replace(lowest, layers=layers, layer_norms=kept, loss=loss, grad_norm=grad_norm,
                       layer_roles=roles_for(layers, lowest.layers, lowest.layer_roles),
                       skipped=pending.skipped, assembled=len(pending.ranks),
                       time=pending.last_time, blame=_blame(stream, pending, norms, loss))


def _complete(stream: _Stream, pending: _Pending) -> bool:
    """Whether nobody is left to wait for.

    The job's first step waits for the whole world (agents may connect after
    another rank's first batch). After it: every rank heard from and not absent
    has reported. A shard still missing then is held only by absent ranks or
    ranks never heard from, which are not waited for (and the check stays
    O(absent ranks), never O(world): a hostile header may claim a huge world).
    """
    if not stream.counts.steps:  # nothing emitted yet: this is the job's first step
        return len(pending.ranks) >= stream.world
    # Reporting ranks are all known; absent ones are not waited for.
    gone = sum(1 for r in stream.absent if r in stream.known and r not in pending.ranks)
    return len(pending.ranks) >= len(stream.known) - gone


def _late_nonfinite(stream: _Stream, record: Record) -> Step | None:
    """A late report's non-finite values, as a step of their own: a NaN is never dropped.

    Only those layers (and the loss) travel: the step was already judged
    without this rank, and re-judging its finite values would count them twice.
    """
    if not isinstance(record, Step):
        return None
    if not (nonfinite_layers(record) or _loss_bad(record)):
        return None
    bad = ~np.isfinite(record.layer_norms)
    layers = tuple(name for name, b in zip(record.layers, bad.tolist(), strict=True) if b)
    loss_bad = _loss_bad(record)
    norms = record.layer_norms[bad]
    norms.flags.writeable = False
    blame = {name: record.rank for name in layers[:MAX_BLAMED]}
    if loss_bad:
        blame["loss"] = record.rank
    return replace(record, layers=layers, layer_norms=norms,
                   layer_roles=roles_for(layers, record.layers, record.layer_roles),
                   loss=record.loss if loss_bad else None, grad_norm=None,
                   grad_norm_logged=False, assembled=1, blame=blame)


def _new(record: Record, now: float) -> _Pending:
    layers = record.layers
    n = len(layers)
    pending = _Pending(step=record.step, first=now, layers=layers,
                       index={name: i for i, name in enumerate(layers)},
                       acc=np.zeros(n), seen=np.zeros(n, np.int32))
    if isinstance(record, Stats):
        pending.updates, pending.updates_seen = np.zeros(n), np.zeros(n, np.int32)
    return pending


def _add(pending: _Pending, record: Record, shards: int) -> None:
    if record.rank in pending.ranks:
        return  # a duplicate (a resent batch): counted once
    pending.ranks.add(record.rank)
    pending.last_time = max(pending.last_time, record.time)
    if pending.lowest is None or record.rank < pending.lowest.rank:
        pending.lowest = record
    values = record.weight_norms if isinstance(record, Stats) else record.layer_norms
    if isinstance(record, Step):
        if record.loss is not None:
            pending.loss_sum += record.loss
            pending.loss_n += 1
        pending.skipped |= record.skipped
        names, loss_bad = nonfinite_layers(record), _loss_bad(record)
        if names or loss_bad:
            pending.bad.append((record.time, record.rank, names, loss_bad))
    if values is None:
        return
    shard = record.rank % shards
    if shard in pending.shards_seen:
        # Another replica of this shard was added: replicas hold the same gradient,
        # unless one went bad on its own (a faulty device): its non-finite values count.
        _poison(pending, record.layers, np.asarray(values, np.float64))
        return
    pending.shards_seen.add(shard)
    squares = np.square(np.asarray(values, np.float64))
    known: np.ndarray | None = None
    if record.layers == pending.layers:
        pending.acc += squares
        pending.seen += 1
        rows: np.ndarray | slice = slice(None)
    else:  # some cells not measured on this rank, or another layout: align by name
        rows = np.array([pending.index.get(name, -1) for name in record.layers], np.int64)
        known = rows >= 0
        rows, squares = rows[known], squares[known]
        pending.acc[rows] += squares
        pending.seen[rows] += 1
    if isinstance(record, Stats) and record.update_ratios is not None \
            and pending.updates is not None and pending.updates_seen is not None:
        ratios = np.asarray(record.update_ratios, np.float64)
        if known is not None:
            ratios = ratios[known]
        measured = np.isfinite(ratios)  # NaN: not measured on this rank
        dw = np.where(measured, ratios, 0.0) ** 2 * squares
        pending.updates[rows] += dw
        pending.updates_seen[rows] += measured


def _poison(pending: _Pending, layers: tuple[str, ...], values: np.ndarray) -> None:
    """Make the layers where ``values`` is non-finite non-finite in the sum too."""
    for j in np.flatnonzero(~np.isfinite(values)).tolist():
        i = pending.index.get(layers[j])
        if i is not None:
            pending.acc[i] += values[j] * values[j]  # nan stays nan; inf makes the sum inf


def _loss_bad(step: Step) -> bool:
    return step.loss is not None and not math.isfinite(step.loss)


def _ratios(pending: _Pending, keep: np.ndarray, norms: np.ndarray,
            shards: int) -> np.ndarray | None:
    if pending.updates is None or pending.updates_seen is None or not pending.updates_seen.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(pending.updates_seen >= shards,
                          np.sqrt(pending.updates) / np.maximum(norms, 1e-30), np.nan)
    out = ratios[keep]
    out.flags.writeable = False
    return out


def _blame(stream: _Stream, pending: _Pending, norms: np.ndarray,
           loss: float | None) -> dict[str, int]:
    """Per non-finite layer (and "loss"), the rank where it first went non-finite."""
    bad_layers = [name for name, ok in zip(pending.layers, np.isfinite(norms).tolist(), strict=True)
                  if not ok]
    loss_bad = loss is not None and not math.isfinite(loss)  # the mean over ranks
    if not bad_layers and not loss_bad:
        stream.first_bad.clear()  # a clean step ends the incident
        return {}
    # Data-parallel jobs combine gradients before the optimizer sees them, so a NaN
    # born on one rank shows on every rank's gradients at the same step; only that
    # rank's own loss went non-finite. Those reports come first, then by time, rank.
    reports = sorted(pending.bad, key=lambda bad: (not bad[3], bad[0], bad[1]))
    for name in bad_layers[:MAX_BLAMED]:
        if name not in stream.first_bad:
            culprit = next((rank for _, rank, names, _ in reports if name in names), None)
            if culprit is not None:
                stream.first_bad[name] = culprit
    if loss_bad and "loss" not in stream.first_bad:
        culprit = next((rank for _, rank, _, lb in reports if lb), None)
        if culprit is not None:
            stream.first_bad["loss"] = culprit
    wanted = set(bad_layers[:MAX_BLAMED]) | ({"loss"} if loss_bad else set())
    return {name: rank for name, rank in stream.first_bad.items() if name in wanted}
