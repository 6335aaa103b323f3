"""Cadence-statistics detectors (activations, weights, update ratios), AMP loss-scale collapse."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pytest

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.activations import DeadUnitsDetector, SaturationDetector
from gradwatch.rules.alert import Alert
from gradwatch.rules.amp import LossScaleCollapseDetector
from gradwatch.rules.step import ActStats, Stats
from gradwatch.rules.weights import UpdateRatioDetector, WeightRunawayDetector

LAYERS = ("0.weight", "0.bias", "1.weight", "1.bias")


def stats(
    t: int,
    *,
    act: Sequence[ActStats] = (),
    weights: Sequence[float] | None = None,
    ratios: Sequence[float] | None = None,
) -> Stats:
    return Stats(
        job="j",
        step=t,
        time=float(t),
        layers=LAYERS,
        act=tuple(act),
        weight_norms=None if weights is None else np.asarray(weights, dtype=float),
        update_ratios=None if ratios is None else np.asarray(ratios, dtype=float),
    )


def relu(module: str, zero: float) -> ActStats:
    return ActStats(module, "relu", mean=0.3, std=0.5, zero_frac=zero)


def tanh(module: str, sat: float) -> ActStats:
    return ActStats(module, "tanh", mean=0.0, std=0.9, sat_frac=sat)


# ---------------------------------------------------------------- activations


def test_dead_units_needs_three_samples_and_names_the_module() -> None:
    det = DeadUnitsDetector()
    found = [
        det.observe_stats(stats(50 * k, act=[relu("a", 0.5), relu("b", 0.95)])) for k in range(1, 5)
    ]
    assert [f.active for f in found if f is not None] == [False, False, True, True]
    ev = found[2].evidence
    assert (ev["module"], ev["since_step"], ev["count"]) == ("b", 50, 1)


@pytest.mark.parametrize("seed", range(3))
def test_healthy_relu_halves_never_fire(seed: int) -> None:
    det = DeadUnitsDetector()
    rng = np.random.default_rng(seed)
    for k in range(1, 500):
        acts = [relu(f"m{j}", float(np.clip(rng.normal(0.5, 0.1), 0, 1))) for j in range(8)]
        assert not det.observe_stats(stats(k, act=acts)).active


def dead_layer_verdicts(losses: Sequence[float], dead_from: int = 20) -> list[bool]:
    """A ReLU layer 95% zero from step ``dead_from`` (a sample every 5 steps), beside
    ``losses`` (one per step): the verdicts from then on. Under 20 losses nobody can tell
    whether a run learns, so the share alone decides there."""
    det = DeadUnitsDetector(samples=2, falling=0.1)
    verdicts = []
    for t, loss in enumerate(losses, start=1):
        det.observe(Step(job="j", step=t, time=float(t), loss=loss))
        if t % 5 == 0:
            share = 0.95 if t >= dead_from else 0.5
            found = det.observe_stats(stats(t, act=[relu("fc", share)]))
            if t >= dead_from:
                verdicts.append(found is not None and found.active)
    return verdicts


def test_a_sparse_layer_in_a_run_that_learns_is_no_dead_units() -> None:
    # A small CNN (BatchNorm, SGD 0.1 with warm restarts) keeps its fc ReLU 90-95% zero the
    # whole run while its loss goes 2.37 -> 1e-4: it paged DeadReLUs at step 22.
    rng = np.random.default_rng(0)
    learning = [2.3 * math.exp(-t / 40) * rng.lognormal(0, 0.2) + 1e-4 for t in range(300)]
    assert not any(dead_layer_verdicts(learning))
    # At chance (units dead from a bad init): judged on the share alone, from the start.
    chance = [2.30 * rng.lognormal(0, 0.02) for _ in range(300)]
    assert all(dead_layer_verdicts(chance)[1:])
    assert all(dead_layer_verdicts(chance, dead_from=1)[1:])
    # Once open, a loss that falls for a block does not close and re-page it.
    opened = chance[:100] + [v * 0.5 for v in chance[100:]]
    assert all(dead_layer_verdicts(opened)[1:])
    # A layer that dies once the run has converged (the loss flat, far below its start)
    # is judged: its crossing came while nothing was learning.
    converged = learning[:150] + [learning[149] * rng.lognormal(0, 0.05) for _ in range(150)]
    assert all(dead_layer_verdicts(converged, dead_from=200)[1:])


def test_a_dip_resets_the_count() -> None:
    det = SaturationDetector(samples=2)
    shares = [0.9, 0.2, 0.9, 0.9]
    found = [det.observe_stats(stats(k, act=[tanh("a", s)])) for k, s in enumerate(shares)]
    assert [f.active for f in found] == [False, False, False, True]


def test_saturation_that_training_brought_does_not_lead_with_the_init() -> None:
    # CleanRL's PPO critic: 0% saturated at step 1, 60% at step 2,035 as its values grew.
    # The seed's first suspect, a too-large init, saturates from the first step instead.
    def first_check(shares: list[float]) -> str:
        engine = Engine(load_default_rules())
        fired = []
        for k, share in enumerate(shares):
            fired += engine.observe_stats(stats(1 + 50 * k, act=[tanh("critic.3", share)]))
        alert = next(t.alert for t in fired if t.alert.rule == "ActivationsSaturated")
        assert alert.diagnosis is not None
        return str(alert.diagnosis["next_checks"][0])

    grown = first_check([0.0, 0.1, 0.3, 0.6, 0.6, 0.6])
    assert grown.startswith("the learning rate") and "not the initialisation" in grown
    assert first_check([0.7, 0.7, 0.7]).startswith("initialisation scale")
    # A run joined later than its start: nothing is claimed about the init.
    late = SaturationDetector(samples=2)
    found = [
        late.observe_stats(stats(500 + k, act=[tanh("a", s)])) for k, s in enumerate([0, 0.9, 0.9])
    ]
    assert found[-1] is not None and "lead_check" not in found[-1].evidence


def saturation_rules(shares: Sequence[float], ratio: float | None) -> dict[str, str]:
    """The saturation rules that fired on ``shares`` of one tanh module (a sample every 200
    steps), their weight matrices' update ratio ``ratio`` (None: not measured): rule ->
    its first check."""
    engine = Engine(load_default_rules())
    fired: dict[str, str] = {}
    for k, share in enumerate(shares):
        ratios = None if ratio is None else [ratio, 1.0, ratio, 1.0]
        sample = stats(
            1 + 200 * k,
            act=[tanh("critic.3", share)],
            weights=[1.0, 0.01, 1.0, 0.01],
            ratios=ratios,
        )
        for t in engine.observe_stats(sample):
            if t.current == "firing" and t.alert.category == "saturation":
                assert t.alert.diagnosis is not None
                fired[t.alert.rule] = str(t.alert.diagnosis["next_checks"][0])
    return fired


def test_a_climb_over_healthy_sized_updates_is_info_and_the_rest_pages() -> None:
    # CleanRL's PPO critic, a healthy run that solved CartPole (benchmarks/cleanrl_trial.py):
    # 0% -> 11% -> 49% -> 66% -> 74% at median update ratios ~3e-4. It paged.
    climb = saturation_rules([0.0, 0.0, 0.11, 0.49, 0.66, 0.74], 3e-4)
    assert set(climb) == {"ActivationsSaturatedGradually"}
    assert climb["ActivationsSaturatedGradually"].startswith("targets or inputs growing")
    # lr x1000 on the same script: 3% -> 60% in one step, at ratios of 0.3-0.6.
    assert set(saturation_rules([0.0, 0.03, 0.60, 0.82], 0.5)) == {"ActivationsSaturated"}
    # One jump, however calm the updates (inputs of a new scale), pages ...
    assert set(saturation_rules([0.0, 0.0, 0.7, 0.7], 3e-4)) == {"ActivationsSaturated"}
    # ... as does a climb with oversized updates, or one whose updates were not measured,
    climbs = [0.0, 0.2, 0.4, 0.6, 0.6]
    assert set(saturation_rules(climbs, 0.1)) == {"ActivationsSaturated"}
    assert set(saturation_rules(climbs, None)) == {"ActivationsSaturated"}
    # ... and a layer saturated from the first sample: the init.
    assert set(saturation_rules([0.7, 0.7, 0.7], 3e-4)) == {"ActivationsSaturated"}


def test_stats_without_activations_are_no_verdict() -> None:
    assert SaturationDetector().observe_stats(stats(1, weights=[1.0] * 4)) is None
    # A ReLU module tells a saturation detector nothing, and vice versa.
    assert SaturationDetector().observe_stats(stats(1, act=[relu("a", 0.99)])) is None
    assert DeadUnitsDetector().observe_stats(stats(1, act=[tanh("a", 0.99)])) is None


# ---------------------------------------------------------------- weights


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

DEEP = tuple(f"h.{i}.{kind}" for i in range(6) for kind in ("weight", "bias")) + ("ln_f.weight",)


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


def test_dead_gelu_and_silu_units_through_the_default_rule() -> None:
    from gradwatch.rules import Engine, load_default_rules

    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    fired = []
    for k in range(1, 6):
        acts = (
            ActStats("mlp.act", "gelu", mean=-0.1, std=0.05, zero_frac=0.97),
            ActStats("gate.act", "silu", mean=0.2, std=0.5, zero_frac=0.001),
        )
        fired += engine.observe_stats(Stats(job="j", step=50 * k, time=0.0, act=acts))
    (t,) = fired
    assert (t.alert.rule, t.alert.category, t.alert.evidence["module"]) == (
        "DeadGELUSiLUUnits",
        "dead_units",
        "mlp.act",
    )


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


def test_a_share_hovering_at_the_threshold_is_one_incident() -> None:
    det = DeadUnitsDetector(threshold=0.7, samples=2, kinds=("gelu",))
    shares = [0.72, 0.75, 0.69, 0.71, 0.68, 0.74, 0.5, 0.5]
    active = [
        # A stats record always gets a verdict from this detector.
        det.observe_stats(stats(k, act=[ActStats("m", "gelu", 0.0, 1.0, zero_frac=z)])).active  # type: ignore[union-attr]
        for k, z in enumerate(shares)
    ]
    assert active == [False, True, True, True, True, True, False, False]


def test_dead_gelus_are_described_as_their_tail_not_exact_zeros() -> None:
    # minGPT adder, lr x100: "exact-zero outputs at or above 70%" of a GELU, which has none.
    def summary(kind: str, kinds: tuple[str, ...]) -> str:
        det = DeadUnitsDetector(threshold=0.7, samples=1, kinds=kinds)
        found = det.observe_stats(stats(1, act=[ActStats("m", kind, 0.0, 1.0, zero_frac=0.8)]))
        assert found is not None and found.active
        return found.summary

    assert "flat negative tail" in summary("gelu", ("gelu", "silu"))
    assert "exact-zero" not in summary("gelu", ("gelu", "silu"))
    assert "exact-zero outputs" in summary("relu", ("relu", "relu6"))
    assert "GELU/SiLU: the flat negative tail" in summary("relu", ("relu", "gelu"))


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
