"""Engine routing: each detector gets the inputs it implements; None leaves the lifecycle alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import numpy as np
import pytest
from pydantic import Field

from gradwatch.rules import Engine, RuleSpec, Step, load_default_rules
from gradwatch.rules.detector import INACTIVE, Detector, Finding, inputs_of, validated_params
from gradwatch.rules.registry import register_detector
from gradwatch.rules.step import Eval, Liveness, Stats
from gradwatch.rules.testing import Synth, feed_all


class StatsOnly:
    @validated_params
    def __init__(self, *, limit: Annotated[int, Field(ge=0)] = 2) -> None:
        self.limit = limit
        self.seen: list[int] = []

    def observe_stats(self, stats: Stats) -> Finding | None:
        self.seen.append(stats.step)
        if stats.weight_norms is None:
            return None
        return Finding(True, "big") if len(self.seen) > self.limit else INACTIVE


class Mixed:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def observe(self, step: Step) -> None:
        self.calls.append("step")

    def observe_eval(self, ev: Eval) -> Finding:
        self.calls.append("eval")
        return Finding(ev.loss is not None and ev.loss > 1.0, "val high")


class Nothing:
    pass


class PerJob:
    def observe_liveness(self, liveness: Sequence[Liveness]) -> Finding:
        worst = max(liveness, key=lambda live: live.now - live.last_step_time)
        return Finding(
            worst.now - worst.last_step_time > 10,
            "slow",
            {"last_step": worst.last_step},
            rank=worst.rank,
        )


register_detector("test_stats_only", StatsOnly)
register_detector("test_mixed", Mixed)
register_detector("test_nothing", Nothing)
register_detector("test_per_job", PerJob)


def spec(name: str, detector: str, category: str = "weight_runaway") -> RuleSpec:
    # `category` is a plain str; the tests pass valid categories.
    return RuleSpec(name=name, detector=detector, severity="warning", category=category)  # type: ignore[arg-type]


def test_inputs_of_and_the_detector_union() -> None:
    assert inputs_of(StatsOnly()) == {"observe_stats"}
    assert inputs_of(Mixed()) == {"observe", "observe_eval"}
    assert inputs_of(Nothing()) == frozenset()
    assert isinstance(StatsOnly(), Detector) and isinstance(PerJob(), Detector)
    assert not isinstance(Nothing(), Detector)


def test_routing_by_input_and_none_means_no_verdict() -> None:
    engine = Engine(
        [spec("S", "test_stats_only"), spec("M", "test_mixed", "generalization_gap")],
        clock=lambda: 0.0,
    )
    assert engine.observe(Step(job="j", step=1, time=0.0, loss=1.0)) == []
    assert engine.observe_stats(Stats(job="j", step=1, time=0.0)) == []  # None: lifecycle untouched
    assert engine.observe_stats(Stats(job="j", step=2, time=0.0, weight_norms=None)) == []
    fired = engine.observe_stats(Stats(job="j", step=3, time=0.0, weight_norms=np.ones(2)))
    assert [(t.alert.rule, t.current, t.alert.step) for t in fired] == [("S", "firing", 3)]
    fired = engine.feed(Eval(job="j", step=4, time=0.0, loss=2.0))
    assert [(t.alert.rule, t.current) for t in fired] == [("M", "firing")]


def test_liveness_detectors_are_per_job_and_alerts_take_the_named_rank() -> None:
    engine = Engine([spec("L", "test_per_job", "stalled")], clock=lambda: 5.0)
    assert engine.observe(Step(job="j", step=1, time=0.0)) == []  # no step input: nothing to do
    lives = [
        Liveness(
            job="j",
            rank=r,
            now=100.0,
            last_step=50 - r,
            last_step_time=100.0 - 20 * r,
            last_heartbeat_time=100.0,
        )
        for r in range(3)
    ]
    events = engine.tick(lives)
    assert [(e.alert.rule, e.alert.rank, e.alert.step, e.alert.started_at) for e in events] == [
        ("L", 2, 48, 5.0)
    ]
    assert engine.tick(lives) == []  # deduplicated


def test_a_detector_without_inputs_is_refused() -> None:
    with pytest.raises(ValueError, match="implements no input"):
        Engine([spec("N", "test_nothing")])


def test_feed_refuses_other_records() -> None:
    with pytest.raises(TypeError, match="Step, Stats, Eval or AgentNotice"):
        # A wrong record type on purpose: feed must refuse it.
        Engine([]).feed("step")  # type: ignore[arg-type]


def test_long_runs_keep_every_state_bounded() -> None:
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    feed_all(engine, Synth(steps=4000, amp=True, stats_every=10, eval_every=20).records())
    history = engine.history("run")
    assert history is not None
    assert (
        len(history.losses) == history.losses.maxlen and len(history.norms) == history.norms.maxlen
    )
    assert len(history.head) == history.head_size and len(history.evals) == 200
    assert (
        len(history.weight_norms) == history.weight_norms.maxlen and len(history.precursors) <= 10
    )
    for slot in engine._ranks[("run", 0)].all:
        det = slot.detector
        for name in (
            "_tail",
            "_window",
            "_norms",
            "_losses",
            "_skips",
            "_logs",
            "_vals",
            "_train",
            "_kept",
        ):
            part = getattr(det, name, None)
            if part is not None:
                assert len(part) <= 1024, (type(det).__name__, name)
