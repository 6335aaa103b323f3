"""The seed's decision tree over a job's history, and the earlier cause behind a symptom."""

from __future__ import annotations

import json
import math

import numpy as np
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


def grown_weights(grad_norms: list[float], update: float, later: float | None = None) -> JobHistory:
    """Weights growing x12 from step 1 over 150 steps, under the given grad norms and updates;
    ``later``: the updates from step 150 on (x10 is first read at step 140), as they grow on."""
    history = JobHistory()
    layers = ("a.weight", "b.weight", "c.weight")
    for t in range(1, len(grad_norms) + 1):
        history.observe_step(Step(job="j", step=t, time=0.0, loss=3.0, grad_norm=grad_norms[t - 1]))
        if t == 1 or t % 10 == 0:
            total = 1.0 + 11.0 * t / 150
            if later is not None and t >= 150:
                update = later
            history.observe_stats(
                Stats(
                    job="j",
                    step=t,
                    time=0.0,
                    layers=layers,
                    weight_norms=np.full(3, total / math.sqrt(3)),
                    update_ratios=np.full(3, update),
                )
            )
    return history


def test_weights_grown_by_a_high_lr_are_not_called_a_small_init() -> None:
    # nanoGPT lr x100: the weights grew x12 while the grad norm fell from a healthy ~5 to
    # ~0.4 and every update moved the weights by ~4%; the UpdateRatioTooLarge alert named
    # "initialisation too small" as its earlier cause, and its checks led with weight decay.
    falling = [5.0] * 10 + [0.4] * 140
    history = grown_weights(falling, update=0.04)
    assert "small_init" not in history.precursors
    growth = history.precursors["weight_growth"]
    assert growth.category == "update_ratio" and "updates of 0.04" in growth.detail
    d = diagnose(history, alert("loss_spike", step=150))
    assert "initialisation too small" not in d["summary"]
    assert "lower the learning rate" in d["next_checks"]
    assert "add weight decay" not in d["next_checks"]
    # The same growth under healthy-sized updates is a weight-runaway sign (regularization).
    quiet = grown_weights(falling, update=1e-3).precursors["weight_growth"]
    assert quiet.category == "weight_runaway"


def test_a_measured_step_size_far_above_the_band_leads_the_checks() -> None:
    # llama2.c at lr x100: LayerGradNormRatioExploding, 544 steps after the weights began to
    # grow under updates of 3-5% a step, led with "initialisation scale"; the precursor's
    # words had become "total weight norm x20 its first value" once the updates fell.
    falling = [5.0] * 10 + [0.4] * 190
    history = grown_weights(falling, update=0.04, later=1e-3)
    growth = history.precursors["weight_growth"]
    assert growth.category == "update_ratio" and "updates of 0.04" in growth.detail
    assert growth.peak > 12  # the reading goes on growing; its words stay its own class's
    own = ("initialisation scale (Jacobians with norm above 1)", "learning rate and clipping")
    d = diagnose(history, alert("exploding_gradients", step=200), own)
    assert d["next_checks"][:2] == ("lower the learning rate", own[0])
    # A rule that already leads with the lever, more exactly, is not told it twice.
    exact = ("lower the learning rate (try 10x lower)", "warm-up length")
    d = diagnose(history, alert("lr_too_high", step=200), exact)
    assert d["next_checks"][:2] == exact
    # Without that precursor the rule's own checks lead, as before.
    quiet = grown_weights(falling, update=1e-3)
    assert diagnose(quiet, alert("exploding_gradients", step=200), own)["next_checks"][0] == own[0]


def test_weights_and_gradients_waking_together_are_a_small_init() -> None:
    # init x0.01 on nanoGPT: grad norm 0.10 at the start, ~0.5-2 once the weights woke.
    waking = [0.1] * 10 + [1.0] * 140
    history = grown_weights(waking, update=0.2)
    assert history.precursors["small_init"].category == "vanishing_gradients"
    assert "weight_growth" not in history.precursors


def test_tiny_gelu_inputs_are_not_named_dead_units() -> None:
    # nanoGPT init x0.01: tiny pre-activations put half the GELU outputs just below zero
    # (0.50-0.52); named the earlier cause, they added "lower the learning rate" to a
    # WeightsStartedTooSmall alert whose own advice says not to.
    def history_at(tail: float) -> JobHistory:
        history = JobHistory()
        for t in range(1, 40):
            act = (ActStats("h.0.mlp.gelu", "gelu", 0.0, 0.01, zero_frac=tail),)
            history.observe_stats(Stats(job="j", step=t, time=0.0, act=act))
            history.observe_step(Step(job="j", step=t, time=0.0, loss=3.0))
        return history

    assert (
        diagnose(history_at(0.52), alert("vanishing_gradients", step=39))["earlier_cause"] is None
    )
    dead = diagnose(history_at(0.8), alert("vanishing_gradients", step=39))["earlier_cause"]
    assert dead is not None and dead["signal"] == "dead_units"  # lr x100 reaches 0.80
