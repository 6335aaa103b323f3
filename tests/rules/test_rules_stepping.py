"""OptimizerIdle (no optimizer step, or lr 0) and LayersFrozen (some layers never move)."""

from __future__ import annotations

import numpy as np

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.step import Stats, Step
from gradwatch.rules.stepping import OptimizerIdleDetector
from gradwatch.rules.weights import UpdateRatioDetector

RULES = load_default_rules()


def step(t: int, *, lr: float = 0.1, skipped: bool = False, scale: float | None = None) -> Step:
    return Step(
        job="j",
        step=t,
        time=float(t),
        loss=1.0,
        grad_norm=1.0,
        lr=(lr,),
        skipped=skipped,
        loss_scale=scale,
    )


def run(det: OptimizerIdleDetector, steps: list[Step]) -> list[bool]:
    return [det.observe(s).active for s in steps]


def test_no_optimizer_step_fires_after_ten_steps_in_a_row() -> None:
    active = run(OptimizerIdleDetector(steps=10), [step(t, skipped=True) for t in range(1, 13)])
    assert active.index(True) == 9 and all(active[9:])


def test_a_stepping_optimizer_resets_the_count() -> None:
    steps = [step(t, skipped=t % 9 != 0) for t in range(1, 40)]
    assert not any(run(OptimizerIdleDetector(steps=10), steps))


def test_amp_overflow_skips_are_left_to_the_loss_scale_rule() -> None:
    steps = [step(t, skipped=True, scale=2.0 ** (16 - t)) for t in range(1, 30)]
    assert not any(run(OptimizerIdleDetector(steps=10), steps))


def test_zero_learning_rate_fires_but_a_warmup_from_zero_does_not() -> None:
    zero = run(OptimizerIdleDetector(steps=10), [step(t, lr=0.0) for t in range(1, 15)])
    assert zero.index(True) == 10  # step 1 is not counted: warm-ups start at 0
    warm = [step(t, lr=0.01 * (t - 1)) for t in range(1, 30)]
    assert not any(run(OptimizerIdleDetector(steps=10), warm))


def test_the_default_pack_calls_it_a_dead_pipeline() -> None:
    engine = Engine(RULES, clock=lambda: 0.0)
    fired = [
        t.alert
        for s in range(1, 20)
        for t in engine.observe(step(s, skipped=True))
        if t.current == "firing"
    ]
    assert [(a.rule, a.category) for a in fired] == [("OptimizerIdle", "dead_pipeline")]
    assert fired[0].step == 10 and fired[0].evidence["since_step"] == 1
    assert "optimizer.step() did not run" in fired[0].summary


def stats(t: int, ratios: list[float]) -> Stats:
    names = tuple(f"layer{i}.weight" for i in range(len(ratios)))
    return Stats(
        job="j",
        step=t,
        time=float(t),
        layers=names,
        weight_norms=np.ones(len(ratios)),
        update_ratios=np.asarray(ratios),
    )


def test_layers_frozen_names_the_still_layers_while_others_learn() -> None:
    det = UpdateRatioDetector(direction="partial", low=1e-6, samples=2)
    det.observe(step(1))
    first = det.observe_stats(stats(10, [0.0, 0.0, 1e-3]))
    second = det.observe_stats(stats(20, [0.0, 0.0, 1e-3]))
    assert first is not None and not first.active
    assert second is not None and second.active
    assert second.evidence["frozen_layers"] == ["layer0.weight", "layer1.weight"]


def test_layers_skipped_on_some_steps_are_not_layers_that_never_change() -> None:
    # LayerDrop (fairseq, HF's config.layerdrop) skips whole blocks per batch, and an MoE
    # expert no token was routed to gets no gradient: such a layer is still on one sample
    # and moves on the next. Two different ones in a row paged "2 layer(s) never change"
    # on a healthy LayerDrop run; the layer still in every held sample is what counts.
    det = UpdateRatioDetector(direction="partial", low=1e-6, samples=2)
    det.observe(step(1))
    verdicts = [
        det.observe_stats(stats(10 * k, ratios))
        for k, ratios in enumerate(
            [[0.0, 1e-3, 1e-3], [1e-3, 0.0, 1e-3], [1e-3, 1e-3, 0.0], [0.0, 1e-3, 1e-3]], start=1
        )
    ]
    assert not any(v is not None and v.active for v in verdicts)
    # The first layer, still on the last two samples, is a layer that did not change.
    both = det.observe_stats(stats(50, [0.0, 0.0, 1e-3]))
    assert both is not None and both.active
    assert both.evidence["frozen_layers"] == ["layer0.weight"]
    assert (both.evidence["samples"], both.evidence["since_step"]) == (2, 40)


def test_layers_frozen_is_quiet_when_all_move_or_none_do() -> None:
    det = UpdateRatioDetector(direction="partial", low=1e-6, samples=1)
    det.observe(step(1))
    moving = det.observe_stats(stats(10, [1e-3, 2e-3]))
    none_move = det.observe_stats(stats(20, [0.0, 0.0]))  # WeightsFrozen's case, not this one
    assert moving is not None and not moving.active
    assert none_move is not None and not none_move.active


def test_layers_frozen_is_not_judged_with_a_zero_learning_rate() -> None:
    det = UpdateRatioDetector(direction="partial", low=1e-6, samples=1)
    det.observe(step(1, lr=0.0))
    finding = det.observe_stats(stats(10, [0.0, 1e-3]))
    assert finding is not None and not finding.active
