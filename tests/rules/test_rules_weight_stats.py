"""Weight-norm detectors: runaway weight growth and weights started too small."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from gradwatch.rules import Step
from gradwatch.rules.step import Stats
from gradwatch.rules.weights import UpdateRatioDetector, WeightRunawayDetector
from tests.rules.stats_support import DEEP, stats

# ---------------------------------------------------------------- weight runaway


def run_weights(det: WeightRunawayDetector, totals: Sequence[float]) -> list[bool]:
    out = []
    for k, total in enumerate(totals):
        found = det.observe_stats(stats(50 * (k + 1), weights=[total, 0.0, total / 10, 0.01]))
        assert found is not None
        out.append(found.active)
    return out


def test_geometric_weight_growth_fires() -> None:
    det = WeightRunawayDetector()
    assert run_weights(det, [10.0 * 1.15**k for k in range(12)])[-1]
    found = det.observe_stats(
        stats(650, weights=[10.0 * 1.15**12, 0.0, 10.0 * 1.15**12 / 10, 0.01])
    )
    assert found is not None and found.evidence["fastest_layer"] in ("0.weight", "1.weight")
    assert found.evidence["growth"] >= 2.0


def runaway_with_updates(ratio: float | None, early: float | None = None) -> dict[str, object]:
    """The evidence of a geometric runaway whose samples had update ratios ``ratio`` (the
    first 7 of 13: ``early``, when given)."""
    det = WeightRunawayDetector()
    found = None
    for k in range(13):
        total = 10.0 * 1.15**k
        r = early if early is not None and k < 7 else ratio
        ratios = None if r is None else [r, math.inf, r, r]
        found = det.observe_stats(
            stats(50 * (k + 1), weights=[total, 0.0, total / 10, 0.01], ratios=ratios)
        )
    assert found is not None and found.active
    return dict(found.evidence) | {"summary": found.summary}


def test_runaway_under_large_updates_leads_with_the_learning_rate() -> None:
    # nanoGPT lr x100: weights grew x3.4 while every update moved them by ~4% of their norm,
    # and the alert's first check was "weight decay".
    large = runaway_with_updates(0.04)
    assert large["lead_check"] == "lower the learning rate"
    assert large["update_ratio"] == pytest.approx(0.04, rel=1e-6)
    assert "steps this large drive the growth" in str(large["summary"])
    # Updates in the healthy band (~1e-3): the rule's own order (regularization first).
    small = runaway_with_updates(1e-3)
    assert "lead_check" not in small and small["update_ratio"] == pytest.approx(1e-3, rel=1e-6)
    # No update ratios measured: nothing claimed about them.
    none = runaway_with_updates(None)
    assert "lead_check" not in none and "update_ratio" not in none
    # What drives the growth now: the newest half of the window (Lightning's one-cycle warm-up
    # at lr x100 read 0.013-0.018 first, 0.027-0.045 on its newest samples).
    assert runaway_with_updates(0.04, early=0.01)["lead_check"] == "lower the learning rate"
    assert "lead_check" not in runaway_with_updates(0.01, early=0.04)


def test_diffusive_and_saturating_growth_do_not_fire() -> None:
    # sqrt(t) (random walk, no weight decay) from an init of 10, and a warm-up that levels off.
    assert not any(
        run_weights(WeightRunawayDetector(), [math.sqrt(100 + 40 * k) for k in range(60)])
    )
    assert not any(
        run_weights(WeightRunawayDetector(), [10 * (3 - 2 * math.exp(-k / 3)) for k in range(60)])
    )


def test_zero_initialised_biases_do_not_count() -> None:
    det = WeightRunawayDetector()
    for k in range(20):
        found = det.observe_stats(stats(k, weights=[10.0, 1e-6 * 2**k, 3.0, 1e-6 * 3**k]))
        assert found is not None and not found.active


def test_early_dense_samples_alone_do_not_make_a_trend() -> None:
    # The agent samples steps 1-8 densely: Adam's first steps and a waking init move weights
    # fast for a few steps; the rules want the condition to span 100 steps.
    fast = UpdateRatioDetector(direction="high", high=0.03, samples=3, span=100)
    fast.observe(Step(job="j", step=1, time=0.0, lr=(1e-2,)))
    # A stats record always gets a verdict from this detector.
    assert not any(fast.observe_stats(stats(t, ratios=[0.2] * 4)).active for t in range(1, 9))  # type: ignore[union-attr]
    found = fast.observe_stats(stats(101, ratios=[0.2] * 4))
    assert found is not None and found.active and found.evidence["since_step"] == 1
    grow = WeightRunawayDetector(min_span=100)
    # A stats record always gets a verdict from this detector.
    assert not any(grow.observe_stats(stats(t, weights=[2.0**t] * 4)).active for t in range(1, 12))  # type: ignore[union-attr]
    slow = WeightRunawayDetector(min_span=100)
    # A stats record always gets a verdict from this detector.
    assert any(slow.observe_stats(stats(50 * k, weights=[2.0**k] * 4)).active for k in range(1, 12))  # type: ignore[union-attr]


def test_fixed_size_steps_are_learning_and_growth_that_feeds_itself_runs_away() -> None:
    # karpathy/makemore's bigram: a zero-initialised table under AdamW grows by the same
    # ‖Δw‖ each step (its ratio falling as 1/norm), x2 over 8 samples, and paged here.
    def fires(norm_at: Callable[[int], float], ratio_at: Callable[[int], float]) -> bool:
        det = WeightRunawayDetector(min_step_growth=1.25)
        found = None
        for k in range(12):
            norm, r = norm_at(k), ratio_at(k)
            found = det.observe_stats(
                stats(50 * (k + 1), weights=[norm, 0.0, norm / 10, 0.01], ratios=[r, r, r, r])
            )
        assert found is not None
        return found.active

    def linear(k: int) -> float:  # ‖Δw‖ fixed: 0.009 a step, 50 steps between samples
        return 3.0 + 0.45 * k

    def geometric(k: int) -> float:  # with a fixed ratio, ‖Δw‖ grows with the weights
        return 10.0 * 1.15**k

    assert not fires(linear, lambda k: 0.009 / linear(k))
    assert fires(geometric, lambda k: 0.003)


# ---------------------------------------------------------------- weights started too small


def weight_stats(t: int, scale: float) -> Stats:
    return Stats(
        job="j",
        step=t,
        time=float(t),
        layers=DEEP,
        weight_norms=np.array([scale, 0.01] * 6 + [1.0]),
    )


def waking(t: int) -> float:
    """A x0.02 init waking up: the norm climbs to ~1 and settles there."""
    return 1.0 - 0.98 * math.exp(-t / 30.0)


def test_weights_grown_tenfold_from_the_init_and_settling_are_a_small_init() -> None:
    from gradwatch.rules.weights import SmallInitDetector

    det = SmallInitDetector()
    found = []
    for t in (1, 10, 50, 100, 200):
        det.observe(Step(job="j", step=t, time=0.0))  # a stream without gradient norms
        found.append(det.observe_stats(weight_stats(t, waking(t))))
    assert [bool(f and f.active) for f in found] == [False, False, False, True, True]
    # `found[3]` is active (asserted above), so not None.
    ev = found[3].evidence  # type: ignore[union-attr]
    assert ev["first_step"] == 1 and ev["growth"] == pytest.approx(
        waking(100) / waking(1), rel=1e-6
    )
    assert "h.0.weight" in ev["fastest_layers"]


def test_a_small_init_judged_the_same_when_roles_arrive_after_the_first_samples() -> None:
    # Once the agent's roles arrive, each sample is kept as its matrices' total, not as
    # one array per layer (256 arrays of a 300-tensor model were 600 KiB a rank); the
    # verdicts are those of the detector that kept arrays throughout.
    from gradwatch.rules.weights import SmallInitDetector

    roles = tuple("norm" if n.startswith("ln") else n.rsplit(".", 1)[1] for n in DEEP)
    steps = list(range(1, 9)) + list(range(10, 400, 10))
    plain, told = SmallInitDetector(), SmallInitDetector()
    verdicts: list[tuple[bool, bool]] = []
    for t in steps:
        plain.observe(Step(job="j", step=t, time=0.0))  # no gradient norms in this stream
        # The roles come with a later step batch.
        told.observe(
            Step(job="j", step=t, time=0.0, layers=DEEP, layer_roles=roles if t >= 4 else ())
        )
        a, b = (
            plain.observe_stats(weight_stats(t, waking(t))),
            told.observe_stats(weight_stats(t, waking(t))),
        )
        verdicts.append((bool(a and a.active), bool(b and b.active)))
    assert all(x == y for x, y in verdicts) and any(x for x, _ in verdicts)
    kept = [value for _, value in told._kept]
    assert all(isinstance(v, float) for v in kept[3:]) and len(kept) == len(steps)


def test_a_small_init_is_not_judged_before_its_gradient_norms_could_arrive() -> None:
    # pytorch/examples' actor-critic at lr x100 (benchmarks/pex_trial.py, the kept trace):
    # its weights grew x21 in two updates, then stayed; the samples of steps 1-3 arrived
    # before their steps' batch, and "no gradient norm yet" read as "none in this stream":
    # WeightsStartedTooSmall at step 3, from a standard init.
    from gradwatch.rules.weights import SmallInitDetector

    det = SmallInitDetector()
    early = [det.observe_stats(weight_stats(t, s)) for t, s in ((1, 6.4), (2, 81.1), (3, 84.4))]
    assert not any(f and f.active for f in early)
    # Then the steps arrive, their gradients falling from the blow-up: no waking.
    for t in range(1, 40):
        det.observe(
            Step(job="j", step=t, time=0.0, layers=("a",), layer_norms=np.array([50.0 / t]))
        )
    later = det.observe_stats(weight_stats(40, 95.0))
    assert later is not None and not later.active


def test_weights_that_keep_growing_are_exploding_not_waking() -> None:
    # lr far too high: the weights grow 10x as fast, and keep growing.
    from gradwatch.rules.weights import SmallInitDetector

    det = SmallInitDetector()
    assert not any(
        det.observe_stats(weight_stats(t, 0.5 * 1.05**t)).active for t in range(1, 300, 10)
    )  # type: ignore[union-attr]  # a stats record always gets a verdict from this detector


def test_a_standard_init_and_a_late_first_sample_are_not_judged() -> None:
    from gradwatch.rules.weights import SmallInitDetector

    det = SmallInitDetector()
    assert not any(
        det.observe_stats(weight_stats(t, 1.0 + t / 1000)).active for t in range(1, 1500, 50)
    )  # type: ignore[union-attr]  # a stats record always gets a verdict from this detector
    late = SmallInitDetector()
    assert all(late.observe_stats(weight_stats(t, 0.02 * 1.05**t)) is None for t in (50, 100, 200))


def test_a_fresh_head_growing_alone_is_not_a_small_init() -> None:
    from gradwatch.rules.weights import SmallInitDetector

    det = SmallInitDetector()
    layers = ("backbone.0.weight", "backbone.1.weight", "backbone.2.weight", "head.weight")
    for t, head in ((1, 0.1), (10, 1.0), (100, 40.0)):
        found = det.observe_stats(
            Stats(
                job="j",
                step=t,
                time=0.0,
                layers=layers,
                weight_norms=np.array([1.0, 1.0, 1.0, head]),
            )
        )
        assert found is not None and not found.active


def test_a_small_init_is_measured_over_the_same_matrices_at_both_ends() -> None:
    # A BatchNorm CNN in nn.Sequential (minDiffusion's shape): its norm layers' names say
    # nothing of a norm, so before the roles arrive (a step batch after the first sample)
    # they read as matrices. The start's total must not keep the BatchNorm gains the later
    # totals leave out: with them, x0.01-scaled convolutions waking x15 read as x0.19.
    from gradwatch.rules.weights import SmallInitDetector

    det = SmallInitDetector()
    layers = tuple(f"c.{i}.{j}.weight" for i in range(3) for j in (0, 1))
    roles = ("weight", "norm") * 3

    def sample(t: int) -> Stats:
        conv = 1.5 * waking(t) / waking(200)  # 0.03 at step 1, 1.5 at step 200
        norms = np.array([conv, 8.0] * 3)  # BatchNorm gains of 64 channels stay at ~8
        return Stats(job="j", step=t, time=float(t), layers=layers, weight_norms=norms)

    first = det.observe_stats(sample(1))
    assert first is not None and not first.active
    found = []
    for t in range(1, 201):
        grad = 0.01 if t <= 3 else 1.0  # tiny gradients at the start, as a small init's
        det.observe(
            Step(job="j", step=t, time=float(t), grad_norm=grad, layers=layers, layer_roles=roles)
        )
        if t % 50 == 0:
            found.append(det.observe_stats(sample(t)))
    assert [bool(f and f.active) for f in found] == [False, True, True, True]
    assert found[-1] is not None and found[-1].evidence["growth"] == pytest.approx(
        waking(200) / waking(1), rel=1e-6
    )
