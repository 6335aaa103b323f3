"""Geometric-growth detector: divergence is caught fast; healthy shapes stay quiet."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.rules import GeometricGrowthDetector, Step
from gradwatch.rules.growth import fit_line, total_grad_norm

FP16_MAX = 65504.0


def norm_step(t: int, norm: float, **kw: object) -> Step:
    return Step(job="j", step=t, time=float(t), grad_norm=norm, **kw)


def first_active(
    det: GeometricGrowthDetector, norms: list[float], start: int = 1, **kw: object
) -> tuple[int, dict]:
    for i, value in enumerate(norms):
        found = det.observe(norm_step(start + i, value, **kw))
        if found.active:
            return start + i, dict(found.evidence)
    return -1, {}


@pytest.mark.parametrize("seed", range(5))
def test_x1_5_per_step_from_a_noisy_plateau_is_caught_within_20_steps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    onset = 300
    norms = [
        1.5 ** max(0, t - onset) * float(rng.lognormal(0.0, 0.2)) for t in range(1, onset + 60)
    ]
    det = GeometricGrowthDetector()
    fired, evidence = first_active(det, norms)
    assert onset < fired <= onset + 20
    assert evidence["factor_per_step"] == pytest.approx(1.5, rel=0.1)
    expected = (math.log(np.finfo(np.float32).max) - math.log(evidence["grad_norm"])) / math.log(
        1.5
    )
    assert evidence["steps_to_overflow"] == pytest.approx(expected, rel=0.15)
    assert evidence["r2"] >= 0.9
    assert evidence["window"] == 16


def test_divergence_from_the_first_step_is_caught_once_the_window_fills() -> None:
    det = GeometricGrowthDetector()
    fired, evidence = first_active(det, [0.5 * 1.5**t for t in range(40)])
    assert fired == 16
    assert evidence["factor_per_step"] == pytest.approx(1.5)
    assert evidence["r2"] == pytest.approx(1.0)


def test_overflow_projection_uses_the_runs_dtype() -> None:
    det = GeometricGrowthDetector()
    found = None
    for t in range(16):
        found = det.observe(norm_step(t, 2.0**t, dtype_max=FP16_MAX))
    assert found is not None and found.active
    # 2**15 now, doubling per step: float16's 65504 is one doubling away.
    assert found.evidence["steps_to_overflow"] == 1
    assert found.evidence["dtype"] == "float16"
    assert "float16 overflows in ~1 steps" in found.summary
    assert "×2.00 per step" in found.summary


def test_layer_norms_are_used_when_the_total_is_not_reported() -> None:
    s = Step(job="j", step=1, time=0.0, layer_norms=np.array([3.0, 4.0]))
    assert total_grad_norm(s) == pytest.approx(5.0)
    assert total_grad_norm(Step(job="j", step=1, time=0.0)) is None


@pytest.mark.parametrize(
    "shape",
    [
        lambda t: t / 100.0,  # linear rise from near zero (LR warm-up)
        lambda t: 3.0 * (1.0 - math.exp(-t / 10.0)),  # fast rise out of init, then plateau
        lambda t: 0.2 + 1.8 * min(1.0, t / 200.0),  # 10x over a 200-step warm-up
        lambda t: 1.01**t if t < 300 else 1.01**300,  # slow steady drift, then plateau
    ],
)
def test_decelerating_or_slow_rises_do_not_fire(shape) -> None:
    det = GeometricGrowthDetector()
    rng = np.random.default_rng(0)
    fired, _ = first_active(
        det, [shape(t) * float(rng.lognormal(0.0, 0.05)) for t in range(1, 1000)]
    )
    assert fired == -1


def test_gaps_give_no_verdict_and_a_rollback_clears_the_history() -> None:
    det = GeometricGrowthDetector()
    fired, _ = first_active(det, [1.5**t for t in range(20)])
    assert fired > 0
    assert det.observe(norm_step(100, math.inf)) is None  # overflow: no new evidence
    assert det.observe(Step(job="j", step=101, time=0.0)) is None  # nothing measured
    assert not det.observe(norm_step(5, 1.0)).active  # steps went back: history restarts
    assert len(det._logs) == 1


@pytest.mark.parametrize("seed", range(3))
def test_growth_from_a_tiny_norm_towards_normal_is_not_an_explosion(seed: int) -> None:
    # Weights initialised 100x too small wake up: the norm climbs geometrically
    # from 1e-4 to 0.05 (issue 13's fault suite), then settles. Below the absolute floor.
    rng = np.random.default_rng(seed)
    norms = [min(0.05, 1e-4 * 1.15**t) * float(rng.lognormal(0.0, 0.05)) for t in range(400)]
    assert first_active(GeometricGrowthDetector(), norms) == (-1, {})
    # The same climb in a run whose norm was once larger: back to its usual level, not above it.
    rng = np.random.default_rng(seed)
    dip = [2.0] * 200 + [min(2.0, 0.01 * 1.2**t) for t in range(200)]
    assert (
        first_active(GeometricGrowthDetector(), [n * float(rng.lognormal(0.0, 0.05)) for n in dip])[
            0
        ]
        == -1
    )


def test_an_explosion_above_the_runs_typical_level_names_it() -> None:
    rng = np.random.default_rng(0)
    norms = [0.5 * float(rng.lognormal(0.0, 0.1)) for _ in range(300)] + [
        0.5 * 1.4**k for k in range(1, 40)
    ]
    fired, evidence = first_active(GeometricGrowthDetector(), norms)
    assert 300 < fired <= 320
    assert evidence["typical_grad_norm"] == pytest.approx(0.5, rel=0.1)
    assert evidence["grad_norm"] >= max(1.0, 10 * evidence["typical_grad_norm"])


def test_amp_skips_are_ignored() -> None:
    det = GeometricGrowthDetector()
    for t in range(1, 200):
        skipped = t % 5 == 0
        found = det.observe(
            norm_step(t, 1e30 if skipped else 1.0, skipped=skipped, loss_scale=1024.0)
        )
        assert found is None if skipped else not found.active
    assert set(det._logs) == {0.0}  # only the unskipped norms of 1.0 entered the fit


def test_fit_line() -> None:
    x = np.arange(10, dtype=float)
    assert fit_line(x, 2.0 * x + 1.0) == pytest.approx((2.0, 1.0))
    assert fit_line(x, np.ones(10)) == (0.0, 0.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"window": 3},
        {"min_factor": 1.0},
        {"min_r2": 1.5},
        {"min_total_growth": 0.5},
        {"min_norm": -1.0},
        {"min_rise": 0.5},
        {"history": 0},
    ],
)
def test_invalid_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        GeometricGrowthDetector(**bad)
