"""The state :mod:`gradwatch.rules.assembly` keeps per job: the layer union and the pending sums.

:class:`_Catalog` is the union of every rank's layer names, by name, in model
order (lowest reporting rank, then position there). :class:`_Pending` is one
step (or cadence sample) being assembled: per catalog row, the sum of squared
norms over shards and how many shard reports it holds. :func:`_add` adds one
rank's report to it (one report per shard and replica group; a second replica
only contributes its non-finite values, :func:`_poison`). :class:`_Stream` is a
job's assembly state for one kind (steps or stats).

These are internals of :class:`gradwatch.rules.assembly.Assembler`, split out
so that module keeps only the step ordering and emission; the public names
(``AssemblyCounts``, ``Record``, ``MAX_LAYOUTS``, ``NONFINITE_SCALAR``) are
re-exported there. Pure: no I/O, no clock.

Example::

    stream = _Stream(world=4, shards=2)
    pending = _new(record, now)
    _add(pending, record, stream)     # pending.acc[rows] += norms ** 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gradwatch.rules.step import Stats, Step, nonfinite_layers
from gradwatch.wire.columns import GRAD_NONFINITE_SCALAR

# What a rank's fused non-finite flag blames when it sends no layers (agent/topology.py).
FLAGGED = frozenset({"grad_norm"})

# A scalar a rank that sends no per-layer norms sets to 1.0 when any of its own
# gradients is NaN/Inf (agent/topology.reports_layers): a replica gone bad alone.
NONFINITE_SCALAR = GRAD_NONFINITE_SCALAR

Record = Step | Stats


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


def _new(record: Record, now: float) -> _Pending:
    pending = _new_step(record.step, now)
    if isinstance(record, Stats):
        pending.updates, pending.updates_seen = np.zeros(0), np.zeros(0, np.int32)
    return pending


def _new_step(step: int, now: float) -> _Pending:
    """``_new`` of a ``Step`` at ``step``."""
    return _Pending(step=step, first=now, acc=np.zeros(0), seen=np.zeros(0, np.int32))


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
            names = FLAGGED
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
        # An unmeasured ratio adds nothing, even beside a weight norm gone infinite (a
        # diverged run: 0 * inf printed a RuntimeWarning on the collector's stderr).
        with np.errstate(invalid="ignore", over="ignore"):
            dw = np.where(measured, ratios**2 * squares, 0.0)
        pending.updates[rows] += dw
        pending.updates_seen[rows] += measured


def _poison(pending: _Pending, rows: np.ndarray, values: np.ndarray) -> None:
    """Make the layers where ``values`` is non-finite non-finite in the sum too."""
    for j in np.flatnonzero(~np.isfinite(values)).tolist():
        i = int(rows[j])
        pending.acc[i] += values[j] * values[j]  # nan stays nan; inf makes the sum inf


def _loss_bad(step: Step) -> bool:
    return step.loss is not None and not math.isfinite(step.loss)
