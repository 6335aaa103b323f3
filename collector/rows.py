"""Batch values to rows: a schema compiled once to column indices, then rows decoded by it.

An agent's ``Schema`` names the columns of its batches (loss, learning rates,
scalars, per-layer gradient norms, or for cadence statistics weight norms,
activation shares and update ratios). :func:`compile_plan` turns one into a
:class:`Plan` of column indices, once per schema; :func:`step_rows` and
:func:`stats_rows` decode a batch's ``float32`` values through it into the
``Step`` and ``Stats`` records the rules read. Missing cells (the wire's
``MISSING_BITS``) become ``None``: "not measured", never zero.

Example::

    import numpy as np
    from gradwatch.wire import Batch, Schema

    schema = Schema(id=1, columns=("loss",), layers=("w",))
    values = np.array([[2.5, 0.1]], "<f4").tobytes()
    batch = Batch("run-1", 0, 1, 1, 0, "inc", 0, (7,), (0.0,), values, schema)
    (step,) = step_rows(batch, compile_plan(schema))
    assert step.loss == 2.5
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gradwatch.rules.liveness import PRE_SYNC_PHASES
from gradwatch.rules.step import FLOAT32_MAX, ActStats, QuietRows, Stats, Step, build_step
from gradwatch.wire import MISSING_BITS, Batch, Schema
from gradwatch.wire import columns as col

# Largest finite value of the gradients' dtype, named by the schema.
_DTYPE_MAX = {
    "float16": 65504.0,
    "half": 65504.0,
    "bfloat16": float.fromhex("0x1.fep127"),
    "float32": FLOAT32_MAX,
    "float": FLOAT32_MAX,
    "float64": float(np.finfo(np.float64).max),
    "double": float(np.finfo(np.float64).max),
}


@dataclass(frozen=True, slots=True)
class Plan:
    """A schema compiled to column indices, once per schema rather than per row."""

    schema: Schema
    loss: int | None
    loss_scale: int | None
    skipped: int | None
    grad_norm: int | None
    lr: tuple[int, ...]
    scalars: tuple[tuple[str, int], ...]
    first_layer: int
    dtype_max: float
    stats: bool = False  # a cadence-statistics schema: layer values are weight norms
    # Activation columns of a cadence-statistics schema, per module:
    # (module, kind, mean, std, zero_frac, sat_frac) column indices.
    acts: tuple[tuple[str, str, int, int, int | None, int | None], ...] = ()
    # Update-ratio column index per layer (-1: none), or () when the schema has none.
    ratios: tuple[int, ...] = ()


def compile_plan(schema: Schema) -> Plan:
    index = {name: i for i, name in enumerate(schema.columns)}
    groups = sorted(
        (int(name[len(col.LR_PREFIX) :]), i)
        for name, i in index.items()
        if name.startswith(col.LR_PREFIX) and name[len(col.LR_PREFIX) :].isdigit()
    )
    grad_norm = col.scalar(col.GRAD_NORM_SCALAR)
    scalars = tuple(
        (name[len(col.SCALAR_PREFIX) :], i)
        for name, i in index.items()
        if name.startswith(col.SCALAR_PREFIX) and name != grad_norm
    )
    dtype = schema.dtype.removeprefix("torch.").lower()
    return Plan(
        schema=schema,
        loss=index.get(col.LOSS),
        loss_scale=index.get(col.LOSS_SCALE),
        skipped=index.get(col.SKIPPED),
        grad_norm=index.get(grad_norm),
        lr=tuple(i for _, i in groups),
        scalars=scalars,
        first_layer=len(schema.columns),
        dtype_max=_DTYPE_MAX.get(dtype, FLOAT32_MAX),
        stats=col.WEIGHT_NORMS in index,
        acts=_act_plan(index) if col.WEIGHT_NORMS in index else (),
        ratios=_ratio_plan(index, schema.layers) if col.WEIGHT_NORMS in index else (),
    )


def _ratio_plan(index: Mapping[str, int], layers: tuple[str, ...]) -> tuple[int, ...]:
    found = [index.get(col.update_ratio(layer), -1) for layer in layers]
    return tuple(found) if any(i >= 0 for i in found) else ()


def _act_plan(
    index: Mapping[str, int],
) -> tuple[tuple[str, str, int, int, int | None, int | None], ...]:
    """Group ``act/<module>/<kind>/<stat>`` columns by module; a module needs mean and std."""
    found: dict[tuple[str, str], dict[str, int]] = {}
    for name, i in index.items():
        if not name.startswith(col.ACT_PREFIX):
            continue
        parts = name[len(col.ACT_PREFIX) :].rsplit("/", 2)
        if len(parts) != 3 or not parts[0]:
            continue  # not ours to read: receivers ignore columns they do not know
        module, kind, stat = parts
        found.setdefault((module, kind), {})[stat] = i
    return tuple(
        (
            module,
            kind,
            stats[col.ACT_MEAN],
            stats[col.ACT_STD],
            stats.get(col.ACT_ZERO_FRAC),
            stats.get(col.ACT_SAT_FRAC),
        )
        for (module, kind), stats in found.items()
        if col.ACT_MEAN in stats and col.ACT_STD in stats
    )


def stats_rows(batch: Batch, plan: Plan) -> tuple[Stats, ...]:
    """One ``Stats`` per row, with the layers whose weight norm was measured."""
    rows, first = len(batch.steps), plan.first_layer
    raw = np.frombuffer(batch.values, "<f4").reshape(rows, plan.schema.width)
    measured = raw[:, first:].view("<u4") != MISSING_BITS
    norms = raw[:, first:].astype(np.float64)
    named = raw[:, :first].astype(np.float64).tolist()
    named_missing = (raw[:, :first].view("<u4") == MISSING_BITS).tolist()
    out = []
    for r in range(rows):
        values, gone = named[r], named_missing[r]
        acts = tuple(
            ActStats(
                module, kind, values[m], values[s], _cell(values, gone, z), _cell(values, gone, f)
            )
            for module, kind, m, s, z, f in plan.acts
            if not gone[m] and not gone[s]
        )
        keep = measured[r]
        every = bool(keep.all())
        layers = (
            plan.schema.layers
            if every
            else tuple(name for name, k in zip(plan.schema.layers, keep.tolist(), strict=True) if k)
        )
        row = norms[r] if every else norms[r][keep]
        row.flags.writeable = False
        ratios = None
        if plan.ratios:
            # NaN where a layer's ratio was not measured; None when none was.
            cells = [_cell(values, gone, i) if i >= 0 else None for i in plan.ratios]
            if any(c is not None for c in cells):
                full = np.array([math.nan if c is None else c for c in cells], np.float64)
                ratios = full if every else full[keep]
                ratios.flags.writeable = False
        out.append(
            Stats(
                job=batch.job,
                step=batch.steps[r],
                time=batch.times[r],
                rank=batch.rank,
                layers=layers,
                weight_norms=row,
                act=acts,
                update_ratios=ratios,
                world=batch.world,
                shards=batch.shards or 0,
                census=batch.census if r == rows - 1 else None,
            )
        )
    return tuple(out)


def step_rows(batch: Batch, plan: Plan) -> tuple[Step, ...]:
    """One ``Step`` per row; a MISSING cell becomes ``None`` (or is left out)."""
    raw = np.frombuffer(batch.values, "<f4").reshape(len(batch.steps), plan.schema.width)
    missing = raw.view("<u4") == MISSING_BITS
    if plan.first_layer == plan.schema.width:
        return _scalar_rows(batch, plan, raw, missing)
    return _layer_rows(batch, plan, raw, missing)


def _layer_rows(batch: Batch, plan: Plan, raw: np.ndarray, missing: np.ndarray) -> tuple[Step, ...]:
    """``step_rows`` of any schema (with layers: their norms, total and missing cells per row)."""
    rows, first = len(batch.steps), plan.first_layer
    # Named columns as Python lists: per-cell access below is list indexing.
    named = raw[:, :first].astype(np.float64).tolist()
    named_missing = missing[:, :first].tolist()
    norms = raw[:, first:].astype(np.float64)
    layer_missing = missing[:, first:]
    measured = ~layer_missing
    n_measured = measured.sum(axis=1)
    totals = np.sqrt(np.square(np.where(measured, norms, 0.0)).sum(axis=1))
    layers = plan.schema.layers
    roles = plan.schema.layer_roles

    steps = []
    for r in range(rows):
        values, gone = named[r], named_missing[r]
        if n_measured[r] == len(layers):
            # A copy, not a view: the state keeps each rank's latest step, and a
            # view would keep the whole batch (flush_every rows) alive per rank.
            row_layers, row_norms, row_roles = layers, norms[r].copy(), roles
        else:
            keep = measured[r]
            kept = keep.tolist()
            row_layers = tuple(name for name, k in zip(layers, kept, strict=True) if k)
            row_norms = norms[r][keep]
            row_roles = (
                tuple(role for role, k in zip(roles, kept, strict=True) if k) if roles else ()
            )
        row_norms.flags.writeable = False
        grad_norm = _cell(values, gone, plan.grad_norm)
        logged = grad_norm is not None
        if grad_norm is None and n_measured[r]:
            grad_norm = float(totals[r])
        lr = () if any(gone[i] for i in plan.lr) else tuple(values[i] for i in plan.lr)
        skipped = _cell(values, gone, plan.skipped)
        steps.append(
            build_step(
                job=batch.job,
                step=batch.steps[r],
                time=batch.times[r],
                rank=batch.rank,
                loss=_cell(values, gone, plan.loss),
                grad_norm=grad_norm,
                layers=row_layers,
                layer_norms=row_norms,
                lr=lr,
                loss_scale=_cell(values, gone, plan.loss_scale),
                skipped=skipped is not None and skipped > 0.5,
                scalars={name: values[i] for name, i in plan.scalars if not gone[i]},
                dtype_max=plan.dtype_max,
                grad_norm_logged=logged,
                world=batch.world,
                shards=batch.shards or 0,
                layer_roles=row_roles,
            )
        )
    return tuple(steps)


# The layers of a row without any: one read-only empty array shared by every such
# row (the state keeps each rank's latest step: 16,352 of a 16,384-rank job's
# ranks send none, issue 17).
_NO_NORMS = np.zeros(0)
_NO_NORMS.flags.writeable = False


def _scalar_rows(
    batch: Batch, plan: Plan, raw: np.ndarray, missing: np.ndarray
) -> tuple[Step, ...]:
    """``step_rows`` of a schema without layers: the same ``Step`` values, no numpy per row.

    Most ranks of a large job send only their loss, learning rates and a few
    scalars (one replica per model shard sends layers); at 16,384 ranks a flush
    is 16,352 such batches, so per-row numpy calls were most of ingest's cost.
    """
    return _quiet(batch, plan, raw, missing).all_steps()


def quiet_rows(batch: Batch, plan: Plan) -> QuietRows:
    """The rows of a batch whose schema has no layers, as columns (``QuietRows``).

    The collector hands these to its per-rank state and the assembler whole
    (issue 17); ``QuietRows.step(r)`` is ``step_rows(batch, plan)[r]``.
    """
    raw = np.frombuffer(batch.values, "<f4").reshape(len(batch.steps), plan.schema.width)
    return _quiet(batch, plan, raw, raw.view("<u4") == MISSING_BITS)


def _quiet(batch: Batch, plan: Plan, raw: np.ndarray, missing: np.ndarray) -> QuietRows:
    rows = len(batch.steps)
    # Column by column, None where a cell is missing (a value is never None otherwise).
    columns: list[list[float | None]] = raw.T.astype(np.float64).tolist()
    any_missing = bool(missing.any())
    if any_missing:
        columns = [
            [None if g else v for v, g in zip(values, gone, strict=True)]
            for values, gone in zip(columns, missing.T.tolist(), strict=True)
        ]
    absent: list[float | None] = [None] * rows

    def column(i: int | None) -> list[float | None]:
        return absent if i is None else columns[i]

    job, rank, world, shards = batch.job, batch.rank, batch.world, batch.shards or 0
    layers, roles, dtype_max = plan.schema.layers, plan.schema.layer_roles, plan.dtype_max
    loss, norm, scale, skip = (
        column(plan.loss),
        column(plan.grad_norm),
        column(plan.loss_scale),
        column(plan.skipped),
    )
    lr_cols = [columns[i] for i in plan.lr]
    scalar_cols = [(name, columns[i]) for name, i in plan.scalars]
    # One missing learning rate leaves the row's ``lr`` empty, as in ``_layer_rows``.
    lr_gone: list[bool] = (
        np.logical_or.reduce(missing[:, list(plan.lr)], axis=1).tolist()
        if plan.lr and any_missing
        else [False] * rows
    )
    steps, times = batch.steps, batch.times

    def build(r: int) -> Step:
        grad_norm, skipped = norm[r], skip[r]
        # Positional, in _StepBuilder.__init__'s order (~2x cheaper than keywords);
        # tests/collector/test_ingest_speed.py checks every field against
        # _layer_rows, which names them.
        return build_step(
            job,
            steps[r],
            times[r],
            rank,
            loss[r],
            grad_norm,
            layers,
            _NO_NORMS,  # layer_norms
            () if lr_gone[r] else tuple([c[r] for c in lr_cols]),  # lr
            scale[r],  # loss_scale
            skipped is not None and skipped > 0.5,  # skipped
            {name: c[r] for name, c in scalar_cols if c[r] is not None},  # scalars
            dtype_max,
            grad_norm is not None,  # grad_norm_logged
            world,
            shards,
            roles,  # layer_roles
        )

    scalar = dict(plan.scalars)
    # The step phases as rules.liveness.PhaseTimes reads them from a Step's scalars.
    phases = [columns[scalar[name]] for name in PRE_SYNC_PHASES if name in scalar]
    flag = column(scalar.get(col.GRAD_NONFINITE_SCALAR))
    return QuietRows(
        job=job,
        rank=rank,
        world=world,
        shards=shards,
        steps=steps,
        times=times,
        loss=loss,
        grad_norm=norm,
        skipped=[v is not None and v > 0.5 for v in skip],
        flagged=[v is not None and v > 0.5 for v in flag],
        data=column(scalar.get(col.DATA_SECONDS_SCALAR)),
        busy=[_sum(cells) for cells in zip(*phases, strict=True)] if phases else absent,
        build=build,
    )


def _sum(cells: tuple[float | None, ...]) -> float | None:
    present = [c for c in cells if c is not None]
    return sum(present) if present else None


def _cell(values: list[float], gone: list[bool], i: int | None) -> float | None:
    return None if i is None or gone[i] else values[i]
