"""Evaluation detectors: generalization gap on trends, eval-mode wiring."""

from __future__ import annotations

import numpy as np

from gradwatch.rules import Step
from gradwatch.rules.evals import EvalModeWiringDetector, GeneralizationGapDetector
from gradwatch.rules.step import Eval


def train(det: GeneralizationGapDetector, level: float, at: int) -> None:
    for t in range(at - 50, at):
        assert det.observe(Step(job="j", step=t, time=0.0, loss=level)) is None  # context only


def evaluate(det: GeneralizationGapDetector, points: list[tuple[float, float]]) -> list[bool]:
    out = []
    for k, (train_level, val) in enumerate(points):
        at = 100 * (k + 1)
        train(det, train_level, at)
        found = det.observe_eval(Eval(job="j", step=at, time=0.0, loss=val))
        assert found is not None
        out.append(found.active)
    return out


def test_val_rising_while_train_falls_fires_after_patience() -> None:
    det = GeneralizationGapDetector()
    rng = np.random.default_rng(0)
    vals = [2.0 - 0.05 * k for k in range(20)] + [1.05 + 0.03 * k for k in range(1, 20)]  # turns at eval 20
    points = [(2.0 - 0.05 * k, v * float(rng.lognormal(0.0, 0.01))) for k, v in enumerate(vals)]
    found = evaluate(det, points)
    first = found.index(True)
    assert 22 <= first <= 30 and all(found[first:])


def test_val_rising_with_train_rising_is_not_a_gap() -> None:
    det = GeneralizationGapDetector()
    points = [(2.0 - 0.05 * k, 2.1 - 0.05 * k) for k in range(20)] + [(1.0 + 0.1 * k, 1.1 + 0.1 * k) for k in range(20)]
    assert not any(evaluate(det, points))


def test_a_steady_level_gap_is_not_a_gap() -> None:
    # smdebug's Overfit would flag this (val 30% over train); the trends are healthy.
    det = GeneralizationGapDetector()
    assert not any(evaluate(det, [(2.0 - 0.1 * k, 1.3 * (2.0 - 0.1 * k)) for k in range(10)]))


def test_evals_without_loss_or_train_context_say_nothing() -> None:
    det = GeneralizationGapDetector()
    assert det.observe_eval(Eval(job="j", step=1, time=0.0)) is None
    assert det.observe_eval(Eval(job="j", step=1, time=0.0, loss=float("nan"))) is None
    for k, val in enumerate([1.0, 1.2, 1.4, 1.6]):
        found = det.observe_eval(Eval(job="j", step=k, time=0.0, loss=val))
        assert found is not None and not found.active  # no training loss seen: cannot tell


def test_eval_mode_wiring_names_the_modules() -> None:
    det = EvalModeWiringDetector(max_named=2)
    assert not det.observe_eval(Eval(job="j", step=1, time=0.0, loss=1.0)).active
    found = det.observe_eval(Eval(job="j", step=2, time=0.0, train_mode_modules=("bn1", "bn2", "drop")))
    assert found.active and found.evidence["modules"] == ["bn1", "bn2"] and found.evidence["count"] == 3
    assert "1 more" in found.summary and "model.eval()" in found.summary


def test_a_noisy_eval_plateau_is_not_a_rise() -> None:
    # Val noise 3%: the best eval is an optimistic outlier; later evals above it are noise.
    for seed in range(5):
        rng = np.random.default_rng(seed)
        det = GeneralizationGapDetector()
        points = [(1.0 - 0.001 * k, 1.1 * float(rng.lognormal(0.0, 0.03))) for k in range(60)]
        assert not any(evaluate(det, points)), seed
