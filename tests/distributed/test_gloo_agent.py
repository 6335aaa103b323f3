"""The agent inside real gloo jobs: DDP and FSDP2 ranks on CPU, one process each.

Each test launches the worker job with a :class:`Receiver` as its collector and
compares the per-layer gradient norms on the wire with the global norms the
job itself computed (``p.grad.norm()`` under DDP, ``full_tensor().norm()``
under FSDP2). Under FSDP2 a rank sends the norm of its own shard, so the
global norm is the root of the sum of the ranks' squares.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradwatch.wire import Batch, Heartbeat, Message, Schema
from gradwatch.wire import columns as wc
from tests.distributed.harness import Receiver, launch

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_gloo_available(), reason="this torch build has no gloo backend"
    ),
    pytest.mark.slow,
]

STEPS = 6
JOB_TIMEOUT_S = 45.0  # a healthy job takes 3-8 s here; a hang fails instead
ARRIVAL_TIMEOUT_S = 10.0

Rows = dict[int, dict[int, dict[str, float]]]  # rank -> step -> layer -> value


def layer_rows(messages: list[Message]) -> Rows:
    """Every rank's per-layer values by step, decoding rows with the schema each batch names."""
    schemas: dict[tuple[int, str, int], Schema] = {}
    rows: Rows = {}
    for batch in messages:
        if not isinstance(batch, Batch) or batch.schema_id == wc.STATS_SCHEMA_ID:
            continue
        key = (batch.rank, batch.incarnation, batch.schema_id)
        if batch.schema is not None:
            schemas[key] = batch.schema
        schema = schemas[key]  # sent with a rank's first batch, which PUSH delivers first
        floats = struct.unpack(f"<{len(batch.values) // 4}f", batch.values)
        for r, step in enumerate(batch.steps):
            start = r * schema.width + len(schema.columns)
            values = floats[start : start + len(schema.layers)]
            rows.setdefault(batch.rank, {})[step] = dict(zip(schema.layers, values, strict=True))
    return rows


def all_steps_arrived(world: int, steps: int) -> Callable[[list[Message]], bool]:
    """A ``Receiver.wait_for`` condition: every rank's rows of steps 1..``steps`` are in."""

    def done(messages: list[Message]) -> bool:
        rows = layer_rows(messages)
        return all(len(rows.get(rank, {})) >= steps for rank in range(world))

    return done


def run_job(
    tmp_path: Path, world: int, mode: str, steps: int, **options: float | str
) -> tuple[Receiver, Rows, dict[int, dict[str, float]]]:
    """Run a job to the end; the receiver (stopped), the wire's rows, and the direct norms."""
    with (
        Receiver() as rx,
        launch(world, mode, rx.endpoint, f"gloo-{mode}", steps, tmp_path, **options) as job,
    ):
        job.wait(JOB_TIMEOUT_S)
        assert rx.wait_for(all_steps_arrived(world, steps), ARRIVAL_TIMEOUT_S), (
            f"not every rank's {steps} steps reached the receiver: got "
            f"{ {r: sorted(s) for r, s in layer_rows(rx.messages()).items()} }"
        )
    direct = {
        int(step): norms
        for step, norms in json.loads((tmp_path / "direct.json").read_text()).items()
    }
    assert sorted(direct) == list(range(1, steps + 1))
    for rank in range(world):
        assert (tmp_path / f"rank{rank}.done").exists()
    return rx, layer_rows(rx.messages()), direct


def test_ddp_every_rank_sends_the_global_norms(tmp_path: Path) -> None:
    world = 2
    rx, rows, direct = run_job(tmp_path, world, "ddp", STEPS)
    assert sorted(rows) == [0, 1]
    for rank in range(world):
        assert sorted(rows[rank]) == list(range(1, STEPS + 1))
        for step, norms in direct.items():
            sent = rows[rank][step]
            assert list(sent) == list(norms)  # names and order of model.named_parameters()
            for layer, norm in norms.items():
                assert norm > 0
                assert sent[layer] == pytest.approx(norm, rel=1e-5), (rank, step, layer)
    # Replicated gradients: any one rank holds the whole norm.
    assert {m.shards for m in rx.messages() if isinstance(m, Batch)} == {1}
    assert rx.wire_errors == 0


def test_fsdp2_shards_combine_to_the_global_norms(tmp_path: Path) -> None:
    world = 3  # 32 rows over 3 ranks: uneven shards; fc4's one row: two empty shards
    rx, rows, direct = run_job(tmp_path, world, "fsdp", STEPS)
    sizes = [json.loads((tmp_path / f"shards{r}.json").read_text()) for r in range(world)]
    assert sorted(rows) == list(range(world))
    assert {sizes[r]["fc1.bias"][0] for r in range(world)} == {11, 10}
    assert [sizes[r]["fc4.bias"][0] for r in range(world)] == [1, 0, 0]
    for step, norms in direct.items():
        for rank in range(world):
            assert list(rows[rank][step]) == list(norms), "layer names or order differ"
        for layer, norm in norms.items():
            shards = [rows[rank][step][layer] for rank in range(world)]
            combined = math.sqrt(sum(v * v for v in shards))
            assert combined == pytest.approx(norm, rel=1e-5, abs=1e-7), (step, layer, shards)
            for rank, value in enumerate(shards):
                local, full = sizes[rank][layer]
                if local == 0:
                    assert value == 0.0, (step, layer, rank)
                elif local < full:  # a real part: strictly less than the whole gradient
                    assert value < norm * (1 - 1e-3), (step, layer, rank, value, norm)
    # Fully sharded: the collector must add all ranks' squares.
    assert {m.shards for m in rx.messages() if isinstance(m, Batch)} == {world}
    assert rx.wire_errors == 0


def test_stalled_rank_shows_alive_but_not_stepping(tmp_path: Path) -> None:
    world, stall_at, stall_s = 2, 3, 4.0
    rx, rows, _ = run_job(
        tmp_path, world, "ddp", 5, stall_rank=1, stall_at=stall_at, stall_seconds=stall_s
    )
    messages = rx.messages()
    for rank in range(world):
        # Rank 1 sleeps in its data loader; rank 0 waits in step 3's all-reduce. Neither
        # logs step 3 until the stall ends, so step 3 took the stall on both ranks ...
        stalled = step_time(messages, rank, stall_at) - step_time(messages, rank, stall_at - 1)
        assert stalled >= stall_s * 0.9, (rank, stalled)
        # ... and both keep beating (every 0.2 s) meanwhile, with a step below 3.
        beats = [hb for hb in messages if isinstance(hb, Heartbeat) and hb.rank == rank]
        during = [
            hb
            for hb in beats
            if step_time(messages, rank, stall_at - 1)
            < hb.time
            < step_time(messages, rank, stall_at)
        ]
        assert len(during) >= 10, (rank, len(during))
        first, last = min(hb.time for hb in during), max(hb.time for hb in during)
        assert last - first >= stall_s * 0.75, (rank, first, last)
        assert {hb.step for hb in during} == {stall_at - 1}, (rank, {hb.step for hb in during})
        # ``started`` names the culprit: rank 0 began step 3 and waits; rank 1 never began it.
        # (Away from the stall's edges, where a beat may fall between a log and a forward.)
        middle = [hb for hb in during if first + 0.5 < hb.time < last - 0.5]
        started = {hb.started for hb in middle}
        assert started == {stall_at if rank == 0 else stall_at - 1}, (rank, started)
    assert sorted(rows[0]) == sorted(rows[1]) == list(range(1, 6))


def step_time(messages: list[Message], rank: int, step: int) -> float:
    """When ``rank`` logged ``step`` (the agent's wall clock, as the batch carries it)."""
    for m in messages:
        if isinstance(m, Batch) and m.rank == rank and step in m.steps:
            return m.times[m.steps.index(step)]
    raise AssertionError(f"step {step} of rank {rank} never arrived")
