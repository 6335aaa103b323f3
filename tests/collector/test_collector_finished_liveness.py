"""A finished job is not a stalled one: a rank's 'closed' note ends its liveness (issue 13)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradwatch.collector.state import StateStore
from gradwatch.rules.liveness import StalledDetector
from gradwatch.rules.step import Step
from gradwatch.wire import Event


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_closed_rank_is_never_judged_stalled_even_with_a_short_limit() -> None:
    clock = FakeClock()
    store = StateStore(clock=clock)
    det = StalledDetector(min_seconds=5.0)  # under the 30 s heartbeat timeout: the bug's setting
    for n in range(1, 21):
        clock.now += 0.1
        store.observe_step(
            Step(job="run-1", step=n, time=clock.now, layers=("a",), layer_norms=np.array([1.0]))
        )
    store.observe_event(
        Event(
            job="run-1",
            rank=0,
            incarnation="i",
            time=clock.now,
            kind="note",
            step=20,
            fields={"note": "closed"},
        )
    )
    for _ in range(25):  # the note is the newest message for the next 25 s
        clock.now += 1.0
        assert not det.observe_liveness(store.liveness()).active
    assert store.liveness() == []


def test_a_live_rank_that_stops_stepping_is_still_stalled() -> None:
    clock = FakeClock()
    store = StateStore(clock=clock)
    det = StalledDetector(min_seconds=5.0)
    for n in range(1, 21):
        clock.now += 0.1
        store.observe_step(
            Step(job="run-1", step=n, time=clock.now, layers=("a",), layer_norms=np.array([1.0]))
        )
    for _ in range(10):  # heartbeats (any message) keep coming, steps do not
        clock.now += 1.0
        store.observe_event(
            Event(
                job="run-1",
                rank=0,
                incarnation="i",
                time=clock.now,
                kind="note",
                step=20,
                fields={"note": "still here"},
            )
        )
    found = det.observe_liveness(store.liveness())
    assert found.active and found.evidence["stuck_step"] == 21 and found.evidence["last_step"] == 20
