"""Exposition: exact Prometheus text for a small fixed state, rendered at scrape time."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from gradwatch.collector.assembly_metrics import AssemblyMetrics
from gradwatch.collector.exposition import GradwatchCollector
from gradwatch.collector.ingest import IngestStats
from gradwatch.collector.sinks import SinkStats
from gradwatch.collector.state import StateStore
from gradwatch.rules import Alert, Transition
from gradwatch.rules.assembly import Assembler
from gradwatch.rules.step import ActStats, Eval, Stats, Step

NOW = 1_700_000_000.0


class FakeSink:
    name = "webhook-0"

    def start(self) -> None: ...

    def notify(self, transition: Any) -> None: ...

    def close(self, timeout: float) -> None: ...

    def alive(self) -> bool:
        return True

    def stats(self) -> SinkStats:
        return SinkStats(delivered=3, failed=1, dropped=0, retries=2, queued=1)


def nan_alert(rank: int) -> Alert:
    return Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job="run-1",
        state="firing",
        step=12,
        summary="nan",
        started_at=NOW,
        rank=rank,
    )


def fixed_state() -> StateStore:
    store = StateStore(clock=lambda: NOW)
    store.observe_step(
        Step(
            job="run-1",
            step=12,
            time=NOW,
            rank=0,
            loss=2.5,
            grad_norm=5.0,
            layers=("a", "b", "c", "d"),
            layer_norms=np.array([3.0, np.nan, 4.0, 0.5]),
            lr=(0.1, 0.01),
            loss_scale=1024.0,
        )
    )
    store.observe_step(Step(job="run-1", step=13, time=NOW, rank=1, loss=2.75))
    store.observe_lag(Step(job="run-1", step=13, time=NOW, rank=1))  # handled at once: lag 0
    store.observe_eval(Eval(job="run-1", step=12, time=NOW, rank=1, loss=3.0))
    store.observe_eval(Eval(job="run-1", step=12, time=NOW, rank=0, loss=float("nan")))  # kept out
    store.observe_stats(
        Stats(
            job="run-1",
            step=10,
            time=NOW,
            rank=0,
            act=(
                ActStats("act1", "relu", mean=0.1, std=0.2, zero_frac=0.5),
                ActStats("act2", "relu", mean=0.1, std=0.2, zero_frac=0.9),
                ActStats(
                    "act3", "relu", mean=0.1, std=0.2, zero_frac=0.7
                ),  # capped away: third of 3
                ActStats("tanh1", "tanh", mean=0.0, std=0.9, sat_frac=0.25),
            ),
        )
    )
    store.record_transition(Transition(nan_alert(0), "pending", "firing"))
    return store


INGEST = IngestStats(
    messages={"batch": 7, "event": 1, "heartbeat": 2},
    rejected={"malformed": 1, "oversized": 0, "unknown_schema": 2, "version": 0},
    agent_dropped={"run-1": 5},
    lost_batches={"run-1": 1},
)

EXPECTED = """\
# HELP gradwatch_build_info gradwatch build; value is always 1.
# TYPE gradwatch_build_info gauge
gradwatch_build_info{version="9.9.9"} 1.0
# HELP gradwatch_ingest_messages_total Valid wire messages received, by kind.
# TYPE gradwatch_ingest_messages_total counter
gradwatch_ingest_messages_total{kind="batch"} 7.0
gradwatch_ingest_messages_total{kind="event"} 1.0
gradwatch_ingest_messages_total{kind="heartbeat"} 2.0
# HELP gradwatch_ingest_rejected_total Messages dropped, by reason.
# TYPE gradwatch_ingest_rejected_total counter
gradwatch_ingest_rejected_total{reason="malformed"} 1.0
gradwatch_ingest_rejected_total{reason="oversized"} 0.0
gradwatch_ingest_rejected_total{reason="unknown_schema"} 2.0
gradwatch_ingest_rejected_total{reason="version"} 0.0
# HELP gradwatch_ingest_lost_batches_total Batches missing from an agent's sequence (lost in transit).
# TYPE gradwatch_ingest_lost_batches_total counter
gradwatch_ingest_lost_batches_total{training_job="run-1"} 1.0
# HELP gradwatch_agent_dropped_steps_total Steps agents report they could not ship (queue full, no collector).
# TYPE gradwatch_agent_dropped_steps_total counter
gradwatch_agent_dropped_steps_total{training_job="run-1"} 5.0
# HELP gradwatch_ingest_twin_agents_total Heartbeats of a rank taking turns with another live agent of the same job and rank (two processes training as one rank: give each its own rank= in watch()).
# TYPE gradwatch_ingest_twin_agents_total counter
gradwatch_ingest_twin_agents_total{training_job="run-1"} 0.0
# HELP gradwatch_job_step Latest step reported by any rank.
# TYPE gradwatch_job_step gauge
gradwatch_job_step{training_job="run-1"} 13.0
# HELP gradwatch_job_loss Latest training loss: the mean over ranks of a multi-rank job's assembled step, else the reporting rank's.
# TYPE gradwatch_job_loss gauge
gradwatch_job_loss{training_job="run-1"} 2.5
# HELP gradwatch_job_grad_norm Latest total gradient L2 norm (pre-clip when reported): assembled across ranks for a multi-rank job, else the reporting rank's.
# TYPE gradwatch_job_grad_norm gauge
gradwatch_job_grad_norm{training_job="run-1"} 5.0
# HELP gradwatch_job_learning_rate Latest learning rate per optimizer param group.
# TYPE gradwatch_job_learning_rate gauge
gradwatch_job_learning_rate{group="0",training_job="run-1"} 0.1
gradwatch_job_learning_rate{group="1",training_job="run-1"} 0.01
# HELP gradwatch_job_nonfinite_layers Layers whose latest gradient norm is NaN or Inf on any rank.
# TYPE gradwatch_job_nonfinite_layers gauge
gradwatch_job_nonfinite_layers{training_job="run-1"} 1.0
# HELP gradwatch_job_ranks Ranks heard from.
# TYPE gradwatch_job_ranks gauge
gradwatch_job_ranks{training_job="run-1"} 2.0
# HELP gradwatch_job_last_seen_timestamp_seconds Unix time the collector last heard from the job.
# TYPE gradwatch_job_last_seen_timestamp_seconds gauge
gradwatch_job_last_seen_timestamp_seconds{training_job="run-1"} 1.7e+09
# HELP gradwatch_job_eval_loss Latest validation loss (mon.log_eval).
# TYPE gradwatch_job_eval_loss gauge
gradwatch_job_eval_loss{training_job="run-1"} 3.0
# HELP gradwatch_job_loss_scale Latest AMP loss scale of the reporting rank.
# TYPE gradwatch_job_loss_scale gauge
gradwatch_job_loss_scale{training_job="run-1"} 1024.0
# HELP gradwatch_job_world_size Ranks in the job, as its agents declare it.
# TYPE gradwatch_job_world_size gauge
gradwatch_job_world_size{training_job="run-1"} 1.0
# HELP gradwatch_job_ingest_lag_seconds Largest, over the job's ranks, of the seconds from a rank logging its newest step (agent clock) to the collector handling it; batching adds up to one flush interval, more means the collector falls behind (or clocks disagree).
# TYPE gradwatch_job_ingest_lag_seconds gauge
gradwatch_job_ingest_lag_seconds{training_job="run-1"} 0.0
# HELP gradwatch_rank_last_seen_timestamp_seconds Unix time the collector last heard from each rank; when capped, only the max_rank_series ranks silent longest (gradwatch_job_ranks counts them all).
# TYPE gradwatch_rank_last_seen_timestamp_seconds gauge
gradwatch_rank_last_seen_timestamp_seconds{rank="0",training_job="run-1"} 1.7e+09
gradwatch_rank_last_seen_timestamp_seconds{rank="1",training_job="run-1"} 1.7e+09
# HELP gradwatch_job_oldest_rank_last_seen_timestamp_seconds Unix time the collector last heard from the job's most silent rank (time() minus this is the worst rank's silence).
# TYPE gradwatch_job_oldest_rank_last_seen_timestamp_seconds gauge
gradwatch_job_oldest_rank_last_seen_timestamp_seconds{training_job="run-1"} 1.7e+09
# HELP gradwatch_rank_series_capped 1 when the job has more ranks than max_rank_series and only the ranks silent longest are exposed.
# TYPE gradwatch_rank_series_capped gauge
gradwatch_rank_series_capped{training_job="run-1"} 0.0
# HELP gradwatch_job_first_last_grad_ratio Grad norm of the first module over the last at the job's latest step (<0.01 vanishing, >100 exploding by the default rules).
# TYPE gradwatch_job_first_last_grad_ratio gauge
# HELP gradwatch_block_grad_norm Gradient L2 norm of each block (layer names cut after their first numeric part) at the job's latest step (assembled across ranks, else the reporting rank): sqrt of the sum of its layers' squared norms (NaN or +Inf when one of them is); when capped, the top max_block_series offenders: non-finite first, then the largest norms.
# TYPE gradwatch_block_grad_norm gauge
gradwatch_block_grad_norm{block="a",training_job="run-1"} 3.0
gradwatch_block_grad_norm{block="b",training_job="run-1"} NaN
gradwatch_block_grad_norm{block="c",training_job="run-1"} 4.0
gradwatch_block_grad_norm{block="d",training_job="run-1"} 0.5
# HELP gradwatch_block_series_capped 1 when the job has more blocks than max_block_series and only the top offenders are exposed.
# TYPE gradwatch_block_series_capped gauge
gradwatch_block_series_capped{training_job="run-1"} 0.0
# HELP gradwatch_activation_saturated_fraction Share of tanh/sigmoid outputs pinned near their bounds, per module, at the latest cadence step (top modules per job).
# TYPE gradwatch_activation_saturated_fraction gauge
gradwatch_activation_saturated_fraction{kind="tanh",module="tanh1",training_job="run-1"} 0.25
# HELP gradwatch_activation_dead_fraction Share of exact-zero ReLU-family outputs, per module, at the latest cadence step (top modules per job).
# TYPE gradwatch_activation_dead_fraction gauge
gradwatch_activation_dead_fraction{kind="relu",module="act2",training_job="run-1"} 0.9
gradwatch_activation_dead_fraction{kind="relu",module="act3",training_job="run-1"} 0.7
# HELP gradwatch_alerts_firing Alerts firing now (one per incident, summed by labels).
# TYPE gradwatch_alerts_firing gauge
gradwatch_alerts_firing{category="numerical",rule="NonFiniteGradients",severity="critical",training_job="run-1"} 2.0
# HELP gradwatch_alerts_total Transitions of alerts into firing.
# TYPE gradwatch_alerts_total counter
gradwatch_alerts_total{category="numerical",rule="NonFiniteGradients",severity="critical",training_job="run-1"} 1.0
# HELP gradwatch_layer_grad_norm Gradient L2 norm of each layer at the job's latest step (assembled across ranks for a multi-rank job, else its reporting rank); when capped, the top max_layer_series offenders: non-finite first, then the largest norms.
# TYPE gradwatch_layer_grad_norm gauge
gradwatch_layer_grad_norm{layer="b",training_job="run-1"} NaN
gradwatch_layer_grad_norm{layer="c",training_job="run-1"} 4.0
# HELP gradwatch_layer_series_capped 1 when the job has more layers than max_layer_series and only the top offenders are exposed.
# TYPE gradwatch_layer_series_capped gauge
gradwatch_layer_series_capped{training_job="run-1"} 1.0
# HELP gradwatch_notifications_total Alert notifications by sink and final outcome.
# TYPE gradwatch_notifications_total counter
gradwatch_notifications_total{outcome="delivered",sink="webhook-0"} 3.0
gradwatch_notifications_total{outcome="dropped",sink="webhook-0"} 0.0
gradwatch_notifications_total{outcome="failed",sink="webhook-0"} 1.0
# HELP gradwatch_notification_retries_total Extra delivery attempts after a failure.
# TYPE gradwatch_notification_retries_total counter
gradwatch_notification_retries_total{sink="webhook-0"} 2.0
# HELP gradwatch_notification_queue_length Notifications waiting to be sent.
# TYPE gradwatch_notification_queue_length gauge
gradwatch_notification_queue_length{sink="webhook-0"} 1.0
"""  # noqa: E501  # exact exposition text: a HELP line is as long as its metric's help


def render(
    store: StateStore, firing: tuple[Alert, ...] = (nan_alert(0), nan_alert(1)), **kwargs: Any
) -> str:
    registry = CollectorRegistry()
    registry.register(
        GradwatchCollector(
            store, lambda: INGEST, lambda: firing, [FakeSink()], version="9.9.9", **kwargs
        )
    )
    return generate_latest(registry).decode()


def test_exact_text_for_a_fixed_state() -> None:
    assert render(fixed_state(), per_layer_metrics=True, max_layer_series=2) == EXPECTED


def test_layer_series_are_opt_in_and_uncapped_below_the_limit() -> None:
    assert "gradwatch_layer_grad_norm" not in render(fixed_state())
    text = render(fixed_state(), per_layer_metrics=True, max_layer_series=4)
    assert 'gradwatch_layer_grad_norm{layer="a",training_job="run-1"} 3.0' in text
    assert 'gradwatch_layer_series_capped{training_job="run-1"} 0.0' in text


def test_forgotten_jobs_have_no_series() -> None:
    now = [NOW]
    store = StateStore(job_ttl_seconds=10, clock=lambda: now[0])
    store.observe_step(Step(job="run-1", step=1, time=NOW, loss=1.0))
    assert 'gradwatch_job_step{training_job="run-1"}' in render(store)
    now[0] += 11
    assert store.expire() == ["run-1"]
    samples = [line for line in render(store, firing=()).splitlines() if not line.startswith("#")]
    assert not [line for line in samples if line.startswith(("gradwatch_job_", "gradwatch_alerts"))]


ZERO_FROM_THE_START = (
    "gradwatch_ingest_lost_batches_total",
    "gradwatch_agent_dropped_steps_total",
    "gradwatch_assembly_steps_total",
    "gradwatch_assembly_incomplete_steps_total",
    "gradwatch_assembly_inexact_steps_total",
    "gradwatch_assembly_late_reports_total",
    "gradwatch_assembly_restarts_total",
    "gradwatch_job_absent_ranks",
)


def test_a_new_jobs_counters_exist_at_zero_until_something_happens() -> None:
    """A job's per-job counters and gauges are there from its first scrape, at zero, so a
    dashboard panel is not empty in a healthy run and rate() sees the first increment."""
    now = [NOW]
    store = StateStore(job_ttl_seconds=10, clock=lambda: now[0])
    store.observe_step(Step(job="fresh", step=1, time=NOW, loss=1.0))
    stats = [IngestStats({}, {}, {}, {})]
    registry = CollectorRegistry()
    registry.register(GradwatchCollector(store, lambda: stats[0]))
    registry.register(
        AssemblyMetrics(Assembler(5.0, lambda: now[0]), threading.Lock(), jobs=store.jobs)
    )

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"training_job": "fresh"})

    assert {name: value(name) for name in ZERO_FROM_THE_START} == dict.fromkeys(
        ZERO_FROM_THE_START, 0.0
    )
    stats[0] = IngestStats({}, {}, agent_dropped={"fresh": 3}, lost_batches={"fresh": 1})
    assert (
        value("gradwatch_ingest_lost_batches_total"),
        value("gradwatch_agent_dropped_steps_total"),
    ) == (1.0, 3.0)
    # Forgotten, the job takes its zeros with it.
    now[0] += 11
    assert store.expire() == ["fresh"]
    stats[0] = IngestStats({}, {}, {}, {})
    assert {name: value(name) for name in ZERO_FROM_THE_START} == dict.fromkeys(
        ZERO_FROM_THE_START, None
    )
