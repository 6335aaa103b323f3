"""Assemble one job-wide step from every rank's report, exactly, with no collective in the job.

Each rank's agent sends, per layer, the L2 norm of *its* gradient (its shard
under FSDP/ZeRO/tensor parallelism, the whole all-reduced gradient under DDP)
and declares how many ranks one pipeline stage's gradients are split across
(``shards``, docs/wire.md). The :class:`Assembler` squares the norms in
float64 and adds one report per shard, so a layer's assembled norm is the
global norm the job would compute with an all-reduce. Rank ``r`` holds shard
``r % shards`` (DDP: every rank holds shard 0, so any one rank suffices).

Pipeline stages hold different layers, so a step's layers are the union of
every rank's, by name (``_Catalog``, :mod:`gradwatch.rules.assembly_state`), in
model order: by the lowest rank that reported a layer, then its position there
(stage ``s``'s lowest rank grows with ``s`` in every row-major DeviceMesh).
Replicas are told apart per stage: two reports are of one replica group when
they have the same shard index and begin with the same layer. A rank that sends
no layers (a data-parallel replica whose group already has a reporter,
agent/topology.py) still counts as having reported its step: its loss, flags
and timing are its own.

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
from dataclasses import replace

import numpy as np

from gradwatch.rules.assembly_state import (
    FLAGGED,
    MAX_LAYOUTS,
    NONFINITE_SCALAR,
    AssemblyCounts,
    Record,
    _add,
    _grow,
    _new,
    _new_step,
    _Pending,
    _Stream,
)
from gradwatch.rules.assembly_verdict import (
    MAX_BLAMED,
    _blame,
    _complete,
    _nonfinite_only,
    _ratios,
)
from gradwatch.rules.step import QuietRows, Stats, Step

__all__ = [
    "MAX_BLAMED",
    "MAX_LAYOUTS",
    "MAX_PENDING_STEPS",
    "NONFINITE_SCALAR",
    "Assembler",
    "AssemblyCounts",
    "Record",
    "assembles",
]

MAX_PENDING_STEPS = 256  # per job and kind: beyond it the oldest is emitted as is


def assembles(record: Record) -> bool:
    """Whether ``record`` belongs to a job the collector judges as a whole."""
    return record.shards > 0 and record.world > 1


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

    def add_quiet(self, rows: QuietRows) -> list[Record]:
        """``add`` of each row's ``Step``, in row order, without building those Steps.

        The same pending sums, counters and emitted steps: a row that is late,
        goes back in time, or meets a new (or rescaled) job's first report takes
        ``add`` with its ``Step``; every other row only adds its rank, loss and
        flags (a rank without layers adds nothing per layer). Issue 17: 16,352 of
        a 16,384-rank job's batches carry no layers.
        """
        out: list[Record] = []
        key, rank = (rows.job, "step"), rows.rank
        times, losses, skipped, flagged = rows.times, rows.loss, rows.skipped, rows.flagged
        stream: _Stream | None = None
        ready = True  # whether _ready may emit something after this row
        for r, step in enumerate(rows.steps):
            if stream is None:
                stream = self._streams.get(key)
                if stream is not None and (stream.world, stream.shards) != (
                    rows.world,
                    rows.shards,
                ):
                    stream = None
            if stream is None or step <= stream.emitted:
                out += self.add(rows.step(r))  # may replace the stream: look it up again
                stream, ready = None, True
                continue
            stream.rank_step[rank] = step
            stream.known.add(rank)
            pending = stream.pending.get(step)
            if pending is None:
                pending = stream.pending[step] = _new_step(step, self._clock())
            stream.absent.discard(rank)
            if rank not in pending.ranks:  # else a duplicate (a resent batch): counted once
                # _add of a Step without layers (assembly_state._add), from the columns.
                pending.ranks.add(rank)
                when, loss = times[r], losses[r]
                if when > pending.last_time:
                    pending.last_time = when
                if pending.lowest is None or rank < pending.lowest.rank:
                    pending.lowest = rows.step(r)
                if loss is not None:
                    pending.loss_sum += loss
                    pending.loss_n += 1
                    loss_bad = not math.isfinite(loss)
                else:
                    loss_bad = False
                if skipped[r]:
                    pending.skipped = True
                if flagged[r]:  # its NONFINITE_SCALAR over 0.5, and no layers of its own
                    pending.flagged = True
                    pending.bad.append((when, rank, FLAGGED, loss_bad))
                elif loss_bad:
                    pending.bad.append((when, rank, frozenset(), loss_bad))
            # After the first row's call, only a report to the lowest pending step can
            # complete a step (adding a known rank or un-marking an absent one never
            # does), and only a new pending step can exceed MAX_PENDING_STEPS; the
            # deadlines were checked on the first row and again at the next expire().
            if ready or step == min(stream.pending) or len(stream.pending) > MAX_PENDING_STEPS:
                out += self._ready(stream)
                ready = False
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
