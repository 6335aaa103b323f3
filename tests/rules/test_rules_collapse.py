"""A loss collapsed to exactly 0, and a learning rate collapsed long before the end of training."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.collapse import LrTooLowDetector, ZeroLossDetector
from gradwatch.rules.testing import feed_all

RULES = load_default_rules()


def losses(values: list[float], first: int = 1) -> list[Step]:
    return [Step(job="j", step=first + i, time=0.0, loss=v) for i, v in enumerate(values)]


# ---------------------------------------------------------------- zero loss


def test_a_loss_that_collapses_to_zero_and_stays_is_a_dead_pipeline() -> None:
    transitions = feed_all(
        Engine(RULES, clock=lambda: 0.0), losses([0.7, 0.3, 0.05, 0.001] + [0.0] * 20)
    )
    fired = [t.alert for t in transitions if t.current == "firing"]
    assert [(a.rule, a.category, a.severity, a.step) for a in fired] == [
        ("LossCollapsedToZero", "dead_pipeline", "warning", 7)
    ]
    assert fired[0].evidence["since_step"] == 5 and "+inf" not in fired[0].summary


def test_isolated_zeros_are_rounding_and_signed_losses_are_not_judged() -> None:
    det = ZeroLossDetector()
    rounded = [0.0003, 0.0, 0.0002, 0.0, 0.0, 0.0004] * 10  # a 4-decimal log of a converged loss
    assert not any(f is not None and f.active for f in map(det.observe, losses(rounded)))
    det = ZeroLossDetector()
    rl = [0.5, -0.2, 0.1] + [0.0] * 10  # an RL objective crossing zero
    assert not any(f is not None and f.active for f in map(det.observe, losses(rl)))
    assert ZeroLossDetector().observe(Step(job="j", step=1, time=0.0)) is None


# ---------------------------------------------------------------- learning rate collapsed


def lr_run(lr_at: object, n: int = 1000, seed: int = 0, stall_below: float = 1e-6) -> list[Step]:
    """Loss learns at a speed proportional to the lr (stalls once it is below ``stall_below``)."""
    rng = np.random.default_rng(seed)
    level, out = 2.3, []
    for t in range(1, n + 1):
        # `lr_at` is typed object so tests may pass any callable.
        lr = lr_at(t)  # type: ignore[operator]
        if lr >= stall_below:
            level = 0.3 + (level - 0.3) * (1 - 0.01 * min(1.0, lr / 1e-3))
        out.append(
            Step(job="j", step=t, time=0.0, loss=level * float(rng.lognormal(0.0, 0.05)), lr=(lr,))
        )
    return out


def test_a_scheduler_stepped_per_batch_is_caught() -> None:
    # StepLR(step_size=30, gamma=0.1) meant per epoch, stepped per batch: 1e-3 -> 1e-7 by step 120.
    steps = lr_run(lambda t: 1e-3 * 0.1 ** (t // 30))
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), steps)
    fired = [t.alert for t in transitions if t.current == "firing"]
    assert [(a.rule, a.category, a.severity) for a in fired] == [
        ("LearningRateCollapsed", "lr_too_low", "warning")
    ]
    ev = fired[0].evidence
    assert (
        ev["since_step"] in (120, 150)
        and ev["peak_lr"] == 1e-3
        and fired[0].step <= ev["since_step"] + 40
    )
    assert "per batch instead of per epoch" in fired[0].summary


@pytest.mark.parametrize("schedule", ["cosine", "linear", "imagenet_steps", "exponential"])
def test_planned_decays_are_not_a_collapse(schedule: str) -> None:
    n = 3000
    lr_at = {
        "cosine": lambda t: 1e-3 * 0.5 * (1 + math.cos(math.pi * t / n)),
        "linear": lambda t: 1e-3 * (1 - t / n),
        "imagenet_steps": lambda t: (
            1e-1 * 0.1 ** min(3, (t * 100 // n) // 30)
        ),  # /10 at epochs 30, 60, 90
        "exponential": lambda t: 1e-3 * 0.999**t,  # ends at 5e-2 of its peak
    }[schedule]
    det = LrTooLowDetector()
    found = [det.observe(s) for s in lr_run(lr_at, n=n)]
    assert not any(f is not None and f.active for f in found)


def test_a_run_still_learning_at_a_low_rate_is_not_too_low() -> None:
    # Collapsed lr, but the loss keeps falling: the rate is low, not too low.
    det = LrTooLowDetector()
    steps = lr_run(lambda t: 1e-3 if t < 100 else 1e-8, n=600, stall_below=0.0)
    steps = [
        Step(job="j", step=s.step, time=0.0, loss=3.0 * math.exp(-s.step / 100), lr=s.lr)
        for s in steps
    ]
    assert not any(f is not None and f.active for f in map(det.observe, steps))


def test_steps_without_an_lr_give_no_verdict_and_zero_is_optimizer_idle() -> None:
    det = LrTooLowDetector()
    assert det.observe(Step(job="j", step=1, time=0.0, loss=1.0)) is None
    assert det.observe(Step(job="j", step=2, time=0.0, loss=1.0, lr=(0.0, 0.0))) is None
