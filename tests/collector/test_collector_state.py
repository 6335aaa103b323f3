"""Job state: bounded ring buffers, latest values, checkpoints, TTL forgetting."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from gradwatch.collector.state import STEP_INTERVALS, StateStore
from gradwatch.rules import Alert, Transition
from gradwatch.rules.step import Step
from gradwatch.wire import Event, Heartbeat


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def step(
    n: int,
    *,
    job: str = "run-1",
    rank: int = 0,
    loss: float | None = 1.0,
    grad_norm: float | None = 2.0,
    norms: tuple[float, ...] = (1.0, 2.0),
) -> Step:
    return Step(
        job=job,
        step=n,
        time=float(n),
        rank=rank,
        loss=loss,
        grad_norm=grad_norm,
        layers=("a", "b")[: len(norms)],
        layer_norms=np.array(norms),
        lr=(0.1,),
    )


def alert(state: str = "firing", job: str = "run-1") -> Alert:
    return Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job=job,
        state=state,
        step=3,
        summary="nan",
        started_at=0.0,
    )  # type: ignore[arg-type]  # the helper takes a plain str; callers pass valid literal values


def test_per_rank_state_keeps_no_step_history() -> None:
    # Memory at scale: a rank holds its latest step and bounded timings, whatever the run length.
    store = StateStore(clock=FakeClock())
    for n in range(1, 200):
        store.observe_step(replace(step(n), scalars={"data_seconds": 0.5, "forward_seconds": 0.25}))
    # The job was just fed steps, so it exists.
    rank = store.job("run-1").ranks[0]  # type: ignore[union-attr]
    assert not hasattr(rank, "history")
    assert rank.last_step == 199
    assert len(rank.phases.busy) == STEP_INTERVALS and set(rank.phases.busy) == {0.75}
    (live,) = store.liveness()
    assert live.busy_seconds == 0.75


def test_heartbeat_started_reaches_liveness() -> None:
    store = StateStore(clock=FakeClock())
    store.observe_step(step(4))
    store.observe_heartbeat(
        Heartbeat(
            job="run-1", rank=0, world=1, incarnation="i", time=0.0, step=4, dropped=0, started=5
        )
    )
    (live,) = store.liveness()
    assert (live.last_step, live.started) == (4, 5)


def test_assembled_step_drives_the_job_view() -> None:
    store = StateStore(clock=FakeClock())
    store.observe_step(replace(step(3, loss=1.0, norms=(3.0, 4.0)), world=2, shards=2))
    store.observe_step(replace(step(3, rank=1, loss=3.0, norms=(4.0, 3.0)), world=2, shards=2))
    store.observe_assembled(
        replace(
            step(3, loss=2.0, grad_norm=50**0.5, norms=(5.0, 5.0)), world=2, shards=2, assembled=2
        )
    )
    (view,) = store.snapshot()
    assert view.assembled and view.world == 2 and view.ranks == 2
    assert (view.loss, view.layer_norms.tolist()) == (2.0, [5.0, 5.0])


def test_latest_values_skip_unmeasured_and_out_of_order_steps() -> None:
    store = StateStore(clock=FakeClock())
    store.observe_step(step(5, loss=3.0, grad_norm=4.0))
    store.observe_step(step(6, loss=None, grad_norm=None))
    store.observe_step(step(4, loss=9.0))  # a late batch does not move "latest" back
    (view,) = store.snapshot()
    assert view.step == 6
    assert view.loss == 9.0  # last *reported* loss, in arrival order
    assert view.lr == (0.1,)


def test_job_view_combines_ranks() -> None:
    store = StateStore(clock=FakeClock())
    store.observe_step(step(10, rank=1, loss=5.0, norms=(float("nan"), 1.0)))
    store.observe_step(step(9, rank=0, loss=2.0, norms=(1.0, float("inf"))))
    (view,) = store.snapshot()
    assert (view.step, view.loss, view.ranks, view.nonfinite_layers) == (10, 2.0, 2, 2)


def test_heartbeats_and_checkpoints() -> None:
    clock = FakeClock()
    store = StateStore(clock=clock)
    store.observe_heartbeat(Heartbeat("run-1", 2, 4, "inc", 5.0, 17, 0))
    for n in (100, 200, 300):
        store.observe_event(Event("run-1", 0, "inc", 0.0, "checkpoint", n, {"path": f"c/{n}"}))
    store.observe_event(Event("run-1", 0, "inc", 0.0, "eval", 300, {"loss": 1.5}))
    job = store.job("run-1")
    assert job is not None
    assert job.ranks[2].heartbeat_step == 17 and job.ranks[2].heartbeat_time == clock.now
    # A checkpoint before 250 was recorded above.
    assert job.last_checkpoint_before(250).path == "c/200"  # type: ignore[union-attr]
    assert job.last_checkpoint_before(100) is None
    assert len(job.evals) == 1


def test_silent_jobs_are_forgotten_after_the_ttl() -> None:
    clock = FakeClock(0.0)
    store = StateStore(job_ttl_seconds=600, clock=clock)
    store.observe_step(step(1, job="old"))
    clock.now = 500.0
    store.observe_step(step(1, job="live"))
    clock.now = 600.0
    assert store.expire() == []
    clock.now = 650.0
    assert store.expire() == ["old"]
    assert [v.job for v in store.snapshot()] == ["live"]
    assert store.job("old") is None


def test_alert_counts_only_transitions_into_firing() -> None:
    store = StateStore(clock=FakeClock())
    store.observe_step(step(1))
    store.record_transition(Transition(alert(), "pending", "firing"))
    store.record_transition(Transition(alert(), "firing", "firing"))
    store.record_transition(Transition(alert("resolved"), "firing", "resolved"))
    store.record_transition(Transition(alert(job="unknown"), "pending", "firing"))
    (view,) = store.snapshot()
    assert view.alerts_fired == {("NonFiniteGradients", "numerical", "critical"): 1}


def test_a_job_whose_agents_all_closed_is_forgotten_after_the_grace() -> None:
    clock = FakeClock()
    store = StateStore(job_ttl_seconds=600, clock=clock, finished_grace_seconds=60)
    for r in (0, 1):
        store.observe_step(step(5, rank=r))
    closed = Event(
        job="run-1",
        rank=0,
        incarnation="i",
        time=0.0,
        kind="note",
        step=5,
        fields={"note": "closed"},
    )
    store.observe_event(closed)
    clock.now += 61
    assert store.expire() == []  # rank 1 has not closed: still running (or crashed: TTL)
    store.observe_event(replace(closed, rank=1))
    clock.now += 30
    assert store.expire() == []  # within the grace: the final values can still be scraped
    clock.now += 31
    assert store.expire() == ["run-1"] and store.snapshot() == []


def test_a_rank_that_reports_after_closing_is_running_again() -> None:
    clock = FakeClock()
    store = StateStore(clock=clock, finished_grace_seconds=60)
    store.observe_event(
        Event(
            job="run-1",
            rank=0,
            incarnation="i",
            time=0.0,
            kind="note",
            step=5,
            fields={"note": "closed"},
        )
    )
    store.observe_step(step(6))  # a restarted process, same rank
    clock.now += 61
    assert store.expire() == []


def test_ingest_lag_is_the_age_of_a_batch_newest_row() -> None:
    clock = FakeClock(now=1010.0)
    store = StateStore(clock=clock)
    rows = [replace(step(n), time=1000.0 + n) for n in range(1, 10)]  # logged at 1001..1009
    for row in rows:
        store.observe_step(row)
    store.observe_lag(rows[-1])
    (view,) = store.snapshot()
    assert view.lag_seconds == 1.0  # not 9 s: the older rows waited in the agent's batch
