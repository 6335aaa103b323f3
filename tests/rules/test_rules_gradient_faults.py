"""Issue 13's missing classes, through the default rules: zero gradients, freezes, eval mode."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.step import Census, Stats, Step
from gradwatch.rules.testing import Record, Synth, feed_all

RULES = load_default_rules()
TOTAL = 1_000_000
ONSET = 600


def census(
    frozen: int = 0,
    *,
    training: bool = True,
    eval_modules: tuple[str, ...] = (),
    frozen_modules: tuple[tuple[str, int], ...] = (),
) -> Census:
    return Census(
        params_total=TOTAL,
        params_trainable=TOTAL - frozen,
        params_frozen=frozen,
        params_not_in_optimizer=0,
        frozen_modules=frozen_modules,
        eval_modules=eval_modules,
        model_training=training,
    )


def with_census(records: Iterator[Record], at: Callable[[int], Census]) -> Iterator[Record]:
    for record in records:
        yield replace(record, census=at(record.step)) if isinstance(record, Stats) else record


def alerts(records: Iterator[Record]) -> list[tuple[str, str, str, int]]:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), records)
    return [
        (t.alert.rule, t.alert.category, t.alert.severity, t.alert.step)
        for t in transitions
        if t.current == "firing"
    ]


def run(**kw: object) -> Iterator[Record]:
    # stats_every 5: the agent's dense cadence, and a census sent whenever it changed.
    # `kw` holds untyped Synth overrides, passed through as given.
    return Synth(steps=1200, stats_every=5, **kw).records()  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1])
def test_all_zero_gradients_are_a_dead_pipeline_not_vanishing(seed: int) -> None:
    def zeroed(records: Iterator[Record]) -> Iterator[Record]:
        for r in records:
            if isinstance(r, Step) and r.step >= ONSET:
                r = replace(r, layer_norms=np.zeros_like(r.layer_norms), grad_norm=0.0)
            yield r

    fired = alerts(zeroed(Synth(seed=seed, steps=1200).records()))
    assert ("GradientsAllZero", "dead_pipeline", "warning", ONSET) in fired, fired
    assert not any(rule == "GradientsVanished" for rule, *_ in fired)


def zero_from(records: Iterator[Record], start: int, kinds: tuple[str, ...]) -> Iterator[Record]:
    """Every gradient norm of the layers whose name ends in one of ``kinds`` exactly 0 from
    ``start`` on (kinds "" : every layer)."""
    for r in records:
        if isinstance(r, Step) and r.step >= start:
            cut = np.array([n.endswith(kinds) for n in r.layers])
            norms = np.where(cut, 0.0, r.layer_norms)
            r = replace(r, layer_norms=norms, grad_norm=float(np.sqrt(np.sum(norms**2))))
        yield r


def test_no_gradient_and_a_loss_of_exactly_zero_lead_with_the_loss() -> None:
    # pytorch/examples' DDP tutorial as written (benchmarks/ddp_trial.py): cross-entropy of a
    # one-column output against float targets is exactly 0, and so is every gradient.
    def constant(records: Iterator[Record]) -> Iterator[Record]:
        for r in zero_from(records, 1, ("",)):
            yield replace(r, loss=0.0) if isinstance(r, Step) else r

    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), constant(run()))
    alert = next(t.alert for t in transitions if t.alert.rule == "GradientsAllZero")
    assert alert.step == 1 and "so is the loss" in alert.summary
    assert alert.diagnosis is not None
    checks = alert.diagnosis["next_checks"]
    assert checks[0].startswith("does the loss depend on the model's outputs? (a loss of")
    assert "does the loss depend on the model's outputs?" not in checks  # said once


def first_checks(records: Iterator[Record]) -> tuple[int, str, list[str]]:
    """GradientsAllZero's step, summary and next checks."""
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), records)
    alert = next(t.alert for t in transitions if t.alert.rule == "GradientsAllZero")
    assert alert.diagnosis is not None
    return alert.step, alert.summary, list(alert.diagnosis["next_checks"])


def test_gradients_stopped_by_an_update_lead_with_the_learning_rate() -> None:
    # pytorch/examples' REINFORCE at lr x100 (benchmarks/pex_trial.py, the kept trace's
    # numbers): step 1 had gradients of 1.7-13.6 and a loss of 0.13; its update made the
    # policy deterministic, and from step 2 every gradient was exactly 0 and the loss ~1e-14.
    # It was told to check where zero_grad() is called.
    layers = ("affine1.weight", "affine1.bias", "affine2.weight", "affine2.bias")

    def reinforce() -> Iterator[Record]:
        yield Step(
            job="j", step=1, time=0.0, loss=0.1315, layers=layers,
            layer_norms=np.array([1.65, 1.81, 13.57, 1.78]),
        )  # fmt: skip
        for t, loss in enumerate([8.5e-14, -1.4e-14, 4.3e-14, 8.5e-14, 8.5e-14, 0.0], start=2):
            yield Step(job="j", step=t, time=0.0, loss=loss, layers=layers, layer_norms=np.zeros(4))

    step, summary, checks = first_checks(reinforce())
    assert step == 2 and "the loss fell with them from 0.1315" in summary
    assert checks[0].startswith("lower the learning rate: the update of step 1 pinned")
    # The same zeros after gradients, the loss where it was: the loop changed there.
    step, summary, checks = first_checks(zero_from(run(), ONSET, ("",)))
    assert step == ONSET and "after steps that had them" in summary
    assert checks[0].startswith(f"what changed in the loop at step {ONSET}")
    # Zero from the first step: the loop as written, as before.
    step, summary, checks = first_checks(zero_from(run(), 1, ("",)))
    assert step == 1 and "after steps" not in summary
    assert checks[0].startswith("is optimizer.zero_grad() called before backward()")


@pytest.mark.parametrize("seed", [0, 1])
def test_weight_matrices_cut_off_while_biases_learn_are_dead_units(seed: int) -> None:
    # pytorch/examples' mnist at lr x100 (benchmarks/pex_trial.py): after one update too
    # large only the last bias kept a gradient; the ReLUs are functional, so no activation
    # statistic could tell.
    fired = alerts(zero_from(Synth(seed=seed, steps=1200).records(), ONSET, (".weight",)))
    assert ("WeightGradientsCutOff", "dead_units", "warning", ONSET) in fired, fired
    assert not any(rule == "GradientsAllZero" for rule, *_ in fired)
    # Every gradient zero is GradientsAllZero's alone.
    fired = alerts(zero_from(Synth(seed=seed, steps=1200).records(), ONSET, ("",)))
    assert not any(rule == "WeightGradientsCutOff" for rule, *_ in fired), fired


def test_matrices_that_never_had_a_gradient_are_a_bias_only_fine_tune_not_dead_units() -> None:
    # Frozen with requires_grad_(False) but left in the optimizer: the agent reads 0.0 for
    # them from the first step. That is a choice (BitFit), not units that died.
    fired = alerts(zero_from(Synth(seed=0, steps=1200).records(), 1, (".weight",)))
    assert not any(rule == "WeightGradientsCutOff" for rule, *_ in fired), fired


@pytest.mark.parametrize("seed", [0, 1])
def test_a_backbone_frozen_mid_run_warns_within_20_steps(seed: int) -> None:
    backbone = (("backbone", 800_000),)
    fired = alerts(
        with_census(
            run(seed=seed),
            lambda t: census(800_000, frozen_modules=backbone) if t >= ONSET else census(),
        )
    )
    (hit,) = [a for a in fired if a[0] == "LayersFrozenMidRun"]
    assert hit[1:3] == ("update_ratio", "warning") and ONSET <= hit[3] <= ONSET + 20


@pytest.mark.parametrize("seed", [0, 1])
def test_a_head_only_fine_tune_frozen_from_attach_raises_nothing_above_info(seed: int) -> None:
    backbone = (("backbone", 950_000),)
    frozen = census(950_000, frozen_modules=backbone, eval_modules=("backbone.bn1",))
    fired = alerts(with_census(run(seed=seed), lambda t: frozen))
    assert [a for a in fired if a[2] != "info"] == []


@pytest.mark.parametrize(
    ("state", "named"),
    [
        (census(training=False, eval_modules=("bn1", "drop")), "bn1"),
        (census(eval_modules=("encoder.dropout", "encoder.bn")), "encoder.bn"),
    ],
)
def test_training_in_eval_mode_warns_within_20_steps(state: Census, named: str | None) -> None:
    fired = alerts(with_census(run(), lambda t: state if t >= ONSET else census()))
    (hit,) = [a for a in fired if a[0] == "TrainingInEvalMode"]
    assert hit[1:3] == ("eval_mode_wiring", "warning") and ONSET <= hit[3] <= ONSET + 20
    transitions = feed_all(
        Engine(RULES, clock=lambda: 0.0),
        with_census(run(), lambda t: state if t >= ONSET else census()),
    )
    alert = next(t.alert for t in transitions if t.alert.rule == "TrainingInEvalMode")
    assert named in alert.summary
    assert alert.diagnosis is not None and alert.diagnosis["verdict"] == "eval_mode_wiring"


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_statistics_frozen_on_purpose_are_info(training: bool) -> None:
    # OpenMMLab's norm_eval (tests/scenarios: healthy_norm_eval_batchnorm_frozen): only
    # BatchNorm in eval while the model trains paged TrainingInEvalMode. The model itself
    # left in eval mode still pages, whatever its modules are.
    state = replace(
        census(training=training, eval_modules=("backbone.bn1", "backbone.layer1.0.bn1")),
        eval_norms_only=True,
    )
    fired = alerts(with_census(run(), lambda t: state if t >= ONSET else census()))
    rules = [(rule, severity) for rule, _, severity, _ in fired]
    if training:
        assert ("NormStatisticsFrozen", "info") in rules
        assert not any(rule == "TrainingInEvalMode" for rule, _ in rules)
    else:
        assert ("TrainingInEvalMode", "warning") in rules
        assert not any(rule == "NormStatisticsFrozen" for rule, _ in rules)


def test_census_free_streams_give_no_verdict() -> None:
    # Older agents and imported logs send no census: the census rules stay silent, not inactive.
    from gradwatch.rules.modelstate import FrozenMidRunDetector, TrainingInEvalModeDetector

    bare = Stats(job="j", step=5, time=0.0)
    assert FrozenMidRunDetector().observe_stats(bare) is None
    assert TrainingInEvalModeDetector().observe_stats(bare) is None


def test_the_tree_calls_exact_zeros_a_dead_pipeline() -> None:
    from gradwatch.rules import Alert
    from gradwatch.rules.diagnosis import JobHistory, diagnose

    history = JobHistory()
    for t in range(1, 80):
        history.observe_step(
            Step(job="j", step=t, time=0.0, loss=2.0, grad_norm=0.0 if t > 20 else 1.0)
        )
    alert = Alert(
        rule="GradientsAllZero",
        category="dead_pipeline",
        severity="warning",
        job="j",
        state="firing",
        step=21,
        summary="every gradient is exactly zero",
        started_at=0.0,
    )
    d = diagnose(history, alert)
    assert (d["verdict"], d["tree"]) == ("dead_pipeline", "dead_pipeline")
    assert "exactly zero" in d["summary"] and "vanishing" not in d["summary"]


def test_eval_mode_that_changes_nothing_is_not_flagged() -> None:
    # A Linear+ReLU model left in eval mode trains exactly as in train mode.
    fired = alerts(with_census(run(), lambda t: census(training=False) if t >= ONSET else census()))
    assert [a for a in fired if a[0] == "TrainingInEvalMode"] == []


def test_a_logged_total_of_zero_is_not_evidence_of_zero_gradients() -> None:
    # Real HF logs under DeepSpeed log grad_norm 0.0 on half the logs of a healthy run.
    from gradwatch.rules.vanishing import ZeroGradientsDetector

    det = ZeroGradientsDetector()
    assert (
        det.observe(Step(job="j", step=1, time=0.0, loss=1.0, grad_norm=0.0, grad_norm_logged=True))
        is None
    )
    zero = Step(job="j", step=2, time=0.0, layers=("a.weight",), layer_norms=np.zeros(1))
    # A step with layer norms always gets a verdict.
    assert det.observe(zero).active  # type: ignore[union-attr]
    assert det.observe(replace(zero, step=3, skipped=True)) is None


def test_parameters_outside_the_optimizer_are_named_as_info() -> None:
    outside = Census(
        params_total=TOTAL,
        params_trainable=TOTAL - 4096,
        params_frozen=0,
        params_not_in_optimizer=4096,
        not_in_optimizer=("head.weight",),
    )
    fired = alerts(with_census(run(), lambda t: outside if t >= ONSET else census()))
    assert [a[:3] for a in fired] == [("ParametersNotInOptimizer", "update_ratio", "info")]
