"""The engine end to end over synthetic runs: faults alert once, healthy runs never do."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from gradwatch.rules import (
    Engine,
    GeometricGrowthDetector,
    LayerRatioDetector,
    NonFiniteDetector,
    RuleSpec,
    Step,
    load_default_rules,
)
from gradwatch.rules.engine import diagnosis_of

DEPTH = 8
LAYERS = tuple(f"layers.{i}.{kind}" for i in range(DEPTH) for kind in ("weight", "bias"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def healthy_run(
    seed: int, steps: int = 5000, sigma: float = 0.4, job: str = "run"
) -> Iterator[Step]:
    """Warm-up ramp, then a slowly decaying noisy plateau; AMP overflow skips now and then."""
    rng = np.random.default_rng(seed)
    scale = np.repeat(np.geomspace(0.3, 3.0, DEPTH), 2) * np.tile(
        [1.0, 0.05], DEPTH
    )  # biases are tiny
    warmup = int(rng.integers(50, 500))
    for t in range(1, steps + 1):
        level = (0.05 + 0.95 * min(1.0, t / warmup)) / (1.0 + t / 2000.0)
        norms = (
            scale * level * rng.lognormal(0.0, sigma) * rng.lognormal(0.0, sigma / 2, scale.size)
        )
        loss = 2.5 / (1.0 + t / 500.0) * float(rng.lognormal(0.0, 0.1))
        skipped = t < 5 or t % 1999 == 0  # GradScaler finding its scale, then rare overflows
        if skipped:
            norms = np.full(scale.size, np.inf)
        yield Step(
            job=job,
            step=t,
            time=float(t),
            loss=loss,
            layers=LAYERS,
            layer_norms=norms,
            grad_norm=float(np.sqrt(np.sum(norms**2))),
            lr=(3e-4,),
            skipped=skipped,
            loss_scale=65536.0,
        )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sigma", [0.2, 0.5])
def test_healthy_runs_never_alert(seed: int, sigma: float) -> None:
    # `for: 1` everywhere: not one step of a healthy run may even look suspicious.
    engine = Engine([replace(r, for_steps=1) for r in load_default_rules()], clock=FakeClock())
    for step in healthy_run(seed, sigma=sigma):
        transitions = engine.observe(step)
        assert transitions == [], [t.alert.summary for t in transitions]
    assert engine.firing() == []


def test_nan_fires_once_then_resolves_with_the_same_id_and_json_ready_alert() -> None:
    clock = FakeClock()
    engine = Engine(load_default_rules(), clock=clock)
    events = []
    for step in healthy_run(1, steps=300):
        if step.step in (200, 201, 202):
            norms = step.layer_norms.copy()
            norms[2 if step.step == 200 else slice(None)] = math.nan
            step = Step(
                job=step.job,
                step=step.step,
                time=step.time,
                loss=math.nan,
                layers=LAYERS,
                layer_norms=norms,
                grad_norm=math.nan,
            )
        clock.now = float(step.step)
        events += engine.observe(step)
    assert [(e.alert.rule, e.current, e.alert.step) for e in events] == [
        ("NonFiniteGradients", "firing", 200),
        ("NonFiniteGradients", "resolved", 200),
    ]
    fired, resolved = (e.alert for e in events)
    assert fired.id == resolved.id
    assert fired.evidence["first_nonfinite"][0] == "layers.1.weight"
    assert resolved.resolved_at == 203.0
    # The seed's decision tree names the class; the rule's own checks come with the tree's.
    assert fired.diagnosis is not None and fired.diagnosis["verdict"] == "numerical"
    assert fired.diagnosis["summary"].startswith("numerical instability")
    assert "learning rate and gradient clipping" in fired.diagnosis["next_checks"]
    assert resolved.diagnosis == fired.diagnosis
    payload = json.loads(json.dumps(fired.to_dict(), allow_nan=False))
    assert payload["evidence"]["loss"] == "nan" and payload["category"] == "numerical"


def test_divergence_alerts_growth_and_firing_lists_it() -> None:
    engine = Engine(load_default_rules(), clock=FakeClock())
    fired_at = None
    for t in range(1, 120):
        norms = np.ones(len(LAYERS)) * 1.5 ** max(0, t - 60)
        transitions = engine.observe(
            Step(job="j", step=t, time=float(t), loss=1.0, layers=LAYERS, layer_norms=norms)
        )
        if transitions and fired_at is None:
            fired_at = t
            assert [tr.alert.rule for tr in transitions] == ["GradientNormGrowingGeometrically"]
            assert transitions[0].alert.category == "exploding_gradients"
    assert fired_at is not None and fired_at <= 80
    assert [a.rule for a in engine.firing()] == ["GradientNormGrowingGeometrically"]


def test_vanishing_ratio_routes_to_its_category() -> None:
    engine = Engine(load_default_rules(), clock=FakeClock())
    norms = np.repeat(np.geomspace(1e-4, 1.0, DEPTH), 2)
    events = []
    for t in range(1, 30):
        events += engine.observe(
            Step(job="j", step=t, time=float(t), layers=LAYERS, layer_norms=norms)
        )
    assert [(e.alert.rule, e.alert.category, e.alert.severity) for e in events] == [
        ("LayerGradNormRatioVanishing", "vanishing_gradients", "warning")
    ]
    assert events[0].alert.step == 5  # the median window filled at step 5; `for: 5` held until 9


def test_state_is_per_job_and_rank_and_forget_resolves() -> None:
    engine = Engine(load_default_rules(), clock=FakeClock())
    bad = Step(job="a", step=1, time=0.0, loss=math.nan)
    assert len(engine.observe(bad)) == 1
    assert len(engine.observe(Step(job="a", step=1, time=0.0, rank=1, loss=math.nan))) == 1
    assert engine.observe(Step(job="b", step=1, time=0.0, loss=1.0)) == []
    assert sorted((a.job, a.rank) for a in engine.firing()) == [("a", 0), ("a", 1)]
    assert engine.jobs() == ["a", "b"]
    closed = engine.forget("a")
    assert [(t.alert.state, t.alert.rank) for t in closed] == [("resolved", 0), ("resolved", 1)]
    assert engine.firing() == [] and engine.jobs() == ["b"]


def test_duplicate_rule_names_are_refused() -> None:
    rule = RuleSpec(name="X", detector="nonfinite", severity="info", category="numerical")
    with pytest.raises(ValueError, match="repeated: X"):
        Engine([rule, rule])


def test_diagnosis_from_annotations() -> None:
    diagnosis = diagnosis_of({"diagnosis": " verdict ", "next_checks": "one;two\nthree; "})
    assert diagnosis == {"verdict": "verdict", "next_checks": ("one", "two", "three")}
    assert diagnosis_of({"summary": "no verdict"}) is None


def test_ten_thousand_steps_of_a_thousand_layers_stay_bounded() -> None:
    layers = tuple(f"m{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(1000))
    rng = np.random.default_rng(0)
    base = rng.lognormal(0.0, 1.0, 1000)
    detectors = (NonFiniteDetector(), GeometricGrowthDetector(), LayerRatioDetector())
    for t in range(1, 10_001):
        norms = base * rng.lognormal(0.0, 0.3)
        if t % 1000 == 0:
            norms = norms.copy()
            norms[t // 1000] = math.nan
        step = Step(job="j", step=t, time=float(t), loss=1.0, layers=layers, layer_norms=norms)
        for det in detectors:
            det.observe(step)
    nonfinite, growth, ratio = detectors
    assert nonfinite._first_bad.shape == (1000,)
    assert len(growth._logs) == len(growth._steps) == growth.window
    assert len(ratio._log_ratios) == ratio.window
    assert len(ratio._ends._names) == 500


def test_for_counts_observations_of_the_rules_signal_not_steps() -> None:
    # The Hugging Face path: a loss every 10 steps, the steps between carry none. One logged
    # outlier followed by unlogged steps is one observation: LossSpike's min_steps (3 losses
    # up in a row) holds it; three are a spike, reported once three losses are back.
    rules = [r for r in load_default_rules() if r.name == "LossSpike"]
    rng = np.random.default_rng(0)

    def logged(losses: list[float]) -> list[Step]:
        out = []
        for k, loss in enumerate(losses):
            out.append(Step(job="hf", step=10 * k + 10, time=0.0, loss=loss))
            out += [Step(job="hf", step=10 * k + 10 + j, time=0.0) for j in range(1, 10)]
        return out

    base = [2.0 * float(rng.lognormal(0.0, 0.05)) for _ in range(200)]
    one = base[:150] + [6.0] + base[150:]
    engine = Engine(rules, clock=lambda: 0.0)
    assert [t for s in logged(one) for t in engine.observe(s)] == []
    three = base[:150] + [6.0, 6.2, 6.1] + base[150:]
    engine = Engine(rules, clock=lambda: 0.0)
    fired = [t.alert for s in logged(three) for t in engine.observe(s) if t.current == "firing"]
    assert [(a.rule, a.step) for a in fired] == [("LossSpike", 1560)]  # 1510-1530 up, back by 1560
    assert fired[0].evidence["spike_step"] == 1510
