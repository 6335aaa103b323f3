"""The seed's decision tree over a job's history, and the earlier cause behind a symptom."""

from __future__ import annotations

import json
import math

import pytest

from gradwatch.rules import Alert, Engine, Step, load_default_rules
from gradwatch.rules.diagnosis import VERDICTS, JobHistory, diagnose
from gradwatch.rules.step import ActStats, Stats
from gradwatch.rules.testing import fault_run, feed_all, worked_example

RULES = load_default_rules()
KEYS = {"verdict", "tree", "summary", "evidence", "next_checks", "earlier_cause"}


def alert(category: str = "numerical", step: int = 40) -> Alert:
    return Alert(
        rule="R",
        category=category,
        severity="warning",
        job="j",
        # The helper takes a plain str; callers pass valid literal values.
        state="firing",  # type: ignore[arg-type]
        step=step,
        summary="",
        started_at=0.0,
    )


def test_worked_example_names_the_earlier_cause_of_the_nan() -> None:
    # Seed: NaN loss at step 40, but the layer-1/layer-6 ratio was ~1:800 by step 20,
    # from tanh saturation under a 10x init.
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), worked_example())
    nan = next(t.alert for t in transitions if t.alert.rule == "NonFiniteGradients")
    assert nan.step == 40
    d = nan.diagnosis
    assert d is not None and set(d) == KEYS
    assert d["verdict"] == "numerical"  # the tree's first branch: the surface symptom
    cause = d["earlier_cause"]
    assert cause is not None and cause["step"] < 20
    chain = {link["signal"]: link for link in cause["chain"]}
    assert set(chain) == {"activation_saturation", "layer_ratio"}
    assert chain["activation_saturation"]["class"] == "saturation"
    ratio = chain["layer_ratio"]
    assert ratio["class"] == "vanishing_gradients" and ratio["step"] < 20 and ratio["value"] <= 1e-2
    assert 1 / 1000 <= ratio["peak"] <= 1 / 600  # ~1:800
    assert "Likely earlier cause" in d["summary"] and "not a certain cause" in d["summary"]
    assert "1:" in d["summary"] and "saturated" in d["summary"]
    assert any("initialisation scale" in check for check in d["next_checks"])
    json.dumps(nan.to_dict(), allow_nan=False)


def test_every_alert_carries_a_diagnosis() -> None:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), worked_example())
    assert len(transitions) == 3
    for t in transitions:
        assert t.alert.diagnosis is not None and set(t.alert.diagnosis) == KEYS
        assert t.alert.diagnosis["verdict"] in VERDICTS


def test_the_ratio_alert_blames_saturation_not_itself() -> None:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), worked_example())
    ratio = next(t.alert for t in transitions if t.alert.rule == "LayerGradNormRatioVanishing")
    # The ratio alert always carries a diagnosis.
    cause = ratio.diagnosis["earlier_cause"]  # type: ignore[index]
    assert cause["signal"] == "activation_saturation" and cause["step"] < ratio.step


@pytest.mark.parametrize(
    ("fault", "rule", "tree"),
    [
        ("divergence", "LossDiverging", "exploding_gradients"),
        ("vanishing", "GradientsVanished", "vanishing_gradients"),
        ("flat", "LossFlatFromStart", "dead_pipeline"),
        ("overfit", "GeneralizationGap", "generalization_gap"),
        ("eval_mode", "EvalInTrainingMode", "none"),
        ("idle", "OptimizerIdle", "none"),
    ],
)
def test_the_verdict_is_the_alerts_own_class_and_the_tree_adds_its_own(
    fault: str, rule: str, tree: str
) -> None:
    # Issue 13: "verdict: none -- no anomaly detected" on an OptimizerIdle alert contradicts it.
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), fault_run(fault).records())
    fired = next(t.alert for t in transitions if t.alert.rule == rule)
    d = fired.diagnosis
    assert d is not None and d["verdict"] == fired.category and d["tree"] == tree
    own = fired.summary.rstrip(".")
    assert d["summary"].startswith(
        own if own.startswith(VERDICTS[fired.category]) else f"{VERDICTS[fired.category]}: {own}"
    )
    assert VERDICTS["none"] not in d["summary"]
    if tree not in ("none", fired.category):
        assert f"the seed's tree also reads {VERDICTS[tree]}" in d["summary"]
    # The rule's own checks come first: they are specific to its evidence.
    own = fired.annotations["next_checks"].split(";")[0].strip()
    assert d["next_checks"][0] == own


def test_every_category_has_a_verdict_name() -> None:
    from gradwatch.rules.alert import CATEGORIES

    assert set(CATEGORIES) <= set(VERDICTS)


def test_numerical_beats_everything_and_evidence_names_it() -> None:
    history = JobHistory()
    for t in range(1, 60):
        history.observe_step(Step(job="j", step=t, time=0.0, loss=1.0 if t < 59 else math.inf))
    d = diagnose(history, alert())
    assert d["verdict"] == "numerical"
    assert d["evidence"][0] == {"signal": "loss", "value": math.inf, "step": 59}


def test_an_old_precursor_that_ended_long_ago_is_not_the_cause() -> None:
    history = JobHistory()
    for t in range(1, 2000):
        sat = 0.9 if t < 100 else 0.02
        if t % 10 == 0:
            history.observe_stats(
                Stats(
                    job="j", step=t, time=0.0, act=(ActStats("a", "tanh", 0.0, 1.0, sat_frac=sat),)
                )
            )
        history.observe_step(Step(job="j", step=t, time=0.0, loss=1.0))
    assert "activation_saturation" in history.precursors
    assert diagnose(history, alert(step=1999))["earlier_cause"] is None
