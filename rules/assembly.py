"""Assemble one job-wide step from every rank's report, exactly, with no collective in the job.

Each rank's agent sends, per layer, the L2 norm of *its* gradient (its shard
under FSDP/ZeRO/tensor parallelism, the whole all-reduced gradient under DDP)
and declares how many ranks one pipeline stage's gradients are split across
(``shards``, docs/wire.md). The :class:`Assembler` squares the norms in
float64 and adds one report per shard, so a layer's assembled norm is the
global norm the job would compute with an all-reduce. Rank ``r`` holds shard
``r % shards`` (DDP: every rank holds shard 0, so any one rank suffices).

Pipeline stages hold different layers, so a step's layers are the union of
every rank's, by name (:class:`_Catalog`), in model order: by the lowest rank
that reported a layer, then its position there (stage ``s``'s lowest rank grows
with ``s`` in every row-major DeviceMesh). Replicas are told apart per stage:
two reports are of one replica group when they have the same shard index and
begin with the same layer. A rank that sends no layers (a data-parallel replica
whose group already has a reporter, agent/topology.py) still counts as having
reported its step: its loss, flags and timing are its own.

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
from gradwatch.wire.columns import GRAD_NONFINITE_SCALAR

MAX_PENDING_STEPS = 256  # per job and kind: beyond it the oldest is emitted as is
MAX_BLAMED = 64  # layers named in one step's blame
# A scalar a rank that sends no per-layer norms sets to 1.0 when any of its own
# gradients is NaN/Inf (agent/topology.reports_layers): a replica gone bad alone.
NONFINITE_SCALAR = GRAD_NONFINITE_SCALAR

Record = Step | Stats


def assembles(record: Record) -> bool:
    """Whether ``record`` belongs to a job the collector judges as a whole."""
    return record.shards > 0 and record.world > 1


@dataclass(slots=True)
class AssemblyCounts:
    """Cumulative counters of one job, for exposition (``Assembler.counts`` hands out copies)."""

    steps: int = 0  # steps emitted
    incomplete: int = 0  # emitted at the deadline without every expected rank
    inexact: int = 0  # emitted with some layers left out (a shard missing)
    late: int = 0  # reports of a step already emitted, dropped
    restarts: int = 0


MAX_LAYOUTS = 4096  # distinct layer lists remembered per job (one per stage and schema)


@dataclass(slots=True)
class _Catalog:
    """Every layer name a job's ranks reported, and their model order across stages."""

    names: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    # Per name: (lowest rank that reported it, its position in that rank's list).
    keys: list[tuple[int, int]] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    order: np.ndarray | None = None  # catalog rows in model order; None: to be sorted
    # id(layers tuple) -> (that tuple, its catalog rows, lowest rank seen with it).
    cache: dict[int, tuple[tuple[str, ...], np.ndarray, int]] = field(default_factory=dict)
    # The last emitted layer tuple and its rows: reused while unchanged, so
    # rules that key on a step's layers see one object step after step.
    emitted: tuple[np.ndarray, tuple[str, ...]] = (np.zeros(0, np.int64), ())

    def rows(self, layers: tuple[str, ...], roles: tuple[str, ...], rank: int) -> np.ndarray:
        """Catalog rows of ``layers``, adding new names (ingest shares one tuple per schema)."""
        hit = self.cache.get(id(layers))
        if hit is not None and hit[0] is layers and hit[2] <= rank:
            return hit[1]
        rows = np.empty(len(layers), np.int64)
        for pos, name in enumerate(layers):
            i = self.index.get(name)
            if i is None:
                i = self.index[name] = len(self.names)
                self.names.append(name)
                self.keys.append((rank, pos))
                self.order = None
            elif rank < self.keys[i][0]:
                self.keys[i] = (rank, pos)
                self.order = None
            rows[pos] = i
        if roles and len(roles) == len(layers):
            self.roles.update(zip(layers, roles, strict=True))
        if len(self.cache) >= MAX_LAYOUTS:
            self.cache.clear()
        self.cache[id(layers)] = (layers, rows, rank)
        return rows

    def names_of(self, rows: np.ndarray) -> tuple[str, ...]:
        last_rows, last = self.emitted
        if not np.array_equal(rows, last_rows):
            last = tuple(self.names[i] for i in rows.tolist())
            self.emitted = (rows, last)
        return last

    def model_order(self) -> np.ndarray:
        if self.order is None or len(self.order) != len(self.names):
            self.order = np.array(
                sorted(range(len(self.names)), key=self.keys.__getitem__), np.int64
            )
        return self.order


@dataclass(slots=True)
class _Pending:
    """One step (or cadence sample) being assembled; arrays are indexed by catalog row."""

    step: int
    first: float  # collector clock at its first report
    acc: np.ndarray  # per layer: sum of squares over shards (weights for stats)
    seen: np.ndarray  # per layer: shard reports added
    # (shard index, first layer's catalog row) of each replica group already added.
    shards_seen: set[tuple[int, int]] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    lowest: Record | None = None
    last_time: float = 0.0
    loss_sum: float = 0.0
    loss_n: int = 0
    skipped: bool = False
    flagged: bool = False  # a rank without layers flagged a non-finite gradient
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
    catalog: _Catalog = field(default_factory=_Catalog)


class Assembler:
    """Per job: rank reports in, whole steps out, in step order; see the module docstring."""

    def __init__(
        self, deadline_seconds: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
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
            late = _nonfinite_only(record)
            return out + ([late] if late is not None else [])
        pending = stream.pending.get(record.step)
        if pending is None:
            pending = stream.pending[record.step] = _new(record, self._clock())
        stream.absent.discard(record.rank)  # it reports a step still being assembled
        _add(pending, record, stream)
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
        return {
            job: replace(stream.counts)
            for (job, kind), stream in self._streams.items()
            if kind == "step"
        }

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
            if (
                not complete
                and now - pending.first < self.deadline_seconds
                and len(stream.pending) <= MAX_PENDING_STEPS
            ):
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
        catalog = stream.catalog
        _grow(pending, len(catalog.names))
        # Model order, and only layers some rank reported this step.
        rows = catalog.model_order()
        rows = rows[pending.seen[rows] > 0]
        acc = pending.acc[rows]
        exact = pending.seen[rows] >= stream.shards
        norms = np.sqrt(acc)
        keep = exact | ~np.isfinite(norms)
        # A whole stage missing leaves no partial layer, only absent ones: inexact too.
        gone = bool((pending.seen[catalog.emitted[0]] == 0).any())
        stream.counts.inexact += gone or not keep.all()
        stream.counts.steps += 1
        kept_rows = rows if keep.all() else rows[keep]
        layers = catalog.names_of(kept_rows)
        kept = norms if keep.all() else norms[keep]
        kept.flags.writeable = False
        lowest = pending.lowest
        assert lowest is not None
        if isinstance(lowest, Stats):
            return replace(
                lowest,
                layers=layers,
                weight_norms=kept,
                update_ratios=_ratios(pending, rows, keep, norms, stream.shards),
                assembled=len(pending.ranks),
                time=pending.last_time,
            )
        loss = pending.loss_sum / pending.loss_n if pending.loss_n else None
        # The total needs every layer exactly, unless a non-finite layer already decides it.
        total = (
            float(np.sqrt(acc.sum()))
            if len(rows) and (exact.all() or not np.isfinite(acc).all())
            else None
        )
        grad_norm = lowest.grad_norm if lowest.grad_norm_logged else total
        if pending.flagged and grad_norm is not None and math.isfinite(grad_norm):
            grad_norm = math.nan  # a replica's own gradients went bad: the job's did
        roles = catalog.roles
        layer_roles = tuple(roles[n] for n in layers) if all(n in roles for n in layers) else ()
        return replace(
            lowest,
            layers=layers,
            layer_norms=kept,
            loss=loss,
            grad_norm=grad_norm,
            layer_roles=layer_roles,
            skipped=pending.skipped,
            assembled=len(pending.ranks),
            time=pending.last_time,
            blame=_blame(stream, pending, layers, kept, loss, grad_norm),
        )


def _complete(stream: _Stream, pending: _Pending) -> bool:
    """Whether nobody is left to wait for.

    The job's first step waits for the whole world (agents may connect after
    another rank's first batch). After it: every rank heard from and not absent
    has reported. A shard still missing then is held only by absent ranks or
    ranks never heard from, which are not waited for (and the check stays
    O(1) until every rank not absent reported, then O(absent ranks), never
    O(world): a hostile header may claim a huge world).
    """
    if not stream.counts.steps:  # nothing emitted yet: this is the job's first step
        return len(pending.ranks) >= stream.world
    # Reporting ranks are all known; absent ones are not waited for. At most
    # len(absent) are gone: below that bound the step cannot be complete, so the
    # exact count (O(absent), thousands of ranks after an outage) runs only near the end.
    if len(pending.ranks) + len(stream.absent) < len(stream.known):
        return False
    gone = sum(1 for r in stream.absent if r in stream.known and r not in pending.ranks)
    return len(pending.ranks) >= len(stream.known) - gone


def _nonfinite_only(record: Record) -> Step | None:
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
    blame = dict.fromkeys(layers[:MAX_BLAMED], record.rank)
    if loss_bad:
        blame["loss"] = record.rank
    return replace(
        record,
        layers=layers,
        layer_norms=norms,
        layer_roles=roles_for(layers, record.layers, record.layer_roles),
        loss=record.loss if loss_bad else None,
        grad_norm=None,
        grad_norm_logged=False,
        assembled=1,
        blame=blame,
    )


def _new(record: Record, now: float) -> _Pending:
    pending = _Pending(step=record.step, first=now, acc=np.zeros(0), seen=np.zeros(0, np.int32))
    if isinstance(record, Stats):
        pending.updates, pending.updates_seen = np.zeros(0), np.zeros(0, np.int32)
    return pending


def _grow(pending: _Pending, n: int) -> None:
    """Widen the per-layer arrays to ``n`` catalog rows (a stage's layers seen first)."""
    extra = n - len(pending.acc)
    if extra <= 0:
        return
    pending.acc = np.concatenate([pending.acc, np.zeros(extra)])
    pending.seen = np.concatenate([pending.seen, np.zeros(extra, np.int32)])
    if pending.updates is not None and pending.updates_seen is not None:
        pending.updates = np.concatenate([pending.updates, np.zeros(extra)])
        pending.updates_seen = np.concatenate([pending.updates_seen, np.zeros(extra, np.int32)])


def _add(pending: _Pending, record: Record, stream: _Stream) -> None:
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
        if record.scalars.get(NONFINITE_SCALAR, 0.0) > 0.5 and not names:
            names = frozenset({"grad_norm"})
            pending.flagged = True
        if names or loss_bad:
            pending.bad.append((record.time, record.rank, names, loss_bad))
    if values is None or not record.layers:
        return  # nothing per layer from this rank (another replica reports them)
    roles = record.layer_roles if isinstance(record, Step) else ()
    rows = stream.catalog.rows(record.layers, roles, record.rank)
    _grow(pending, len(stream.catalog.names))
    group = (record.rank % stream.shards, int(rows[0]))
    values = np.asarray(values, np.float64)
    if group in pending.shards_seen:
        # Another replica of this shard was added: replicas hold the same gradient,
        # unless one went bad on its own (a faulty device): its non-finite values count.
        _poison(pending, rows, values)
        return
    pending.shards_seen.add(group)
    squares = np.square(values)
    pending.acc[rows] += squares
    pending.seen[rows] += 1
    if (
        isinstance(record, Stats)
        and record.update_ratios is not None
        and pending.updates is not None
        and pending.updates_seen is not None
    ):
        ratios = np.asarray(record.update_ratios, np.float64)
        measured = np.isfinite(ratios)  # NaN: not measured on this rank
        dw = np.where(measured, ratios, 0.0) ** 2 * squares
        pending.updates[rows] += dw
        pending.updates_seen[rows] += measured


def _poison(pending: _Pending, rows: np.ndarray, values: np.ndarray) -> None:
    """Make the layers where ``values`` is non-finite non-finite in the sum too."""
    for j in np.flatnonzero(~np.isfinite(values)).tolist():
        i = int(rows[j])
        pending.acc[i] += values[j] * values[j]  # nan stays nan; inf makes the sum inf


def _loss_bad(step: Step) -> bool:
    return step.loss is not None and not math.isfinite(step.loss)


def _ratios(
    pending: _Pending, rows: np.ndarray, keep: np.ndarray, norms: np.ndarray, shards: int
) -> np.ndarray | None:
    if pending.updates is None or pending.updates_seen is None or not pending.updates_seen.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios: np.ndarray = np.where(
            pending.updates_seen[rows] >= shards,
            np.sqrt(pending.updates[rows]) / np.maximum(norms, 1e-30),
            np.nan,
        )
    out: np.ndarray = ratios[keep]
    out.flags.writeable = False
    return out


def _blame(
    stream: _Stream,
    pending: _Pending,
    layers: tuple[str, ...],
    norms: np.ndarray,
    loss: float | None,
    grad_norm: float | None,
) -> dict[str, int]:
    """Per non-finite layer (and "loss"), the rank where it first went non-finite."""
    bad_layers = [
        name for name, ok in zip(layers, np.isfinite(norms).tolist(), strict=True) if not ok
    ]
    if (
        pending.flagged
        and not bad_layers
        and grad_norm is not None
        and not math.isfinite(grad_norm)
    ):
        bad_layers = ["grad_norm"]  # only a flag: no layer to name
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
