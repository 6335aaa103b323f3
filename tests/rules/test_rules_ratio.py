"""Layer-ratio detector: both directions, module grouping, smoothing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.rules import LayerRatioDetector, Step
from gradwatch.rules.ratio import group_layers, module_of

LAYERS = ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias")


def step(t: int, norms: list[float], layers: tuple[str, ...] = LAYERS, **kw: object) -> Step:
    return Step(job="j", step=t, time=float(t), layers=layers, layer_norms=np.array(norms, dtype=float), **kw)


def run(det: LayerRatioDetector, norms: list[float], n: int = 10, **kw: object):
    found = None
    for t in range(1, n + 1):
        found = det.observe(step(t, norms, **kw))
    assert found is not None
    return found


def test_vanishing_first_much_smaller_than_last() -> None:
    found = run(LayerRatioDetector(), [1e-3, 1e-4, 0.1, 0.01, 1.0, 0.1])
    assert found.active
    ev = found.evidence
    assert ev["direction"] == "vanishing"
    assert (ev["first_module"], ev["last_module"]) == ("0", "2")
    assert ev["first_norm"] == pytest.approx(math.hypot(1e-3, 1e-4))
    assert ev["last_norm"] == pytest.approx(math.hypot(1.0, 0.1))
    assert ev["ratio"] == pytest.approx(ev["first_norm"] / ev["last_norm"])
    assert "vanishing" in found.summary and "'0'" in found.summary


def test_exploding_first_much_larger_than_last() -> None:
    found = run(LayerRatioDetector(), [500.0, 1.0, 10.0, 1.0, 1.0, 0.5])
    assert found.active
    assert found.evidence["direction"] == "exploding"
    assert found.evidence["ratio"] > 100


def test_direction_filter() -> None:
    vanishing = [1e-3, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert not run(LayerRatioDetector(direction="exploding"), vanishing).active
    assert run(LayerRatioDetector(direction="vanishing"), vanishing).active


def test_a_tiny_bias_does_not_decide() -> None:
    # Per tensor, first/last would be 1.0 / 1e-5: five orders of magnitude.
    found = run(LayerRatioDetector(), [1.0, 1e-4, 1.0, 1e-3, 1.0, 1e-5])
    assert not found.active


def test_below_threshold_is_quiet() -> None:
    assert not run(LayerRatioDetector(), [0.02, 0.0, 1.0, 0.0, 1.0, 0.0]).active  # 50x


def test_one_noisy_step_does_not_flip_it() -> None:
    det = LayerRatioDetector(window=5)
    healthy, outlier = [1.0, 0.1, 1.0, 0.1, 1.0, 0.1], [1e-4, 0.0, 1.0, 0.1, 1.0, 0.1]
    for t in range(1, 50):
        assert not det.observe(step(t, outlier if t % 10 == 0 else healthy)).active
    sick = LayerRatioDetector(window=5)
    for t in range(1, 50):
        assert sick.observe(step(t, healthy if t % 10 == 0 else outlier)).active == (t >= 5)


def test_zero_and_non_finite_modules_are_skipped() -> None:
    # Module 0 frozen (zero), module 2 non-finite: the ratio is between modules 1 and 3.
    layers = ("0.w", "1.w", "2.w", "3.w")
    found = run(LayerRatioDetector(), [0.0, 1.0, math.nan, 1e-3], layers=layers)
    assert found.active
    assert (found.evidence["first_module"], found.evidence["last_module"]) == ("1", "3")


def test_ignore_patterns_and_too_few_modules() -> None:
    layers = ("embed.weight", "h.0.weight", "head.weight")
    assert run(LayerRatioDetector(), [1e-4, 1.0, 1.0], layers=layers).active
    assert not run(LayerRatioDetector(ignore=("embed",)), [1e-4, 1.0, 1.0], layers=layers).active
    assert not run(LayerRatioDetector(), [1e-4, 1.0], layers=("0.weight", "0.bias")).active


def test_amp_skips_and_missing_norms_keep_the_verdict() -> None:
    det = LayerRatioDetector(window=1)
    assert det.observe(step(1, [1e-4, 0.0, 1.0, 0.0, 1.0, 0.0])).active
    assert det.observe(step(2, [math.inf] * 6, skipped=True, loss_scale=2.0)).active
    assert det.observe(Step(job="j", step=3, time=3.0)).active
    assert len(det._log_ratios) == 1


def test_grouping() -> None:
    assert module_of("encoder.layers.0.weight") == "encoder.layers.0"
    assert module_of("weight") == ""
    inverse, names, skip = group_layers(("a.w", "a.b", "b.w", "c.w", "c.b"), ignore=("b",))
    assert inverse.tolist() == [0, 0, 1, 2, 2]
    assert names == ["a", "b", "c"]
    assert skip.tolist() == [False, True, False]


@pytest.mark.parametrize("bad", [{"threshold": 1.0}, {"window": 0}, {"direction": "sideways"}])
def test_invalid_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        LayerRatioDetector(**bad)
