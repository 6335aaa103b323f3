"""Loss-curve detectors: flat from the start, spikes vs divergence, a trend that turns up."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from gradwatch.rules import Step
from gradwatch.rules.detector import INACTIVE, Finding
from gradwatch.rules.loss import FlatFromStartDetector, LossAboveStartDetector, RisingLossDetector
from gradwatch.rules.series import flat_since_start, trending_up
from gradwatch.rules.spike import LossSpikeDetector


def steps(losses: Iterable[float], first: int = 1, lr: float | None = 1e-3) -> list[Step]:
    return [
        Step(job="j", step=first + i, time=float(i), loss=loss, lr=() if lr is None else (lr,))
        for i, loss in enumerate(losses)
    ]


def run(det: object, losses: Iterable[float], **kw: object) -> list[Finding]:
    """Every step's verdict; a step the detector gave none for (no observation) reads inactive."""
    # `det` is typed object so one helper runs every detector.
    found = [det.observe(s) for s in steps(losses, **kw)]  # type: ignore[attr-defined]
    return [INACTIVE if f is None else f for f in found]


def noisy(n: int, level: float = 2.3, sigma: float = 0.05, seed: int = 0) -> np.ndarray:
    return level * np.random.default_rng(seed).lognormal(0.0, sigma, n)


# ---------------------------------------------------------------- flat from the start


def test_flat_fires_once_the_windows_resolve_it() -> None:
    found = run(FlatFromStartDetector(), noisy(400, sigma=0.005))
    first = next(i for i, f in enumerate(found) if f.active) + 1
    assert first == 250  # 50 head + 200 window, judged every 10 steps
    ev = found[-1].evidence
    assert (
        abs(ev["change"]) < 0.02
        and ev["bound"] <= 0.02
        and ev["start_level"] == pytest.approx(2.3, rel=0.01)
    )


def test_a_constant_loss_is_flat() -> None:
    assert run(FlatFromStartDetector(), [0.693] * 300)[-1].active


@pytest.mark.parametrize("seed", range(4))
def test_noisy_slowly_decreasing_loss_is_not_flat(seed: int) -> None:
    t = np.arange(3000)
    losses = 2.3 * (1.0 - 0.1 * t / 3000) * np.random.default_rng(seed).lognormal(0.0, 0.3, t.size)
    assert not any(f.active for f in run(FlatFromStartDetector(), losses))


def test_converged_run_with_a_flat_tail_is_not_flat() -> None:
    losses = 0.05 + 2.0 * np.exp(-np.arange(2000) / 20.0)  # learned in the first ~50 steps
    assert not any(f.active for f in run(FlatFromStartDetector(), losses))


def test_a_run_first_seen_mid_way_is_not_judged() -> None:
    assert not any(f.active for f in run(FlatFromStartDetector(), [0.7] * 600, first=50_000))


def test_no_verdict_while_the_learning_rate_still_rises() -> None:
    det = FlatFromStartDetector()
    found = [
        det.observe(Step(job="j", step=t, time=0.0, loss=2.3, lr=(1e-6 * t,)))
        for t in range(1, 600)
    ]
    assert not any(f.active for f in found)
    assert det.observe(Step(job="j", step=600, time=0.0, loss=2.3, lr=(6e-4,))).active is False
    found = [
        det.observe(Step(job="j", step=t, time=0.0, loss=2.3, lr=(6e-4,))) for t in range(601, 900)
    ]
    assert found[-1].active  # warm-up over, still flat


def test_flat_since_start_needs_the_first_losses_too() -> None:
    # First window already converged, but the very first losses were 10x higher: it learned.
    verdict = flat_since_start([2.3] * 5, [0.2] * 50, [0.2] * 200, tolerance=0.02, z=3.0)
    assert not verdict.flat and verdict.first == 2.3


# ---------------------------------------------------------------- rising


def test_rising_after_decreasing_fires_and_names_the_low() -> None:
    t = np.arange(1500)
    level = np.where(t < 600, 2.3 - 1.5 * t / 600, 0.8 + 1.0 * (t - 600) / 900)
    found = run(RisingLossDetector(), level * np.random.default_rng(0).lognormal(0.0, 0.1, t.size))
    first = next(i for i, f in enumerate(found) if f.active)
    # 25% of the 1.5 drop back (t ~ 940), then the 3 blocks above it.
    assert 940 < first < 1100
    ev = found[first].evidence
    assert 500 <= ev["low_step"] <= 700 and ev["rise"] >= 0.2 and ev["undone"] >= 0.25


def test_rising_from_the_start_is_not_this_rule() -> None:
    losses = np.linspace(1.0, 3.0, 1000)
    assert not any(f.active for f in run(RisingLossDetector(), losses))


@pytest.mark.parametrize("seed", range(3))
def test_noisy_plateau_never_rises(seed: int) -> None:
    losses = noisy(5000, sigma=0.3, seed=seed)
    losses[:100] *= 2.0
    assert not any(f.active for f in run(RisingLossDetector(), losses))


def test_trending_up() -> None:
    assert trending_up([1.0 * 1.1**i for i in range(30)], factor=4.0)
    assert not trending_up([1.0] * 30, factor=1.2)
    assert not trending_up([1.0, 2.0], factor=1.2)


# ---------------------------------------------------------------- every scale


def converged_run(n: int = 1200, seed: int = 0) -> np.ndarray:
    """2.0 down to a converged ~3e-4, logged with 4 decimals (as the HF Trainer does), 10x blips."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    level = 3e-4 + 2.0 * np.exp(-t / 60.0)
    losses = level * rng.lognormal(0.0, 0.4, n)
    blips = rng.random(n) < 0.03
    losses[blips & (t > 600)] *= 10.0  # 3e-4 -> 3e-3: many sigmas, yet noise for this run
    return np.round(losses, 4)


@pytest.mark.parametrize("seed", range(3))
def test_a_converged_tiny_loss_moving_tenfold_is_noise(seed: int) -> None:
    losses = converged_run(seed=seed)
    assert not any(f.active for f in run(LossSpikeDetector(), losses))
    assert not any(f.active for f in run(RisingLossDetector(), losses))


def test_a_real_spike_near_convergence_still_counts() -> None:
    losses = converged_run()
    losses[900:910] = 0.5  # a quarter of the run's progress undone
    found = run(LossSpikeDetector(), losses)
    active = [i for i, f in enumerate(found) if f.active]
    assert active == [912]  # reported once it is back (3 losses at its level)
    assert found[912].evidence["spike_step"] == 901


def test_a_loss_at_exactly_zero_is_not_rising_by_inf_percent() -> None:
    losses = [0.7 * 0.9**k for k in range(75)] + [0.0] * 100 + [0.0001] * 100
    assert not any(f.active for f in run(RisingLossDetector(), losses))
    back = [0.7 * 0.9**k for k in range(75)] + [0.0] * 100 + [0.4] * 100  # genuinely back up
    found = run(RisingLossDetector(), back)
    hit = next(f for f in found if f.active)
    assert (
        "+inf" not in hit.summary
        and "up from its low 0" in hit.summary
        and hit.evidence["rise"] is None
    )


def test_a_loss_wandering_around_chance_is_flat() -> None:
    # Labels shuffled against the inputs: the model memorises a little, the loss wanders 2-3%
    # around ln(4) with no net progress.
    t = np.arange(600)
    wander = np.log(4.0) * (1.0 + 0.03 * np.sin(t / 40.0))
    found = run(
        FlatFromStartDetector(tolerance=0.05),
        wander * np.random.default_rng(0).lognormal(0.0, 0.05, t.size),
    )
    assert found[-1].active and "has not improved since step one" in found[-1].summary


def test_a_loss_that_fell_and_came_back_is_not_flat() -> None:
    t = np.arange(800)
    level = np.where(t < 300, 2.3 - 1.0 * t / 300, 1.3 + 1.0 * (t - 300) / 300).clip(max=2.35)
    found = run(
        FlatFromStartDetector(tolerance=0.05),
        level * np.random.default_rng(0).lognormal(0.0, 0.02, t.size),
    )
    assert not any(f.active for f in found)


def test_a_flat_incident_lasts_until_the_loss_clearly_moves_on() -> None:
    rng = np.random.default_rng(0)
    level = np.concatenate(
        [np.full(400, 2.0), np.full(600, 1.88), np.full(600, 1.5)]
    )  # -6%, then -25%
    found = run(FlatFromStartDetector(tolerance=0.05), level * rng.lognormal(0.0, 0.01, level.size))
    active = [f.active for f in found]
    first = active.index(True)
    assert first == 249 and all(active[first:1000])  # hovering past the bound: one incident
    assert not active[-1]


def test_a_loss_falling_back_after_a_jump_is_not_rising() -> None:
    # A change of data: the loss jumps from its converged 0.6 to 2.5 and the run learns the new
    # data (it falls back over ~100 steps). Every block after the jump is above the low, but
    # the trend across them is down: learning, not a learning rate too high.
    t = np.arange(900)
    level = np.where(
        t < 400, 0.6 + 1.4 * np.exp(-t / 60.0), 0.55 + 1.95 * np.exp(-(t - 400) / 60.0)
    )
    losses = level * np.random.default_rng(0).lognormal(0.0, 0.1, t.size)
    assert not any(f.active for f in run(RisingLossDetector(), losses))
    stays = np.where(t < 400, level, 1.5) * np.random.default_rng(0).lognormal(0.0, 0.1, t.size)
    assert any(f.active for f in run(RisingLossDetector(), stays))  # up and staying: still rising


# ---------------------------------------------------------------- far above the start


def above(losses: Iterable[float], first: int = 1) -> list[bool | None]:
    det = LossAboveStartDetector(factor=10.0, over=3)
    out: list[bool | None] = []
    for step in steps(losses, first=first):
        found = det.observe(step)
        out.append(None if found is None else found.active)
    return out


def test_a_model_broken_in_its_first_step_pages_at_the_third_loss() -> None:
    # pytorch/examples' word_language_model, AdamW at lr 20 (benchmarks/wlm_trial.py):
    # 10.1 at step 1, then 18,514 and up. No history to judge a jump against is needed.
    measured = [10.14, 18513.6, 124696.4, 57180.0, 59737.7, 93840.1]
    assert above(measured) == [False, False, True, True, True, True]
    det = LossAboveStartDetector(factor=10.0, over=3)
    found = [det.observe(s) for s in steps(measured)][-1]
    assert found is not None and found.evidence["first_loss"] == pytest.approx(10.14)
    assert found.evidence["ratio"] == pytest.approx(59737.7 / 10.14)


def test_healthy_curves_and_a_task_switch_stay_below_the_start_bound() -> None:
    # A falling loss with batch noise (multiplicative, 20%) never nears 10x its first value.
    falling = (0.2 + 2.3 * np.exp(-np.arange(400) / 150.0)) * noisy(400, 1.0, 0.2)
    assert not any(above(falling))
    # A task switch (the fault suite's healthy control): 2.4x the first loss, then learnt.
    switched = [1.0] * 50 + [0.3] * 200 + [2.4] * 20 + list(np.linspace(2.4, 0.5, 100))
    assert not any(above(switched))
    # A one-step spike of 50x is no level: the median of three losses stays down.
    assert not any(above([2.0] * 20 + [100.0] + [2.0] * 20))


def test_back_under_the_bound_resolves_it() -> None:
    verdicts = above([1.0, 50.0, 60.0, 70.0, 2.0, 1.0, 1.0])
    assert verdicts == [False, False, True, True, True, False, False]


def test_runs_not_seen_from_the_start_and_signed_losses_are_not_judged() -> None:
    assert above([1.0, 50.0, 60.0, 70.0], first=500) == [None] * 4  # a resume
    assert above([-1.0, 50.0, 60.0, 70.0]) == [None] * 4  # a loss that may be negative
    assert above([0.0, 50.0, 60.0, 70.0]) == [None] * 4
