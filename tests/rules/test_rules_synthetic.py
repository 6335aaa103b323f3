"""Every default rule against synthetic runs: each fault alerts with its category, healthy never."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.testing import FAULTS, fault_run, feed_all, healthy_controls

RULES = load_default_rules()
# `for: 1` everywhere: not one step of a healthy run may even look suspicious. The
# heavy-tailed control is the exception by design: a lone 1.8x hard batch *is* a 6σ
# excursion, and LossSpike's min_steps (3 losses up in a row, in the detector) keeps it quiet.
EAGER = [replace(r, for_steps=1) for r in RULES]

# fault -> (the rule that must fire, its category, other rules allowed to fire too)
EXPECTED = {
    "nan": ("NonFiniteGradients", "numerical", set()),
    "spike": ("LossSpike", "loss_spike", set()),
    "divergence": (
        "LossDiverging",
        "lr_too_high",
        {"LossSpike", "LossRising", "LossFarAboveStart"},
    ),
    "rising": ("LossRising", "lr_too_high", set()),
    "flat": ("LossFlatFromStart", "dead_pipeline", set()),
    "vanishing": ("GradientsVanished", "vanishing_gradients", set()),
    "overfit": ("GeneralizationGap", "generalization_gap", {"ValidationLossRising"}),
    "saturation": ("ActivationsSaturated", "saturation", set()),
    "dead_relu": ("DeadReLUs", "dead_units", set()),
    "weight_runaway": ("WeightNormRunaway", "weight_runaway", set()),
    "update_high": ("UpdateRatioTooLarge", "update_ratio", set()),
    "frozen": ("WeightsFrozen", "update_ratio", set()),
    "loss_scale": ("LossScaleCollapse", "loss_scale_collapse", set()),
    "eval_mode": ("EvalInTrainingMode", "eval_mode_wiring", set()),
    "idle": ("OptimizerIdle", "dead_pipeline", set()),
    "partial_frozen": ("LayersFrozen", "update_ratio", set()),
}


def test_every_fault_has_an_expectation_and_every_rule_a_fault() -> None:
    assert set(EXPECTED) == set(FAULTS)
    covered = {rule for rule, _, _ in EXPECTED.values()}
    # Gradient-norm rules are exercised in test_rules_engine and test_rules_gpt_signals; the
    # census rules (NormStatisticsFrozen too), GradientsAllZero and WeightGradientsCutOff in
    # test_rules_gradient_faults;
    # liveness in test_rules_liveness and test_rules_straggler; UpdatesTooSmall and the two
    # LayersLagging rules in test_rules_update_stats; WeightsInflatingLossStalled in
    # test_rules_inflation.
    # Checked here: the signal groups.
    elsewhere = {
        "GradientNormGrowingGeometrically",
        "LayerGradNormRatioVanishing",
        "LayerGradNormRatioExploding",
        "GradientsAllZero",
        "WeightGradientsCutOff",
        "LayersLagging",
        "LayersLaggingByGroupRate",
        "ActivationsSaturatedGradually",
        "LayersFrozenMidRun",
        "TrainingInEvalMode",
        "NormStatisticsFrozen",
        "DeadGELUSiLUUnits",
        "WeightsStartedTooSmall",
        "ParametersNotInOptimizer",
        "UpdatesTooSmall",
        "WeightsInflatingLossStalled",
    }
    groups = {"numerical", "gradients", "activations", "weights", "model", "mixed-precision"}
    assert {r.name for r in RULES if r.group in groups} <= covered | elsewhere
    assert covered | elsewhere <= {r.name for r in RULES}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_fires_its_rule_with_its_category(fault: str, seed: int) -> None:
    spec = fault_run(fault, seed)
    rule, category, also = EXPECTED[fault]
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), spec.records())
    fired = [t.alert for t in transitions if t.current == "firing"]
    assert rule in {a.rule for a in fired}, [a.summary for a in fired]
    assert {a.rule for a in fired} <= {rule} | also, [(a.rule, a.summary) for a in fired]
    alert = next(a for a in fired if a.rule == rule)
    assert alert.category == category
    assert alert.step >= spec.fault_at or fault == "flat"  # nothing before the fault began
    assert alert.evidence and alert.diagnosis is not None
    json.dumps(alert.to_dict(), allow_nan=False)


def test_a_spike_resolves_when_the_loss_returns_and_is_not_a_divergence() -> None:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), fault_run("spike", 3).records())
    assert [(t.alert.rule, t.current) for t in transitions] == [
        ("LossSpike", "firing"),
        ("LossSpike", "resolved"),
    ]
    evidence = transitions[0].alert.evidence
    assert evidence["spike_step"] == 1000 and evidence["height_sigmas"] >= 6.0
    assert 0.0 < evidence["level"] < evidence["spike_loss"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("control", sorted(healthy_controls(0)))
def test_healthy_controls_never_alert(control: str, seed: int) -> None:
    spec = healthy_controls(seed, steps=2000)[control]
    rules = RULES if control == "heavy_tailed" else EAGER
    engine = Engine(rules, clock=lambda: 0.0)
    transitions = feed_all(engine, spec.records())
    assert transitions == [], [(t.alert.rule, t.alert.step, t.alert.summary) for t in transitions]
