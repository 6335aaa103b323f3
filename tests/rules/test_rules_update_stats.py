"""Update-size detectors (update ratios too high, frozen or too small; lagging layers)
and AMP loss-scale collapse."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.alert import Alert
from gradwatch.rules.amp import LossScaleCollapseDetector
from gradwatch.rules.step import Stats
from gradwatch.rules.weights import UpdateRatioDetector
from tests.rules.stats_support import DEEP, stats

# ---------------------------------------------------------------- update ratios


def test_update_ratio_high_uses_the_weighted_global_ratio() -> None:
    det = UpdateRatioDetector(direction="high")
    # The zero-initialised bias has an infinite ratio; weighted by its norm it does not count.
    for k in range(5):
        found = det.observe_stats(
            stats(k, weights=[10.0, 0.0, 5.0, 0.0], ratios=[1e-3, math.inf, 1e-3, 0.5])
        )
        assert found is not None and not found.active
    found = [
        det.observe_stats(stats(10 + k, weights=[10.0, 0.1, 5.0, 0.1], ratios=[0.3, 0.3, 0.3, 0.3]))
        for k in range(3)
    ]
    assert [f.active for f in found if f is not None] == [False, False, True]
    assert found[-1] is not None and found[-1].evidence["ratio"] == pytest.approx(0.3)


def frozen_run(det: UpdateRatioDetector, lrs: Sequence[float | None]) -> list[bool]:
    out = []
    for k, lr in enumerate(lrs):
        det.observe(Step(job="j", step=k, time=0.0, lr=() if lr is None else (lr,)))
        found = det.observe_stats(stats(k, ratios=[0.0, 0.0, 0.0, 0.0]))
        assert found is not None
        out.append(found.active)
    return out


def test_frozen_weights_need_a_live_learning_rate() -> None:
    assert frozen_run(UpdateRatioDetector(direction="low"), [1e-3] * 4) == [
        False,
        False,
        True,
        True,
    ]
    assert not any(frozen_run(UpdateRatioDetector(direction="low"), [None] * 5))  # lr unknown
    assert not any(frozen_run(UpdateRatioDetector(direction="low"), [0.0] * 5))  # lr is zero
    annealed = [1e-3] + [1e-5] * 5  # end of a cosine schedule: 1% of the peak
    assert not any(frozen_run(UpdateRatioDetector(direction="low"), annealed))


def test_large_updates_that_keep_lowering_the_loss_are_a_fast_healthy_run() -> None:
    def run(loss_at) -> list[bool]:
        det = UpdateRatioDetector(
            direction="high", high=0.03, samples=3, span=100, min_progress=0.1
        )
        out = []
        for t in range(1, 400):
            det.observe(Step(job="j", step=t, time=0.0, loss=loss_at(t), lr=(1e-2,)))
            if t % 25 == 0:
                found = det.observe_stats(stats(t, ratios=[0.2] * 4))
                out.append(bool(found and found.active))
        return out

    assert not any(run(lambda t: 2.0 * 0.99**t))  # falling fast: no page
    stuck = run(lambda t: 3.2 + 0.1 * math.sin(t))  # stuck far above where it should be
    assert stuck.index(True) == 4  # samples at 25, 50, 75, 100, 125: the span is reached at 125


def small_run(loss_at, ratio: float = 3e-6, first: int = 1, lr_at=lambda t: 1e-3) -> list[bool]:
    """The default UpdatesTooSmall params over 200 steps, a cadence sample every 10."""
    det = UpdateRatioDetector(
        direction="small", low=1e-5, samples=3, span=50, lr_fraction=0.1, min_progress=0.1
    )
    out = []
    for t in range(first, first + 200):
        det.observe(Step(job="j", step=t, time=0.0, loss=loss_at(t), lr=(lr_at(t),)))
        if t % 10 == 0:
            found = det.observe_stats(
                stats(t, weights=[4.0, 0.1, 2.0, 0.1], ratios=[ratio, 0.0, ratio, ratio])
            )
            out.append(bool(found and found.active))
    return out


def test_updates_far_too_small_on_a_run_that_does_not_learn() -> None:
    flat = small_run(lambda t: 1.38 + 0.02 * math.sin(t))
    assert flat.index(True) == 5  # samples at 10..60: three below, spanning 50 steps
    assert not any(small_run(lambda t: 1.38 + 0.02 * math.sin(t), ratio=1e-3))  # healthy ~1e-3


@pytest.mark.parametrize("case", ["learned", "resumed", "annealed", "not moving"])
def test_small_updates_that_are_healthy_or_someone_elses(case: str) -> None:
    if case == "learned":  # converged: small updates, the loss far below its start
        found = small_run(lambda t: 0.05 + 1.3 * math.exp(-t / 20.0))
    elif case == "resumed":  # first seen at step 5,000: its first losses are not the run's start
        found = small_run(lambda t: 0.05, first=5000)
    elif case == "annealed":  # the end of a decay: 1% of the peak rate
        found = small_run(lambda t: 1.38, lr_at=lambda t: 1e-3 if t < 20 else 1e-5)
    else:  # exact zeros everywhere: WeightsFrozen's, not this rule's
        found = small_run(lambda t: 1.38, ratio=0.0)
    assert not any(found)


# ---------------------------------------------------------------- loss scale


def amp_steps(scales: Sequence[float], skipped: Sequence[bool]) -> list[bool]:
    det = LossScaleCollapseDetector()
    return [
        det.observe(Step(job="j", step=t, time=0.0, loss_scale=s, skipped=k)).active
        for t, (s, k) in enumerate(zip(scales, skipped, strict=True))
    ]


def test_startup_search_and_rare_overflows_are_healthy() -> None:
    scales = [65536.0 / 2 ** min(t, 16) for t in range(16)] + [
        1.5
    ] * 984  # settles at 1.5: odd but above 1
    skipped = [t < 16 or t % 500 == 0 for t in range(1000)]
    assert not any(amp_steps(scales, skipped))


def test_collapse_on_the_floor_and_on_a_skip_storm() -> None:
    halving = [65536.0 / 2**t for t in range(20)]
    found = amp_steps(halving, [True] * 20)
    assert found.index(True) == 16  # scale 1.0
    storm = amp_steps([1024.0] * 300, [t >= 100 and t % 2 == 0 for t in range(300)])
    assert storm.index(True) > 100 and storm[-1]
    det = LossScaleCollapseDetector()
    assert (
        det.observe(Step(job="j", step=1, time=0.0, loss_scale=None)) is None
    )  # no AMP: no verdict


# ---------------------------------------------------------------- lagging layers


def deep_stats(t: int, ratios: Sequence[float]) -> Stats:
    return Stats(
        job="j", step=t, time=float(t), layers=DEEP, update_ratios=np.asarray(ratios, dtype=float)
    )


def test_lagging_layers_far_below_the_fast_ones_after_three_samples() -> None:
    from gradwatch.rules.weights import LaggingLayersDetector

    det = LaggingLayersDetector(factor=30.0)
    # Weights of h.0 and h.1 update 100x slower than the median layer; biases and the
    # norm gain (1e-5, also "slow") are no weight matrices and are not judged.
    ratios = [1e-5, 1e-5, 1e-5, 1e-5] + [1e-3, 1e-5] * 4 + [1e-5]
    found = [det.observe_stats(deep_stats(5 * k, ratios)) for k in range(1, 5)]
    assert [bool(f and f.active) for f in found] == [False, False, True, True]
    # `found[2]` is active (asserted above), so not None.
    ev = found[2].evidence  # type: ignore[union-attr]
    assert ev["lagging_layers"] == ["h.0.weight", "h.1.weight"] and ev["since_step"] == 5
    assert ev["reference_ratio"] == pytest.approx(1e-3)


def test_lagging_layers_when_most_of_the_model_lags_behind_its_head() -> None:
    # Issue 13: hidden layers ~100x below the head: the median is a hidden layer itself.
    from gradwatch.rules.weights import LaggingLayersDetector

    det = LaggingLayersDetector(factor=30.0)
    ratios = [1e-5, 1e-6] * 5 + [1e-3, 1e-4] + [1e-5]
    found = [det.observe_stats(deep_stats(5 * k, ratios)) for k in range(1, 4)]
    assert found[-1] is not None and found[-1].active
    assert (
        found[-1].evidence["count"] == 5
        and "h.5.weight" not in found[-1].evidence["lagging_layers"]
    )


def test_lagging_layers_quiet_on_a_healthy_spread_and_frozen_layers() -> None:
    from gradwatch.rules.weights import LaggingLayersDetector

    det = LaggingLayersDetector(factor=30.0)
    rng = np.random.default_rng(0)
    for k in range(1, 200):
        ratios = list(1e-3 * rng.lognormal(0.0, 0.5, len(DEEP)))
        ratios[0] = 1e-8  # frozen: LayersFrozen's, not lagging
        # A stats record always gets a verdict from this detector.
        assert not det.observe_stats(deep_stats(k, ratios)).active  # type: ignore[union-attr]
    assert det.observe_stats(Stats(job="j", step=1, time=0.0, layers=DEEP)) is None


def test_a_lora_fine_tunes_fresh_b_matrices_are_no_reference_for_lagging() -> None:
    # A healthy LoRA fine-tune (lr 2e-4) paged LayersLagging at step 2: its zero-initialised
    # B matrices, 0.008 of the A matrices' norm after one step, read ‖Δw‖/‖w‖ ~0.2, and
    # every A "lagged" 30x behind them. Measured numbers from that run.
    from gradwatch.rules.weights import LaggingLayersDetector

    layers = tuple(
        f"h.{i}.attn.{m}.lora_{ab}" for i in range(4) for m in ("c_attn", "c_proj") for ab in "AB"
    )

    def verdicts(b_norm: float) -> list[bool]:
        det = LaggingLayersDetector(factor=30.0)
        out = []
        for k in range(1, 5):
            stats = Stats(
                job="j",
                step=k,
                time=0.0,
                layers=layers,
                update_ratios=np.array([0.00268, 0.235] * 8),
                weight_norms=np.array([1.6, b_norm] * 8),
            )
            found = det.observe_stats(stats)
            assert found is not None
            out.append(found.active)
        return out

    assert not any(verdicts(0.0127))
    # The same ratios between matrices of comparable size are a real lag.
    assert verdicts(0.9)[-1]


def lag_verdicts(grads: Sequence[float], unexplained: float) -> list[bool | None]:
    """Five weight matrices of norm 10, the first two updating 90x slower than the rest;
    each sample after two steps with per-layer gradient norms ``grads``."""
    from gradwatch.rules.weights import LaggingLayersDetector

    layers = tuple(f"h.{i}.weight" for i in range(5))
    det = LaggingLayersDetector(factor=30.0, unexplained=unexplained)
    # A sample before any step's gradient norms: not judged, nothing to weigh it by.
    early = Stats(
        job="j",
        step=1,
        time=0.0,
        layers=layers,
        update_ratios=np.array([1e-4, 1e-4, 9e-3, 9e-3, 9e-3]),
        weight_norms=np.full(5, 10.0),
    )
    out: list[bool | None] = []
    found = det.observe_stats(early)
    out.append(None if found is None else found.active)
    for k in range(1, 5):
        for t in (2 * k, 2 * k + 1):
            det.observe(
                Step(job="j", step=t, time=0.0, layers=layers, layer_norms=np.asarray(grads))
            )
        found = det.observe_stats(replace(early, step=2 * k + 1))
        out.append(None if found is None else found.active)
    return out


def test_a_lag_that_the_gradients_explain_is_not_lagging() -> None:
    # SGD gives every layer the same step per unit of gradient: gradients 90x smaller make
    # updates 90x smaller (a healthy LSTM's first steps: pytorch/examples'
    # word_language_model); the vanishing-gradient rules judge that, against the run.
    explained = [0.01, 0.01, 0.9, 0.9, 0.9]
    assert lag_verdicts(explained, unexplained=15.0) == [None, False, False, False, False]
    # A param group at a far smaller rate: the same gradients, 90x smaller steps.
    equal = [0.9] * 5
    assert lag_verdicts(equal, unexplained=15.0) == [None, False, False, True, True]
    # Off (the default 1.0): every lag counts, as before, and no gradient norm is needed.
    assert lag_verdicts(explained, unexplained=1.0) == [False, False, True, True, True]


def test_a_lag_that_the_layers_own_growth_explains_is_not_lagging() -> None:
    # CleanRL's PPO on CartPole, healthy (benchmarks/cleanrl_trial.py, Adam, lr annealed
    # to 0): the critic's value head 'critic.4.weight' (64 -> 1) grew x10.5 as its values
    # climbed towards the returns (~100), while the other matrices grew ~x1.15; its
    # ‖Δw‖/‖w‖ fell 30-45x below the upper decile and paged LayersLagging twice. Its
    # steps had not shrunk: its norm had grown. Numbers from that run's samples.
    from gradwatch.rules.weights import LaggingLayersDetector

    layers = ("actor.0.weight", "actor.2.weight", "critic.0.weight", "critic.2.weight", "head")
    ratios = np.array([2.0e-4, 3.3e-4, 2.5e-4, 3.0e-4, 8.0e-6])

    def verdicts(head_growth: float) -> list[bool]:
        det = LaggingLayersDetector(factor=30.0)
        start = np.array([3.0, 8.0, 3.0, 8.0, 1.0])
        out = []
        for k in range(6):
            grown = start * (1.0 + 0.15 * k / 5)
            grown[-1] = start[-1] * (1.0 + (head_growth - 1.0) * k / 5)
            stats = Stats(
                job="j", step=50 * (k + 1), time=0.0, layers=layers,
                update_ratios=ratios, weight_norms=grown,
            )  # fmt: skip
            found = det.observe_stats(stats)
            assert found is not None
            out.append(found.active)
        return out

    assert not any(verdicts(10.5))
    # The same ratios from a head that kept its size: its steps are what shrank.
    assert verdicts(1.0)[2:] == [True] * 4


def lagging_firings(lrs: tuple[float, ...], groups: tuple[int, ...] | None = None) -> list[Alert]:
    """The two LayersLagging rules' firings over five samples in which h.0 and h.1 update
    90x slower than h.2-h.4, with equal gradients; ``groups``: the census's param groups."""
    from gradwatch.rules.step import Census

    layers = tuple(f"h.{i}.weight" for i in range(5))
    rules = [r for r in load_default_rules() if r.name.startswith("LayersLagging")]
    engine = Engine(rules, clock=lambda: 0.0)
    census = None if groups is None else Census(10, 10, 0, 0, groups=groups)
    fired = []
    for k in range(1, 6):
        for t in (10 * k + 1, 10 * k + 2):
            norms = np.full(5, 0.9)
            engine.observe(
                Step(job="j", step=t, time=0.0, layers=layers, layer_norms=norms, lr=lrs)
            )
        stats = Stats(
            job="j",
            step=10 * k + 2,
            time=0.0,
            layers=layers,
            update_ratios=np.array([1e-4, 1e-4, 9e-3, 9e-3, 9e-3]),
            weight_norms=np.full(5, 10.0),
            census=census,
        )
        fired += [t.alert for t in engine.observe_stats(stats) if t.current == "firing"]
    return fired


@pytest.mark.parametrize("lrs", [(0.25,), (1e-3, 1e-5)])
def test_a_lag_under_one_rate_for_every_group_is_not_blamed_on_group_rates(
    lrs: tuple[float, ...],
) -> None:
    # CleanRL's PPO at lr x1000 (one Adam param group): the collapsed actor lagged 10,000x
    # and LayersLagging's first check was "a group with a far smaller lr?", which one group
    # rules out. With two rates (the fault suite's backbone at lr/100) it stays first.
    fired = lagging_firings(lrs)
    assert len(fired) == 1 and fired[0].diagnosis is not None
    checks = list(fired[0].diagnosis["next_checks"])
    if len(lrs) == 1:
        assert checks[0].startswith("not a smaller learning rate (every param group runs at")
        assert not any(c.startswith("per-parameter-group learning rates") for c in checks)
        assert not any(c.startswith("layer-wise learning-rate decay") for c in checks)
    else:
        assert checks[0].startswith("per-parameter-group learning rates")
    assert fired[0].evidence["group_lrs"] == list(lrs)


def test_a_lag_that_the_layers_group_rate_sets_is_info_not_a_page() -> None:
    # A pretrained backbone fine-tuned at lr/100 under its head (fast.ai's slice(1e-5,
    # 1e-3)) paged LayersLagging; tests/scenarios' healthy_discriminative_lr_finetune.
    # The census names each layer's group; the steps carry the groups' rates.
    def fired(groups: tuple[int, ...], lrs: tuple[float, ...]) -> list[tuple[str, str]]:
        return [(a.rule, a.severity) for a in lagging_firings(lrs, groups)]

    # h.0 and h.1 in a group at 1/100 of the others' rate: their 90x lag is that rate.
    assert fired((1, 1, 0, 0, 0), (1e-3, 1e-5)) == [("LayersLaggingByGroupRate", "info")]
    # At 1/2 of it the rate does not account for a 90x lag: a page, as before.
    assert fired((1, 1, 0, 0, 0), (1e-3, 5e-4)) == [("LayersLagging", "warning")]
    # The slow group holds the fast layers: the lag is not its rate's doing.
    assert fired((0, 0, 1, 1, 1), (1e-3, 1e-5)) == [("LayersLagging", "warning")]
    # No groups in the census (one group, or an older agent): judged as before.
    assert fired((), (1e-3,)) == [("LayersLagging", "warning")]
