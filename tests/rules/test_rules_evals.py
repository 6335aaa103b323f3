"""Evaluation detectors: generalization gap on trends, eval-mode wiring."""

from __future__ import annotations

import numpy as np

from gradwatch.rules import Step
from gradwatch.rules.evals import (
    EvalLossNonFiniteDetector,
    EvalModeWiringDetector,
    GeneralizationGapDetector,
    ValTrainGapDetector,
)
from gradwatch.rules.step import Eval


def train(
    det: GeneralizationGapDetector | ValTrainGapDetector | EvalLossNonFiniteDetector,
    level: float,
    at: int,
) -> None:
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
    vals = [2.0 - 0.05 * k for k in range(20)] + [
        1.05 + 0.03 * k for k in range(1, 20)
    ]  # turns at eval 20
    points = [(2.0 - 0.05 * k, v * float(rng.lognormal(0.0, 0.01))) for k, v in enumerate(vals)]
    found = evaluate(det, points)
    first = found.index(True)
    assert 22 <= first <= 30 and all(found[first:])


def test_val_rising_with_train_rising_is_not_a_gap() -> None:
    det = GeneralizationGapDetector()
    points = [(2.0 - 0.05 * k, 2.1 - 0.05 * k) for k in range(20)] + [
        (1.0 + 0.1 * k, 1.1 + 0.1 * k) for k in range(20)
    ]
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
    found = det.observe_eval(
        Eval(job="j", step=2, time=0.0, train_mode_modules=("bn1", "bn2", "drop"))
    )
    assert (
        found.active
        and found.evidence["modules"] == ["bn1", "bn2"]
        and found.evidence["count"] == 3
    )
    assert "1 more" in found.summary and "model.eval()" in found.summary


def test_a_noisy_eval_plateau_is_not_a_rise() -> None:
    # Val noise 3%: the best eval is an optimistic outlier; later evals above it are noise.
    for seed in range(5):
        rng = np.random.default_rng(seed)
        det = GeneralizationGapDetector()
        points = [(1.0 - 0.001 * k, 1.1 * float(rng.lognormal(0.0, 0.03))) for k in range(60)]
        assert not any(evaluate(det, points)), seed


def test_overfitting_with_one_eval_per_epoch_is_caught() -> None:
    # 6 evals (one per epoch): no noise estimate, judged on the rise alone (25% over the best).
    det = GeneralizationGapDetector()
    points = [(0.1 / (k + 1), 0.3 * (1 + 0.15 * k)) for k in range(6)]
    assert evaluate(det, points) == [False, False, False, True, True, True]


def test_few_evals_with_one_bump_are_not_overfitting() -> None:
    det = GeneralizationGapDetector()
    points = list(
        zip(
            [0.2, 0.17, 0.13, 0.12, 0.11, 0.10, 0.1],
            [0.30, 0.25, 0.24, 0.26, 0.23, 0.22, 0.22],
            strict=True,
        )
    )
    assert not any(evaluate(det, points))


def test_one_overfitting_episode_is_one_incident() -> None:
    # The val loss wobbles back under the limit it crossed: hysteresis keeps it one episode
    # until an eval comes back half-way to the best.
    det = GeneralizationGapDetector()
    vals = [1.0 - 0.04 * k for k in range(16)] + [0.42, 0.46, 0.5, 0.56, 0.45, 0.55, 0.58]
    found = evaluate(det, [(2.0 - 0.05 * k, v) for k, v in enumerate(vals)])
    assert found[16:] == [False, False, True, True, True, True, True]
    assert evaluate(det, [(0.5, 0.39)]) == [False]  # a new best: the episode is over


def test_a_constant_gap_from_the_first_eval_is_flagged() -> None:
    det = ValTrainGapDetector()
    points = [(1.0 - 0.1 * k, 20.0 * (1.0 - 0.1 * k)) for k in range(6)]  # 20x, both trending down
    found = []
    for k, (train_level, val) in enumerate(points):
        train(det, train_level, 100 * (k + 1))
        f = det.observe_eval(Eval(job="j", step=100 * (k + 1), time=0.0, loss=val))
        found.append(f is not None and f.active)
    assert found == [False, False, True, True, True, True]


def test_a_gap_that_opens_later_or_never_is_not_from_the_start() -> None:
    for vals in ([1.0, 0.9, 0.8, 8.0, 9.0], [0.9, 0.8, 0.75, 0.7, 0.7]):
        det = ValTrainGapDetector()
        for k, val in enumerate(vals):
            train(det, 0.8 - 0.05 * k, 100 * (k + 1))
            f = det.observe_eval(Eval(job="j", step=100 * (k + 1), time=0.0, loss=val))
            assert f is not None and not f.active


def test_a_noisy_small_validation_set_bouncing_is_not_overfitting() -> None:
    # 5 evals of a small validation set bounce 30% while training improves modestly (not to half).
    det = GeneralizationGapDetector()
    points = list(zip([1.0, 0.9, 0.85, 0.8, 0.75], [0.5, 0.45, 0.58, 0.6, 0.44], strict=True))
    assert not any(evaluate(det, points))


def _noisy_rise(train_end: float, seed: int) -> list[tuple[float, float]]:
    # 34 evals of a small validation set (noise ~15%): val falls to its best at eval 10, then
    # climbs to ~2.5x it; the training loss falls from 0.65 to train_end over the climb.
    rng = np.random.default_rng(seed)
    vals = [3.0 - 0.2 * k for k in range(10)] + [1.0 + 0.06 * k for k in range(24)]
    trains = [0.7] * 10 + [0.65 - (0.65 - train_end) * k / 23 for k in range(24)]
    return [(t, v * float(rng.lognormal(0.0, 0.15))) for t, v in zip(trains, vals, strict=True)]


def test_a_material_rise_on_a_noisy_validation_set_is_caught() -> None:
    # Seen on a held-out real log (a ConvNeXt run, 34 evals): the noise bar sat above a val loss
    # that had doubled while the training loss fell tenfold. The material rise (25% over the
    # best with the training loss halved) counts at any number of evals.
    for seed in range(5):
        assert any(evaluate(GeneralizationGapDetector(), _noisy_rise(0.06, seed))), seed


def test_a_noisy_rise_without_the_training_loss_halving_waits_for_the_noise_bar() -> None:
    # The same validation curve while training only creeps down (0.65 -> 0.5): the material
    # branch needs the training loss at half its level at the best eval, so it stays out.
    fired = [
        evaluate(GeneralizationGapDetector(), _noisy_rise(0.5, seed)).index(True)
        if any(evaluate(GeneralizationGapDetector(), _noisy_rise(0.5, seed)))
        else None
        for seed in range(5)
    ]
    halved = [
        evaluate(GeneralizationGapDetector(), _noisy_rise(0.06, seed)).index(True)
        for seed in range(5)
    ]
    # Never earlier, and later (or never) where the noise bar alone had not been crossed yet.
    pairs = list(zip(fired, halved, strict=True))
    assert all(f is None or f >= h for f, h in pairs)
    assert any(f is None or f > h for f, h in pairs)


def _smooth_rise(top: float) -> list[tuple[float, float]]:
    # 20 smooth evals: val at its best (1.0) at eval 2, then up to `top` x the best by eval 10
    # and flat there, while the training loss falls steadily by a quarter (never halves).
    vals = [1.02, 1.0] + [1.0 + (top - 1.0) * min(k, 8) / 8 for k in range(1, 19)]
    trains = [1.0 - 0.25 * k / 19 for k in range(20)]
    return list(zip(trains, vals, strict=True))


def test_a_small_smooth_rise_is_an_early_notice_not_a_page() -> None:
    # The default pack pages (GeneralizationGap, rise 0.25) on a material rise and informs
    # (ValidationLossRising: rise 0.05, noise_only) on one past the noise alone: a smooth
    # +10% while training falls a quarter is the second, as on a real held-out log
    # labelled healthy (docs/rules.md).
    page = GeneralizationGapDetector(rise=0.25)
    notice = GeneralizationGapDetector(rise=0.05, noise_only=True)
    assert not any(evaluate(page, _smooth_rise(1.10)))
    assert any(evaluate(notice, _smooth_rise(1.10)))
    # The same shape at +60% pages.
    assert any(evaluate(GeneralizationGapDetector(rise=0.25), _smooth_rise(1.60)))


def test_noise_only_leaves_few_evals_and_the_material_rise_to_the_page() -> None:
    # 5 evals (no noise estimate): a doubling with the training loss fallen tenfold is the
    # page rule's; the noise-only rule says nothing before noise_evals evals.
    points = [(1.0, 1.0), (0.5, 1.3), (0.3, 1.6), (0.1, 1.9), (0.1, 2.0)]
    assert any(evaluate(GeneralizationGapDetector(rise=0.25), points))
    assert not any(evaluate(GeneralizationGapDetector(noise_only=True), points))


def test_a_non_finite_eval_loss_fires_until_an_eval_is_finite_again() -> None:
    det = EvalLossNonFiniteDetector()
    losses = [0.9, float("nan"), float("inf"), 0.8, float("nan")]
    found = [
        det.observe_eval(Eval(job="j", step=100 * (k + 1), time=0.0, loss=v))
        for k, v in enumerate(losses)
    ]
    assert [f.active for f in found] == [False, True, True, False, True]
    assert found[2].evidence["since_step"] == 200  # one episode from its first NaN eval
    assert found[4].evidence["since_step"] == 500  # a new one after the finite eval
    assert "step 300 is inf" in found[2].summary
    # An eval without a loss says nothing.
    assert not det.observe_eval(Eval(job="j", step=600, time=0.0, loss=None)).active


def test_a_non_finite_eval_after_non_finite_training_is_left_to_the_training_rule() -> None:
    # Training went NaN first: the NaN eval only echoes it (NonFiniteGradients owns it).
    det = EvalLossNonFiniteDetector()
    train(det, float("nan"), 100)
    assert not det.observe_eval(Eval(job="j", step=100, time=0.0, loss=float("nan"))).active
    # Training finite again (a rollback), the eval still NaN: the evaluation's own problem.
    train(det, 0.7, 200)
    assert det.observe_eval(Eval(job="j", step=200, time=0.0, loss=float("nan"))).active


def test_evals_during_a_training_blow_up_are_not_a_gap_from_the_start() -> None:
    # pytorch/examples' time_sequence_prediction (LBFGS): the loss 1e-4 -> 1e16 in one step;
    # its evals then echoed the blow-up against a training median from before it, and the
    # rule paged "the two do not measure the same data". LossFarAboveStart owns that.
    det = ValTrainGapDetector()
    for t in range(1, 7):
        det.observe(Step(job="j", step=t, time=0.0, loss=1e-4))
    found = []
    for t in range(7, 12):
        det.observe(Step(job="j", step=t, time=0.0, loss=1e16 * t))
        found.append(det.observe_eval(Eval(job="j", step=t, time=0.0, loss=1e17 * t)))
    assert found == [None] * 5
