"""3D layouts without processes: where a rank sits, who sends layers, how stages assemble.

The pure halves of issue 17: agent/topology.py (Layout, reports_layers) and
rules/assembly.py (stages unioned by layer name in model order, replicas that
send no layers). The gloo jobs in test_gloo_layouts.py run the same end to end.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradwatch.agent.topology import (
    Layout,
    parse_layout,
    reports_layers,
    resolve_layout,
    resolve_shards,
    share_scales,
)
from gradwatch.rules.assembly import NONFINITE_SCALAR, Assembler
from gradwatch.rules.step import Stats, Step

STAGES = (("s0.a", "s0.b"), ("s1.a", "s1.b"))  # pp=2: each stage's layers


def report(
    step: int,
    rank: int,
    layers: tuple[str, ...],
    norms: tuple[float, ...],
    *,
    world: int,
    shards: int,
    loss: float | None = 1.0,
    scalars: dict[str, float] | None = None,
) -> Step:
    return Step(
        job="j",
        step=step,
        time=float(step),
        rank=rank,
        loss=loss,
        layers=layers,
        layer_norms=np.array(norms, np.float64),
        lr=(0.1,),
        world=world,
        shards=shards,
        scalars=scalars or {},
    )


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_layout_coordinates_follow_the_row_major_mesh() -> None:
    layout = parse_layout("pp=4,dp=512,tp=8")
    assert (layout.world, layout.shards) == (16_384, 8)
    assert layout.coords(16_383) == {"pp": 3, "dp": 511, "tp": 7}
    assert layout.coords(8 * 512 + 8 + 3) == {"pp": 1, "dp": 1, "tp": 3}
    assert (layout.stage(4096), layout.replica(4096 + 8)) == (1, 1)
    hsdp = parse_layout("pp=2,dp_replicate=2,dp_shard=2,tp=2")
    assert hsdp.shards == 4  # FSDP shards x TP shards: what the wire's `shards` says


def test_only_one_replica_per_model_shard_sends_layers() -> None:
    layout = parse_layout("pp=4,dp=512,tp=8")
    reporters = [r for r in range(layout.world) if reports_layers(layout, r)]
    # One per (stage, TP rank): 32 of 16,384 ranks.
    assert reporters == [s * 4096 + t for s in range(4) for t in range(8)]
    assert reports_layers(None, 5)  # no layout: every rank reports
    # Takeover: TP rank 0's group is ranks 0, 8, 16 (replicas 0, 1, 2).
    small = parse_layout("dp=3,tp=8")
    assert not reports_layers(small, 8)
    assert reports_layers(small, 8, silent=frozenset({0}))  # rank 0 went silent
    assert not reports_layers(small, 16, silent=frozenset({0}))
    assert reports_layers(small, 16, silent=frozenset({0, 8}))
    assert not reports_layers(small, 9, silent=frozenset({0}))  # its own reporter, rank 1, is up


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=2,dp=2", "innermost"),
        ("pp=2,xp=2", "not one of"),
        ("pp:2", "name=size"),
    ],
)
def test_a_bad_layout_says_what_to_do(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_layout(text)


def test_a_layout_is_declared_by_argument_mapping_or_environment() -> None:
    model = torch.nn.Linear(2, 2)
    assert resolve_layout(model, 8, {"pp": 2, "dp": 2, "tp": 2}) == parse_layout("pp=2,dp=2,tp=2")
    assert resolve_layout(model, 4, None, env={"GRADWATCH_LAYOUT": "dp=2,tp=2"}) == Layout(
        (("dp", 2), ("tp", 2))
    )
    assert resolve_layout(model, 4, None, env={}) is None  # nothing declared, no DTensor
    with pytest.raises(ValueError, match="covers 8 ranks but the world has 4"):
        resolve_layout(model, 4, "pp=2,dp=2,tp=2")
    assert resolve_shards(model, 8, None, env={}) == 1
    assert share_scales(model, parse_layout("dp=2,tp=2")) is None  # nothing replicated to scale


def pp_job(
    asm: Assembler,
    step: int,
    order: list[int],
    norms: dict[int, tuple[float, ...]],
    reporters: frozenset[int] = frozenset({0, 2}),
) -> list[Step]:
    """pp=2, dp=2 (stage 0: ranks 0, 1; stage 1: ranks 2, 3): ranks report in ``order``."""
    out: list[Step] = []
    for rank in order:
        stage = rank // 2
        layers = STAGES[stage] if rank in reporters else ()
        values = norms[stage] if rank in reporters else ()
        loss = 2.0 if stage == 1 else None  # the loss lives on the last stage
        for whole in asm.add(report(step, rank, layers, values, world=4, shards=1, loss=loss)):
            assert isinstance(whole, Step)
            out.append(whole)
    return out


def test_stages_assemble_into_one_step_in_model_order_whoever_comes_first() -> None:
    asm = Assembler(deadline_seconds=5.0, clock=Clock())
    norms = {0: (3.0, 4.0), 1: (1.0, 2.0)}
    [whole] = pp_job(asm, 1, [3, 2, 1, 0], norms, reporters=frozenset({0, 1, 2, 3}))
    assert whole.layers == STAGES[0] + STAGES[1]  # stage 1 came first; stage 0 still leads
    np.testing.assert_allclose(whole.layer_norms, [3.0, 4.0, 1.0, 2.0])  # replicas once
    assert whole.grad_norm == pytest.approx(math.sqrt(9 + 16 + 1 + 4))
    assert whole.loss == 2.0 and whole.assembled == 4
    assert asm.counts()["j"].inexact == 0


def test_replicas_that_send_no_layers_are_normal_not_absent() -> None:
    clock = Clock()
    asm = Assembler(deadline_seconds=5.0, clock=clock)
    norms = {0: (3.0, 4.0), 1: (1.0, 2.0)}
    for step in (1, 2, 3):
        [whole] = pp_job(asm, step, [1, 3, 0, 2], norms)  # complete at once: no deadline
        assert whole.layers == STAGES[0] + STAGES[1] and whole.assembled == 4
    counts = asm.counts()["j"]
    assert (counts.steps, counts.incomplete, counts.inexact) == (3, 0, 0)
    assert asm.absent("j") == frozenset()
    # A whole stage's reporter missing at the deadline: its layers are gone, and said so.
    assert pp_job(asm, 4, [0, 1, 3], norms) == []
    clock.now += 6.0
    [late] = asm.expire()
    assert late.layers == STAGES[0]
    counts = asm.counts()["j"]
    assert (counts.incomplete, counts.inexact) == (1, 1)


def test_a_replica_without_layers_flags_its_own_nonfinite_gradients() -> None:
    asm = Assembler(deadline_seconds=5.0, clock=Clock())
    out = []
    for rank, layers, norms, flag in [(0, ("a",), (1.0,), 0.0), (1, (), (), 1.0)]:
        out += asm.add(
            report(1, rank, layers, norms, world=2, shards=1, scalars={NONFINITE_SCALAR: flag})
        )
    [whole] = out
    assert isinstance(whole, Step)
    assert whole.layers == ("a",) and whole.grad_norm is not None and math.isnan(whole.grad_norm)
    assert whole.blame == {"grad_norm": 1}


def test_tp_shards_add_and_cadence_stats_span_the_stages() -> None:
    asm = Assembler(deadline_seconds=5.0, clock=Clock())
    # dp=2, tp=2: ranks 0, 1 are replica 0's two TP shards.
    out = []
    for rank in range(4):
        layers, norms = (("w",), (3.0 if rank % 2 else 4.0,)) if rank < 2 else ((), ())
        out += asm.add(report(1, rank, layers, norms, world=4, shards=2))
    [whole] = out
    assert isinstance(whole, Step)
    assert whole.layer_norms.tolist() == [5.0]
    # Cadence stats of a pp=2, dp=2 job: weight norms span both stages too.
    stats = []
    for rank, layers, w in [
        (2, STAGES[1], (1.0, 1.0)),
        (3, (), ()),
        (1, (), ()),
        (0, STAGES[0], (2.0, 2.0)),
    ]:
        stats += asm.add(
            Stats(
                job="pp",
                step=1,
                time=1.0,
                rank=rank,
                layers=layers,
                weight_norms=np.array(w),
                world=4,
                shards=1,
            )
        )
    [sample] = stats
    assert isinstance(sample, Stats) and sample.weight_norms is not None
    assert sample.layers == STAGES[0] + STAGES[1] and sample.assembled == 4
    assert sample.weight_norms.tolist() == [2.0, 2.0, 1.0, 1.0]
