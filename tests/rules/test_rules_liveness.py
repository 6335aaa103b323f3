"""Liveness: per-job detectors fed by Engine.tick, alerts naming the bad rank."""

from __future__ import annotations

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.liveness import LivenessTracker, SilentRankDetector, StalledDetector
from gradwatch.rules.step import Liveness


def live(
    rank: int,
    now: float,
    last_step: int,
    step_time: float,
    beat: float,
    step_seconds: float | None = 1.0,
    job: str = "j",
) -> Liveness:
    return Liveness(
        job=job,
        rank=rank,
        now=now,
        last_step=last_step,
        last_step_time=step_time,
        last_heartbeat_time=beat,
        step_seconds=step_seconds,
    )


def test_stalled_needs_heartbeats_and_names_the_rank_behind() -> None:
    det = StalledDetector()
    now = 1000.0
    healthy = [live(r, now, 500, now - 1.0, now - 1.0) for r in range(4)]
    assert not det.observe_liveness(healthy).active
    hung = [
        live(0, now, 500, now - 400, now - 1),
        live(1, now, 499, now - 401, now - 1),
        live(2, now, 500, now - 400, now - 2),
        live(3, now, 500, now - 400, now - 50),
    ]
    found = det.observe_liveness(hung)
    assert found.active and found.rank == 1
    assert found.evidence["stalled_ranks"] == [0, 1, 2]  # rank 3's heartbeats stopped: not "alive"
    assert found.evidence["seconds_since_step"] == 401


def test_stall_limit_scales_with_step_time_and_has_a_floor() -> None:
    det = StalledDetector(factor=20.0, min_seconds=300.0)
    assert det.limit(live(0, 0, 0, 0, 0, step_seconds=60.0)) == 1200.0
    assert det.limit(live(0, 0, 0, 0, 0, step_seconds=0.2)) == 300.0
    assert det.limit(live(0, 0, 0, 0, 0, step_seconds=None)) == 300.0
    slow = [live(0, 1000.0, 7, 100.0, 999.0, step_seconds=60.0)]  # 900 s < 20 x 60 s
    assert not det.observe_liveness(slow).active


def test_silent_rank_only_while_others_report() -> None:
    det = SilentRankDetector(silent_seconds=60.0)
    now = 500.0
    found = det.observe_liveness([live(0, now, 10, now, now), live(1, now, 8, now - 90, now - 90)])
    assert found.active and found.rank == 1 and found.evidence["seconds_silent"] == 90
    all_quiet = [live(0, now, 10, now - 90, now - 90), live(1, now, 8, now - 95, now - 95)]
    assert not det.observe_liveness(all_quiet).active  # a finished job, not a silent rank


def test_engine_tick_routes_per_job_and_the_alert_carries_the_bad_rank() -> None:
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    ok = [live(0, 10.0, 5, 9.0, 9.5, job="a"), live(1, 10.0, 5, 9.0, 9.5, job="a")]
    assert engine.tick(ok) == []
    silent = [
        live(0, 100.0, 80, 99.0, 99.5, job="a"),
        live(1, 100.0, 5, 9.0, 9.5, job="a"),
        live(0, 100.0, 3, 99.0, 99.5, job="b"),
    ]
    events = engine.tick(silent)
    assert [
        (e.alert.rule, e.alert.job, e.alert.rank, e.alert.category, e.alert.step) for e in events
    ] == [("RankSilent", "a", 1, "stalled", 5)]
    assert (
        events[0].alert.diagnosis is not None and events[0].alert.diagnosis["earlier_cause"] is None
    )
    back = [live(0, 101.0, 81, 101.0, 101.0, job="a"), live(1, 101.0, 6, 101.0, 101.0, job="a")]
    assert [(e.alert.rule, e.current) for e in engine.tick(back)] == [("RankSilent", "resolved")]
    assert engine.jobs() == ["a", "b"]


def test_forget_resolves_job_level_alerts() -> None:
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    engine.tick([live(0, 100.0, 80, 99.0, 99.5), live(1, 100.0, 5, 9.0, 9.5)])
    assert [a.rule for a in engine.firing()] == ["RankSilent"]
    assert [(t.alert.rule, t.current) for t in engine.forget("j")] == [("RankSilent", "resolved")]
    assert engine.firing() == [] and engine.jobs() == []


def test_tracker_builds_liveness_from_steps_and_heartbeats() -> None:
    tracker = LivenessTracker("j")
    for t in range(1, 11):
        tracker.step(rank=0, step=t, time=0.5 * t)
    tracker.heartbeat(rank=0, step=10, time=30.0)
    tracker.heartbeat(rank=1, step=0, time=29.0)
    zero, one = tracker.snapshot(now=31.0)
    assert (zero.last_step, zero.last_step_time, zero.last_heartbeat_time) == (10, 5.0, 30.0)
    assert zero.step_seconds == 0.5
    assert (one.rank, one.step_seconds, one.last_heartbeat_time) == (1, None, 29.0)


def test_a_stall_alert_names_the_stuck_step_not_the_last_completed_one() -> None:
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    now = 1000.0
    (event,) = engine.tick([live(0, now, 500, now - 400, now - 1)])
    assert event.alert.rule == "RankStalled" and event.alert.step == 501
    assert event.alert.evidence["last_step"] == 500
    assert "stuck in step 501 (last completed: 500)" in event.alert.summary
