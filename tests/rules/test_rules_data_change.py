"""An announced data change re-baselines the rules; an unannounced one is a note, not a page."""

from __future__ import annotations

import json
import math

import numpy as np

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.alert import Transition
from gradwatch.rules.replay import replay
from gradwatch.rules.step import Step

RULES = load_default_rules()
SWITCH = 300


def task_switch(steps: int = 600, seed: int = 0) -> list[Step]:
    """A noisy loss decaying towards 0.3, then a new task at SWITCH: the loss jumps to 2.0
    and decays again (the run learns the new task). Healthy; in its first steps the jump
    looks like a spike that stays."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(1, steps + 1):
        since = t - 1 if t < SWITCH else t - SWITCH
        start = 1.4 if t < SWITCH else 2.0
        loss = (0.3 + (start - 0.3) * math.exp(-since / 60)) * math.exp(rng.normal(0, 0.03))
        out.append(
            Step(
                job="switch", step=t, time=float(t), loss=loss, grad_norm=1.0 + 0.01 * t, lr=(1e-3,)
            )
        )
    return out


def fired(engine: Engine, steps: list[Step]) -> list[str]:
    return [t.alert.rule for s in steps for t in engine.observe(s) if t.current == "firing"]


def notes_and_pages(transitions: list[Transition]) -> tuple[list[str], list[str]]:
    firing = [t.alert for t in transitions if t.current == "firing"]
    return (
        [a.rule for a in firing if a.severity == "info"],
        [a.rule for a in firing if a.severity != "info"],
    )


def test_an_unannounced_task_switch_is_a_note_not_a_page() -> None:
    engine = Engine(RULES, clock=lambda: 0.0)
    transitions = [t for s in task_switch() for t in engine.observe(s)]
    assert notes_and_pages(transitions) == (["LossLevelShift"], [])
    note = next(t.alert for t in transitions if t.alert.rule == "LossLevelShift")
    assert note.evidence["spike_step"] == SWITCH and "mon.data_changed()" in note.summary


def test_an_unannounced_jump_that_stays_still_pages() -> None:
    stays = [
        Step(
            job=s.job,
            step=s.step,
            time=s.time,
            loss=s.loss if s.step < SWITCH else 2.0,
            grad_norm=s.grad_norm,
            lr=s.lr,
        )
        for s in task_switch()
    ]
    engine = Engine(RULES, clock=lambda: 0.0)
    pages = notes_and_pages([t for s in stays for t in engine.observe(s)])[1]
    assert "LossSpike" in pages and "LossDiverging" in pages


def test_an_announced_task_switch_raises_nothing() -> None:
    engine = Engine(RULES, clock=lambda: 0.0)
    engine.data_changed("switch", SWITCH)
    assert fired(engine, task_switch()) == []


def test_a_real_spike_after_an_announced_change_still_fires() -> None:
    steps = task_switch(900)
    spiked = [
        s
        if not 700 <= s.step < 720
        else Step(
            job=s.job, step=s.step, time=s.time, loss=s.loss * 20, grad_norm=s.grad_norm, lr=s.lr
        )
        for s in steps
    ]
    engine = Engine(RULES, clock=lambda: 0.0)
    engine.data_changed("switch", SWITCH)
    assert "LossSpike" in fired(engine, spiked)


def test_rows_of_the_old_data_arriving_late_do_not_reset_twice() -> None:
    # The announcement arrives before rows < SWITCH that were still buffered on the agent.
    engine = Engine(RULES, clock=lambda: 0.0)
    steps = task_switch()
    before = fired(engine, steps[:250])
    engine.data_changed("switch", SWITCH)
    assert before + fired(engine, steps[250:]) == []


def test_replay_applies_data_change_events_from_the_trace(tmp_path) -> None:
    lines = [
        json.dumps(
            {
                "type": "header",
                "format": "gradwatch.trace",
                "version": 1,
                "job": "switch",
                "layers": [],
            }
        )
    ]
    for s in task_switch():
        if s.step == SWITCH:
            lines.append(
                json.dumps(
                    {"type": "event", "step": SWITCH, "kind": "data_change", "note": "new task"}
                )
            )
        lines.append(
            json.dumps(
                {
                    "type": "step",
                    "step": s.step,
                    "time": s.time,
                    "loss": s.loss,
                    "grad_norm": s.grad_norm,
                    "lr": list(s.lr),
                }
            )
        )
    announced = replay(lines)
    unannounced = replay([line for line in lines if "data_change" not in line])
    assert [t.alert.rule for t in announced if t.current == "firing"] == []
    assert notes_and_pages(unannounced) == (["LossLevelShift"], [])
