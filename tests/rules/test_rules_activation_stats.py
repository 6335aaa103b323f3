"""Activation-statistics detectors: dead units (ReLU, GELU/SiLU) and saturated tanh units."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.activations import DeadUnitsDetector, SaturationDetector
from gradwatch.rules.step import ActStats, Stats
from tests.rules.stats_support import stats


def relu(module: str, zero: float) -> ActStats:
    return ActStats(module, "relu", mean=0.3, std=0.5, zero_frac=zero)


def tanh(module: str, sat: float) -> ActStats:
    return ActStats(module, "tanh", mean=0.0, std=0.9, sat_frac=sat)


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
