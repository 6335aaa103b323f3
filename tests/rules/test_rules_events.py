"""One-step extreme events: a corrupt batch is named at its step; heavy tails, AMP skips are not."""

from __future__ import annotations

import numpy as np
import pytest

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.events import ExtremeStepDetector
from gradwatch.rules.testing import feed_all

RULES = load_default_rules()


def run_steps(n: int = 600, seed: int = 0, corrupt: tuple[int, ...] = ()) -> list[Step]:
    """A healthy run (loss 2.3 -> ~0.5, heavy-tailed batches), corrupt batches at ``corrupt``."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(1, n + 1):
        loss = (0.5 + 1.8 / (1 + t / 50)) * float(rng.lognormal(0.0, 0.1))
        norm = float(rng.lognormal(0.0, 0.3))
        if rng.random() < 0.02:  # hard batches: up to 1.8x loss and 5x grad norm
            loss *= float(rng.uniform(1.2, 1.8))
            norm *= float(rng.uniform(2.0, 5.0))
        if t in corrupt:
            loss, norm = loss * 1000.0, norm * 700.0
        out.append(Step(job="j", step=t, time=float(t), loss=loss, grad_norm=norm, lr=(1e-3,)))
    return out


def test_a_corrupt_batch_is_a_loss_spike_warning_that_names_its_step() -> None:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), run_steps(corrupt=(400,)))
    fired = [t.alert for t in transitions if t.current == "firing"]
    assert [(a.rule, a.category, a.severity, a.step) for a in fired] == [
        ("LossExtremeStep", "loss_spike", "warning", 400)
    ]
    assert "skip the batch of step 400" in fired[0].summary
    assert (
        fired[0].evidence["signals"] == ["loss", "grad_norm"]
        and fired[0].evidence["loss_times_median"] > 100
    )
    # One event, one incident: it resolves at the next step.
    assert [(t.alert.rule, t.current) for t in transitions] == [
        ("LossExtremeStep", "firing"),
        ("LossExtremeStep", "resolved"),
    ]


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_heavy_tailed_run_has_no_events(seed: int) -> None:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), run_steps(n=3000, seed=seed))
    assert not [t.alert.summary for t in transitions if t.current == "firing"]


def test_repeated_events_escalate_to_critical() -> None:
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), run_steps(corrupt=(300, 350, 420)))
    fired = [
        (t.alert.rule, t.alert.severity, t.alert.step) for t in transitions if t.current == "firing"
    ]
    assert fired == [
        ("LossExtremeStep", "warning", 300),
        ("LossExtremeStep", "warning", 350),
        ("LossExtremeStep", "warning", 420),
        ("LossExtremeStepsRepeated", "critical", 420),
    ]


def test_one_signal_alone_is_enough_and_amp_skips_are_not_events() -> None:
    det = ExtremeStepDetector()
    steps = run_steps(n=100)
    for s in steps:
        det.observe(s)
    found = det.observe(Step(job="j", step=101, time=0.0, grad_norm=1e4))
    assert found is not None and found.active and found.evidence["signals"] == ["grad_norm"]
    skipped = Step(
        job="j",
        step=102,
        time=0.0,
        loss=1e6,
        grad_norm=float("inf"),
        skipped=True,
        loss_scale=2.0**15,
    )
    assert det.observe(skipped) is None
    assert det.observe(Step(job="j", step=103, time=0.0)) is None  # neither signal: no verdict


def test_the_window_is_the_runs_own() -> None:
    # A loss that lives at 1e-4 with 10x noise swings: 100x its median and 10x its max is still
    # the bar.
    det = ExtremeStepDetector(min_history=20)
    rng = np.random.default_rng(3)
    for t in range(1, 200):
        found = det.observe(
            Step(job="j", step=t, time=0.0, loss=1e-4 * float(rng.lognormal(0.0, 0.8)))
        )
        assert found is not None and not found.active
    with pytest.raises(ValueError, match="min_history"):
        ExtremeStepDetector(window=16, min_history=20)


def test_logged_pre_clip_norms_and_clipped_norms_are_separate_signals() -> None:
    # The live HF path: every step carries the clipped norm the optimizer saw; logging steps
    # carry the Trainer's pre-clip norm. A pre-clip 50 among clipped ~0.5 norms is no event.
    det = ExtremeStepDetector()
    rng = np.random.default_rng(0)
    for t in range(1, 400):
        logged = t % 50 == 0  # logging_steps 50: the first logged norm meets 49 clipped ones
        norm = (
            50.0 * float(rng.lognormal(0.0, 0.3))
            if logged
            else min(1.0, 0.5 * float(rng.lognormal(0.0, 0.3)))
        )
        found = det.observe(
            Step(job="j", step=t, time=0.0, grad_norm=norm, grad_norm_logged=logged)
        )
        assert found is not None and not found.active, t


def test_a_run_whose_losses_reach_100x_their_median_routinely_has_no_event() -> None:
    # A CNN on batches of 4 near convergence (benchmarks/healthy_patterns.py style): the
    # median loss ~0.003, a batch at 0.41 (144x it, 14x the last 50's max) while the same
    # run reached 1.0 600 steps before; it paged LossExtremeStep at step 1462.
    rng = np.random.default_rng(0)
    levels = [0.05] * 300 + [0.003] * 600  # learning, then near convergence
    losses = [level * float(rng.lognormal(0.0, 0.3)) for level in levels]
    losses[200] = 1.0  # the run's own excursion, 20x its median then: no event
    losses[800] = 0.41
    losses_with_corrupt = list(losses) + [0.003] * 60 + [5.0]  # above everything: an event

    def events(history: int, values: list[float]) -> list[int]:
        det = ExtremeStepDetector(history=history)
        found = [
            det.observe(Step(job="j", step=t, time=float(t), loss=v)) for t, v in enumerate(values)
        ]
        return [t for t, f in enumerate(found) if f is not None and f.active]

    assert events(0, losses) == [800]  # the window alone reads 0.41 as an event
    assert events(1000, losses) == []  # below the run's own 1.0, 600 steps before
    assert events(1000, losses_with_corrupt) == [960]  # a corrupt batch still pages
