"""Batches without layers handled as columns (issue 17) change no result.

At 16,384 ranks, 16,352 of a flush's batches carry no layer norms; the
collector hands their rows to the per-rank state and the assembler as columns
(``QuietRows``) instead of one ``Step`` per row. These tests run the same
messages through a pipeline with that path and one without it (one ``Step``
per row, as before) and compare everything the rules and the metrics read:
every record judged, every alert transition, the assembler's counters and
absent ranks, and each rank's state and liveness. The messages go through
the cases that leave the fast path: NaN losses and non-finite flags on
ranks without layers, missing cells, step phases, duplicates, reports out of
order, a rank that misses the deadline and reports late (with a NaN), a rank
that goes back in time, and a job that changes scale.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.rows import compile_plan, quiet_rows, step_rows
from gradwatch.collector.server import Server
from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.step import Step
from gradwatch.wire import MISSING_BITS, Batch, Heartbeat, Schema, encode
from gradwatch.wire import columns as col

MISSING = float(np.array([MISSING_BITS], "<u4").view("<f4")[0])
QUIET = (
    col.LOSS,
    col.lr(0),
    col.SKIPPED,
    col.scalar(col.GRAD_NONFINITE_SCALAR),
    col.scalar(col.DATA_SECONDS_SCALAR),
    col.scalar(col.FORWARD_SECONDS_SCALAR),
    col.scalar(col.GRAD_NORM_SCALAR),
)
LOUD = (col.LOSS, col.lr(0), col.SKIPPED)
WORLD, SHARDS, FLUSH = 8, 2, 5
REPORTERS = {0: 0, 1: 0, 2: 1, 3: 1}  # rank -> pipeline stage; ranks 4-7 send no layers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Judged(Engine):
    """The default rules, keeping every record they were given (as text) and returned."""

    def __init__(self) -> None:
        super().__init__(load_default_rules())
        self.seen: list[str] = []

    def observe(self, step: Step) -> list[Any]:
        self.seen.append(_fields(step))
        out = super().observe(step)
        self.seen += [f"{t.alert.rule} {t.previous}->{t.current} {t.alert.rank}" for t in out]
        return out


def _fields(step: Step) -> str:
    """Every field, as text: NaN != NaN, but repr(nan) == repr(nan); floats repr exactly."""
    out = {name: getattr(step, name) for name in Step.__dataclass_fields__}
    out["layer_norms"] = (step.layer_norms.dtype.str, step.layer_norms.tolist())
    return repr(out)


def _schema(rank: int) -> Schema:
    if rank in REPORTERS:
        stage = REPORTERS[rank]
        return Schema(id=1, columns=LOUD, layers=tuple(f"s{stage}.l{i}" for i in range(4)))
    return Schema(id=1, columns=QUIET, layers=())


def _batch(
    rank: int,
    first: int,
    seq: int,
    t0: float,
    edit: dict[tuple[int, int], float] | None = None,
    world: int = WORLD,
    inc: str = "a",
    rows: int = FLUSH,
) -> list[bytes]:
    """Rows ``first``.. of ``rank``; ``edit`` sets (row, column) cells."""
    schema = _schema(rank)
    rng = np.random.default_rng(rank * 1000 + first)
    values = rng.uniform(0.5, 2.0, size=(rows, schema.width)).astype("<f4")
    values[:, 2] = 0.0  # skipped
    if not schema.layers:
        values[:, 3] = 0.0  # grad_nonfinite
    for (row, column), value in (edit or {}).items():
        values[row, column] = value
    steps = tuple(range(first, first + rows))
    return encode(
        Batch(
            job="j",
            rank=rank,
            world=world,
            schema_id=1,
            seq=seq,
            incarnation=f"{inc}-{rank}",
            dropped=0,
            steps=steps,
            times=tuple(t0 + s for s in steps),
            values=values.tobytes(),
            schema=schema,
            shards=SHARDS,
        )
    )


def _heartbeat(rank: int, step: int, time: float, world: int = WORLD) -> list[bytes]:
    return encode(Heartbeat("j", rank, world, f"a-{rank}", time, step, 0, started=step + 1))


def _script() -> list[tuple[str, Any]]:
    """("clock", t) | ("msg", frames) | ("expire", None): one run, with every odd case."""
    order = random.Random(17)
    out: list[tuple[str, Any]] = [("msg", _heartbeat(r, 0, 0.0)) for r in range(WORLD)]
    t0 = 0.0
    edits: dict[tuple[int, int], dict[tuple[int, int], float]] = {
        (6, 5): {(2, 0): math.nan},  # rank 6's own loss goes NaN at step 7
        (5, 5): {(3, 3): 1.0, (0, 4): MISSING, (1, 5): MISSING},  # flagged, phases missing
        (4, 5): {(1, 0): MISSING, (2, 1): MISSING, (4, 6): MISSING},  # loss, lr, norm missing
        (7, 15): {(0, 2): 1.0, (1, 0): math.inf},  # skipped, an infinite loss
        (5, 10): {(2, 0): math.nan},  # rank 5's NaN, delivered after the deadline
    }
    for flush in range(4):
        first = flush * FLUSH
        ranks = list(range(WORLD))
        order.shuffle(ranks)
        held = [5] if flush == 2 else []
        for rank in ranks:
            if rank in held:
                continue
            frames = _batch(rank, first, flush, t0, edits.get((rank, first)))
            out.append(("msg", frames))
            if (rank, flush) == (7, 1):
                out.append(("msg", frames))  # a resent batch: counted once
        out.append(("clock", 1000.0 + 10 * (flush + 1)))
        out.append(("expire", None))
        for rank in held:  # past the 5 s deadline: absent, then late with its NaN
            out.append(("msg", _batch(rank, first, flush, t0, edits.get((rank, first)))))
        out += [("msg", _heartbeat(r, first + FLUSH - 1, 0.0)) for r in range(0, WORLD, 3)]
    # Rank 4 restarts from step 12 (a new incarnation): the job's assembly restarts.
    out.append(("msg", _batch(4, 12, 0, t0, inc="b")))
    for rank in range(WORLD):
        out.append(("msg", _batch(rank, 20, 4, t0)))
    out.append(("clock", 1100.0))
    out.append(("expire", None))
    out.append(("snap", None))
    # The job relaunched at another scale: a new stream, the first report a quiet one.
    out += [("msg", _batch(r, 0, 0, t0, world=6, inc="c", rows=3)) for r in (5, 0, 1, 2, 3, 4)]
    out.append(("snap", None))
    return out


def _run(quiet: bool) -> tuple[Server, Judged, list[Any]]:
    clock, engine, snaps = Clock(), Judged(), []
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0")
    server = Server(config, engine=engine, registry=CollectorRegistry(), clock=clock)
    server.pipeline.quiet_rows = quiet
    for what, arg in _script():
        if what == "clock":
            clock.now = arg
        elif what == "snap":
            snaps.append((server.assembler.counts(), server.assembler.absent("j")))
        elif what == "expire":
            server.pipeline.expire_assembly()
            server.pipeline.tick()
        else:
            server.pipeline.handle(arg)
    return server, engine, snaps


def _rank_state(server: Server) -> dict[int, str]:
    job = server.state.job("j")
    assert job is not None
    out = {}
    for r, rank in job.ranks.items():
        latest = _fields(rank.latest) if rank.latest is not None else None
        out[r] = repr(
            (
                latest,
                rank.last_loss,
                rank.last_grad_norm,
                sorted(rank.nonfinite),
                rank.progress,
                rank.progress_time,
                list(rank.step_intervals),
                list(rank.phases.data),
                list(rank.phases.busy),
                rank.lag,
                rank.last_seen,
            )
        )
    return out


def test_quiet_rows_judge_and_remember_exactly_what_steps_did() -> None:
    fast, fast_engine, fast_snaps = _run(quiet=True)
    slow, slow_engine, slow_snaps = _run(quiet=False)

    assert fast_engine.seen == slow_engine.seen
    assert _rank_state(fast) == _rank_state(slow)
    assert fast_snaps == slow_snaps
    assert fast.state.liveness() == slow.state.liveness()
    assert fast.ingest.stats() == slow.ingest.stats()
    # The script reached the cases it is about (else the comparison proves little).
    counts = slow_snaps[0][0]["j"]
    assert counts.late and counts.incomplete and counts.restarts
    assert slow_snaps[1][0]["j"].steps == 3  # the relaunched job's steps
    text = "\n".join(slow_engine.seen)
    assert "'blame': {'loss': 6" in text  # rank 6's own NaN loss, named
    assert "'blame': {'grad_norm': 5}" in text  # rank 5's flag, named
    assert "NonFiniteGradients inactive->firing 6" in slow_engine.seen
    assert "NonFiniteGradients resolved->firing 7" in slow_engine.seen  # the infinite loss


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_quiet_columns_are_the_rows_steps(seed: int) -> None:
    schema = Schema(id=0, columns=QUIET, layers=(), dtype="torch.bfloat16")
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(12, len(QUIET))).astype("<f4")
    values[rng.random(values.shape) < 0.3] = MISSING
    values[0, :] = np.nan
    values[1, :] = MISSING
    values[2, 3] = 1.0  # flagged
    batch = Batch(
        "j",
        3,
        8,
        0,
        0,
        "i",
        0,
        tuple(range(12)),
        tuple(float(t) for t in range(12)),
        values.tobytes(),
        schema,
        shards=2,
    )
    plan = compile_plan(schema)
    rows, steps = quiet_rows(batch, plan), step_rows(batch, plan)
    assert [_fields(rows.step(r)) for r in range(12)] == [_fields(s) for s in steps]
    for r, step in enumerate(steps):
        assert repr(rows.loss[r]) == repr(step.loss)
        assert repr(rows.grad_norm[r]) == repr(step.grad_norm)
        assert rows.skipped[r] == step.skipped
        assert rows.flagged[r] == (step.scalars.get(col.GRAD_NONFINITE_SCALAR, 0.0) > 0.5)
        assert repr(rows.data[r]) == repr(step.scalars.get(col.DATA_SECONDS_SCALAR))
        phases = [
            step.scalars[n]
            for n in (col.DATA_SECONDS_SCALAR, col.FORWARD_SECONDS_SCALAR)
            if n in step.scalars
        ]
        assert repr(rows.busy[r]) == repr(sum(phases) if phases else None)
    assert rows.flagged[2]
