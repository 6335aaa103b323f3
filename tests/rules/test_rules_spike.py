"""Loss jumps: a spike that recovers, a level shift the run learns from, a jump that stays."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pytest
from pydantic import ValidationError

from gradwatch.rules import Step
from gradwatch.rules.detector import INACTIVE, Finding
from gradwatch.rules.spike import LossSpikeDetector

AT = 200  # index of the jump in every series below (step AT + 1)


def run(
    det: LossSpikeDetector,
    losses: Iterable[float],
    grads: Sequence[float] | None = None,
    lrs: Sequence[float] | None = None,
) -> list[Finding]:
    """Every step's verdict; a step the detector gave none for reads inactive."""
    found = []
    for i, loss in enumerate(losses):
        step = Step(
            job="j",
            step=i + 1,
            time=float(i),
            loss=loss,
            grad_norm=None if grads is None else grads[i],
            lr=(1e-3 if lrs is None else lrs[i],),
        )
        verdict = det.observe(step)
        found.append(INACTIVE if verdict is None else verdict)
    return found


def active(found: list[Finding]) -> list[int]:
    return [i for i, f in enumerate(found) if f.active]


def noisy(n: int, level: float = 2.3, sigma: float = 0.05, seed: int = 0) -> np.ndarray:
    return level * np.random.default_rng(seed).lognormal(0.0, sigma, n)


def spike_series(n: int = 400, height: float = 3.0, length: int = 10, seed: int = 0) -> np.ndarray:
    losses = noisy(n, seed=seed)
    losses[AT : AT + length] *= height
    return losses


def shift_series(n: int = 500, seed: int = 0, tau: float = 40.0) -> np.ndarray:
    """Converged at 0.6, then new data at AT: the loss jumps to 3.0 and the run learns it."""
    t = np.arange(n)
    level = np.where(t < AT, 0.6, 0.6 + 2.4 * np.exp(-(t - AT) / tau))
    return level * np.random.default_rng(seed).lognormal(0.0, 0.1, n)


def calm_grads(losses: np.ndarray, seed: int = 1) -> np.ndarray:
    """A gradient norm that follows the loss (a harder batch: larger error, same Jacobian)."""
    return 0.9 * losses**0.8 * np.random.default_rng(seed).lognormal(0.0, 0.2, losses.size)


# ---------------------------------------------------------------- spikes


def test_a_spike_that_recovers_is_reported_once_when_it_is_over() -> None:
    found = run(LossSpikeDetector(), spike_series())
    assert active(found) == [AT + 12]  # 10 losses up, then 3 back at the level
    ev = found[AT + 12].evidence
    assert ev["spike_step"] == AT + 1 and ev["height_sigmas"] > 6 and ev["space"] == "log"
    assert ev["level"] == pytest.approx(2.3, rel=0.05) and ev["peak_step"] <= AT + 10
    assert f"steps {AT + 1}-{AT + 10}" in found[AT + 12].summary


def test_one_or_two_hard_batches_are_not_a_spike() -> None:
    assert active(run(LossSpikeDetector(), spike_series(length=2))) == []


def test_a_jump_that_stays_is_a_spike_once_read_then_a_divergence() -> None:
    stays = spike_series(length=200)
    spike = run(LossSpikeDetector(), stays)
    assert active(spike)[0] == AT + 15  # the 16th loss up: not falling back
    assert "not falling back over 16 losses" in spike[AT + 15].summary
    assert all(f.active for f in spike[AT + 15 : AT + 200])
    found = run(LossSpikeDetector(report="divergence"), stays)
    assert active(found)[0] == AT + 49  # the 50th loss above the level
    assert "diverging" in found[AT + 49].summary and found[AT + 49].evidence["steps_above"] == 50
    assert active(run(LossSpikeDetector(report="divergence"), spike_series())) == []


def test_one_episode_is_one_incident_through_dips() -> None:
    losses = spike_series(length=60)
    losses[AT + 30] = 2.3  # one loss back at its level mid-episode
    found = run(LossSpikeDetector(), losses)
    first = active(found)[0]
    assert all(f.active for f in found[first : AT + 60])


# ---------------------------------------------------------------- level shifts


@pytest.mark.parametrize(("tau", "read"), [(10.0, {AT + 15}), (40.0, set(range(AT + 16, AT + 49)))])
def test_a_jump_the_run_learns_from_is_a_shift_not_a_spike(tau: float, read: set[int]) -> None:
    # Fast relearning is read after `decide` (16) losses; a slow one the trend cannot resolve
    # yet (-3 < t <= -1) keeps the reading open until it can, before a divergence could fire.
    losses = shift_series(tau=tau)
    grads = calm_grads(losses)
    assert active(run(LossSpikeDetector(), losses, grads)) == []
    assert active(run(LossSpikeDetector(report="divergence"), losses, grads)) == []
    shift = run(LossSpikeDetector(report="shift"), losses, grads)
    assert len(active(shift)) == 1 and active(shift)[0] in read
    ev = shift[active(shift)[0]].evidence
    assert ev["spike_step"] == AT + 1 and ev["trend_t"] <= -3.0 and ev["grad_trend_t"] < 3.0
    assert "mon.data_changed()" in shift[active(shift)[0]].summary


def test_after_a_shift_the_new_level_is_the_reference() -> None:
    losses = np.concatenate([shift_series(), noisy(300, level=0.6, sigma=0.1, seed=3)])
    losses[700:710] *= 5.0  # a real spike on the new data
    found = run(LossSpikeDetector(), losses, calm_grads(losses))
    assert active(found) == [712]


def test_a_shift_with_a_growing_gradient_is_not_a_shift() -> None:
    losses = shift_series()
    grads = calm_grads(losses)
    grads[AT:] = grads[AT] * 1.15 ** np.arange(grads.size - AT)  # gradient norm growing
    assert active(run(LossSpikeDetector(report="shift"), losses, grads)) == []
    found = run(LossSpikeDetector(), losses, grads)
    assert active(found)[0] <= AT + 15


def test_a_jump_with_the_learning_rate_raised_pages_at_once() -> None:
    losses = shift_series()
    lrs = [1e-3 if i < AT - 1 else 1e-2 for i in range(losses.size)]  # raised a step before
    found = run(LossSpikeDetector(), losses, calm_grads(losses), lrs)
    assert active(found)[0] == AT + 2  # the third loss up
    assert "learning rate" in found[AT + 2].summary and found[AT + 2].evidence["cause"]
    assert active(run(LossSpikeDetector(report="shift"), losses, calm_grads(losses), lrs)) == []


def test_a_gradient_outgrowing_the_loss_pages_at_once() -> None:
    losses = noisy(400, level=0.6, sigma=0.1)
    losses[AT:] *= 2.5  # a modest jump ...
    grads = noisy(400, level=0.5, sigma=0.2, seed=1)
    grads[AT:] *= 30.0  # ... with the gradient norm up 30x: a Jacobian that grew
    found = run(LossSpikeDetector(), losses, grads)
    assert active(found)[0] == AT + 2
    assert "gradient norm up" in found[AT + 2].evidence["cause"]


# ---------------------------------------------------------------- inputs


def test_nan_and_missing_losses_are_no_observation() -> None:
    # A step without a (finite) loss gives no verdict: `for:` counts losses, not steps.
    det = LossSpikeDetector()
    run(det, spike_series(n=AT + 5, length=200))
    assert det.observe(Step(job="j", step=AT + 6, time=0.0, loss=math.nan)) is None
    assert det.observe(Step(job="j", step=AT + 7, time=0.0)) is None
    assert det._episode is not None and det._episode.seen == 5


def test_negative_losses_are_judged_in_linear_space() -> None:
    losses = -5.0 + np.random.default_rng(1).normal(0.0, 0.05, 300)
    losses[250:260] += 3.0
    found = run(LossSpikeDetector(), losses)
    assert active(found) == [262] and found[262].evidence["space"] == "linear"


def test_a_new_level_is_accepted_after_rebase_after() -> None:
    losses = np.concatenate([noisy(100), noisy(300, level=5.0, seed=2)])
    found = run(LossSpikeDetector(rebase_after=100), losses)
    assert found[150].active and not found[-1].active


def test_spike_params_are_checked() -> None:
    with pytest.raises(ValueError, match="min_history"):
        LossSpikeDetector(window=32, min_history=64)
    with pytest.raises(ValueError, match="decide"):
        LossSpikeDetector(decide=60, diverge_after=50)
    with pytest.raises(ValidationError):
        # A bad value on purpose: validation must refuse it.
        LossSpikeDetector(report="both")  # type: ignore[arg-type]
