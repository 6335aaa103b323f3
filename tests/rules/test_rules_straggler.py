"""Stragglers and the rank a hung collective waits for."""

from __future__ import annotations

from dataclasses import dataclass

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.liveness import StalledDetector, StragglerDetector
from gradwatch.rules.step import Liveness


def live(
    rank: int,
    *,
    busy: float | None = None,
    data: float | None = None,
    step_seconds: float | None = 1.0,
    now: float = 1000.0,
    last_step: int = 50,
    step_time: float = 999.0,
    started: int | None = None,
) -> Liveness:
    return Liveness(
        job="j",
        rank=rank,
        now=now,
        last_step=last_step,
        last_step_time=step_time,
        last_heartbeat_time=now,
        step_seconds=step_seconds,
        started=started,
        data_seconds=data,
        busy_seconds=busy,
    )


def test_a_rank_busy_much_longer_before_the_sync_is_named() -> None:
    det = StragglerDetector()
    # Synchronous ranks: the same step time, but rank 5 spends 0.5 s before the sync.
    ranks = [live(r, busy=0.5 if r == 5 else 0.1) for r in range(8)]
    found = det.observe_liveness(ranks)
    assert found.active and found.rank == 5
    assert found.evidence["measure"] == "busy_seconds"
    assert (found.evidence["seconds"], found.evidence["typical_seconds"]) == (0.5, 0.1)
    assert found.evidence["slow_ranks"] == [5] and "rank 5 is a straggler" in found.summary


def test_under_fsdp_a_slow_data_loader_shows_in_data_time_only() -> None:
    # FSDP's forward all-gathers make the fast ranks wait inside their forward, so
    # data + forward is the same everywhere; the wait for data is not.
    ranks = [live(r, data=0.4 if r == 2 else 0.001, busy=0.45) for r in range(4)]
    found = StragglerDetector().observe_liveness(ranks)
    assert found.active and found.rank == 2 and found.evidence["measure"] == "data_seconds"
    assert "waiting for data" in found.summary


def test_under_ddp_a_slow_compute_rank_shows_in_data_plus_forward() -> None:
    ranks = [live(r, data=0.001, busy=0.6 if r == 1 else 0.2) for r in range(4)]
    found = StragglerDetector().observe_liveness(ranks)
    assert found.active and found.rank == 1 and found.evidence["measure"] == "busy_seconds"


def test_two_ranks_compare_with_the_other() -> None:
    found = StragglerDetector().observe_liveness([live(0, busy=0.01), live(1, busy=0.31)])
    assert found.active and found.rank == 1 and found.evidence["typical_seconds"] == 0.01


def test_small_or_uniform_differences_do_not_fire() -> None:
    det = StragglerDetector(factor=2.0, min_excess_seconds=0.1)
    assert not det.observe_liveness([live(r, busy=0.2) for r in range(4)]).active
    # Twice as slow, but only 20 ms more: noise at this scale.
    assert not det.observe_liveness(
        [live(0, busy=0.02), live(1, busy=0.02), live(2, busy=0.04)]
    ).active
    assert not det.observe_liveness([live(0, busy=5.0)]).active  # one rank: nothing to compare


def test_without_agent_timings_step_times_are_compared() -> None:
    ranks = [live(r, step_seconds=3.0 if r == 2 else 1.0) for r in range(4)]
    found = StragglerDetector().observe_liveness(ranks)
    assert found.active and found.rank == 2 and found.evidence["measure"] == "step_seconds"


def test_hung_collective_names_the_rank_that_did_not_start_the_next_step() -> None:
    det = StalledDetector(min_seconds=10.0)
    # All at step 40; ranks 0, 2, 3 began step 41 and wait in its all-reduce; rank 1 did not.
    # Rank 1 logged step 40 last (latest time), so time alone would not pick it.
    ranks = [
        live(
            r,
            last_step=40,
            step_time=900.0 + (5 if r == 1 else 0),
            busy=0.1,
            started=40 if r == 1 else 41,
        )
        for r in range(4)
    ]
    found = det.observe_liveness(ranks)
    assert found.active and found.rank == 1
    assert found.evidence["waiting_ranks"] == [0, 2, 3]
    assert "has not started step 41 while 3 rank(s) already wait in it" in found.summary


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def test_default_rule_fires_after_a_minute_of_straggling_and_resolves() -> None:
    clock = Clock()
    engine = Engine(load_default_rules(), clock=clock)
    events = []
    for t in range(0, 75, 1):
        clock.now = float(t)
        ranks = [
            live(r, now=float(t), step_time=float(t), busy=0.45 if r == 3 else 0.15)
            for r in range(4)
        ]
        events += [(t, e.alert.rule, e.current, e.alert.rank) for e in engine.tick(ranks)]
    fired = [e for e in events if e[2] == "firing"]
    assert [(rule, rank) for _, rule, _, rank in fired] == [("RankStraggling", 3)]
    assert 60 <= fired[0][0] <= 61  # "for: 60s"
    clock.now = 80.0
    healed = engine.tick([live(r, now=80.0, step_time=80.0, busy=0.15) for r in range(4)])
    assert [(e.alert.rule, e.current) for e in healed] == [("RankStraggling", "resolved")]


def test_replay_of_a_recorded_trace_finds_the_straggler(tmp_path) -> None:
    import numpy as np

    from gradwatch.collector.recorder import TraceRecorder
    from gradwatch.rules.replay import replay
    from gradwatch.rules.step import Step

    recorder = TraceRecorder(tmp_path)
    for n in range(1, 91):  # 90 s at one step per second: past the rule's "for: 60s"
        for r in range(3):
            recorder.step(
                Step(
                    job="j",
                    step=n,
                    time=float(n),
                    rank=r,
                    loss=1.0,
                    layers=("w",),
                    layer_norms=np.array([1.0]),
                    world=3,
                    shards=3,
                    scalars={"data_seconds": 0.4 if r == 2 else 0.05, "forward_seconds": 0.01},
                )
            )
    recorder.close()
    (trace,) = tmp_path.glob("*.jsonl")
    fired = [t.alert for t in replay(trace) if t.current == "firing"]
    assert [(a.rule, a.rank) for a in fired] == [("RankStraggling", 2)]
