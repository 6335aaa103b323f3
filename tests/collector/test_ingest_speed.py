"""The collector's fast path for large jobs (issue 17, 16,384 ranks) changes no result.

Rows of a schema without layers (most ranks of a 3D-parallel job) skip the
per-row numpy work: they must decode to exactly the ``Step`` the general path
builds, missing cells and real NaNs included.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.collector.rows import _layer_rows, compile_plan, step_rows
from gradwatch.rules.step import Step
from gradwatch.wire import MISSING_BITS, Batch, Schema
from gradwatch.wire import columns as col

COLUMNS = (
    col.LOSS,
    col.lr(0),
    col.lr(1),
    col.SKIPPED,
    col.LOSS_SCALE,
    col.scalar(col.GRAD_NORM_SCALAR),
    col.scalar("grad_nonfinite"),
    "x/unknown",  # a column this collector does not read
)
MISSING = np.array([MISSING_BITS], "<u4").view("<f4")[0]


def _batch(schema: Schema, values: np.ndarray, shards: int | None = 4) -> Batch:
    rows = len(values)
    return Batch(
        job="j",
        rank=3,
        world=8,
        schema_id=schema.id,
        seq=0,
        incarnation="inc",
        dropped=0,
        steps=tuple(range(100, 100 + rows)),
        times=tuple(1.7e9 + r for r in range(rows)),
        values=values.astype("<f4").tobytes(),
        schema=schema,
        shards=shards,
    )


def _fields(step: Step) -> str:
    """Every field, as text: NaN != NaN, but repr(nan) == repr(nan); floats repr exactly."""
    out = {name: getattr(step, name) for name in Step.__dataclass_fields__}
    out["layer_norms"] = (step.layer_norms.dtype.str, step.layer_norms.tolist())
    return repr(out)


@pytest.mark.parametrize("columns", [COLUMNS, (col.LOSS,), (col.lr(0), col.SKIPPED)])
@pytest.mark.parametrize("shards", [4, None])
def test_rows_without_layers_decode_as_the_general_path_does(
    columns: tuple[str, ...], shards: int | None
) -> None:
    schema = Schema(id=0, columns=columns, layers=(), dtype="torch.bfloat16")
    rng = np.random.default_rng(17)
    values = rng.normal(size=(12, len(columns))).astype("<f4")
    values[rng.random(values.shape) < 0.3] = MISSING  # not measured
    values[0, 0] = np.nan  # a real NaN, not a missing cell
    values[1, :] = MISSING
    if col.SKIPPED in columns:
        values[2, columns.index(col.SKIPPED)] = 1.0
    batch = _batch(schema, values, shards)
    plan = compile_plan(schema)
    raw = np.frombuffer(batch.values, "<f4").reshape(len(values), schema.width)
    missing = raw.view("<u4") == MISSING_BITS

    fast = step_rows(batch, plan)
    general = _layer_rows(batch, plan, raw, missing)

    assert [_fields(s) for s in fast] == [_fields(s) for s in general]
    # A real NaN stays a NaN (the first column: the loss, or the only learning rate).
    first = fast[0].loss if columns[0] == col.LOSS else fast[0].lr[0]
    assert first is not None and math.isnan(first)
    assert fast[1].loss is None and fast[1].lr == () and fast[1].scalars == {}
    if col.SKIPPED in columns:
        assert fast[2].skipped
    for step in fast:
        assert step.layer_norms.size == 0 and not step.layer_norms.flags.writeable


def test_the_general_path_still_serves_schemas_with_layers() -> None:
    schema = Schema(id=0, columns=(col.LOSS,), layers=("a", "b"))
    values = np.array([[1.0, 3.0, 4.0], [2.0, MISSING, 1.0]], "<f4")
    (first, second) = step_rows(_batch(schema, values), compile_plan(schema))
    assert first.layers == ("a", "b") and first.grad_norm == 5.0
    assert second.layers == ("b",) and second.layer_norms.tolist() == [1.0]
