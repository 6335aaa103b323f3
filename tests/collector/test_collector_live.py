"""Evals and liveness wired live through the collector: real sockets, a fake clock, no sleeps."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.ingest import MAX_TRAIN_MODE_MODULES, Ingest, eval_of
from gradwatch.collector.server import Server
from gradwatch.collector.state import StateStore
from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.step import Stats, Step
from gradwatch.wire import MISSING_BITS, Batch, Event, Heartbeat, Schema, encode
from gradwatch.wire import columns as wc
from tests.recording_sink import RecordingSink, fired

T0 = 1_700_000_000.0
LAYERS = ("fc.weight", "fc.bias")


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class StatsSpyEngine(Engine):
    """The real engine, also keeping every ``Stats`` it is fed."""

    def __init__(self) -> None:
        super().__init__(load_default_rules())
        self.stats: list[Stats] = []

    def observe_stats(self, stats: Stats) -> list[Any]:
        self.stats.append(stats)
        return super().observe_stats(stats)


@contextmanager
def live_server(
    clock: FakeClock, engine: Engine | None = None
) -> Iterator[tuple[Server, RecordingSink, zmq.Socket[Any]]]:
    sink = RecordingSink()
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0")
    server = Server(config, engine=engine, registry=CollectorRegistry(), clock=clock, sinks=[sink])
    server.start()
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(server.bound_endpoint)
    try:
        yield server, sink, push
    finally:
        push.close(linger=0)
        ctx.term()
        assert server.stop(10), "the server did not stop within its deadline"


def steps_batch(first: int, count: int, seq: int) -> list[bytes]:
    steps = tuple(range(first, first + count))
    rows = np.array([[2.0, 0.1, 1.0, 0.5] for _ in steps], "<f4")
    return encode(
        Batch(
            "run-1",
            0,
            1,
            1,
            seq,
            "inc-a",
            0,
            steps,
            tuple(T0 + s for s in steps),
            rows.tobytes(),
            Schema(1, ("loss", "lr/0"), LAYERS),
        )
    )


def eval_event(**fields: Any) -> Event:
    return Event("run-1", 0, "inc-a", T0, "eval", 4, fields)


def test_an_eval_in_training_mode_fires_the_wiring_alert() -> None:
    clock = FakeClock()
    with live_server(clock) as (server, sink, push):
        push.send_multipart(steps_batch(1, 4, seq=0))
        push.send_multipart(encode(eval_event(loss="nan", train_mode_modules=["bn1", "drop"])))
        assert server.wait_for_messages(2, timeout=10)
        got = sink.wait_for(fired("EvalInTrainingMode"))
        alert = next(t.alert for t in got if t.alert.rule == "EvalInTrainingMode")
        assert alert.job == "run-1" and alert.category == "eval_mode_wiring"
        assert "bn1" in alert.summary and "drop" in alert.summary
        assert server.ingest.stats().rejected["internal"] == 0


def test_heartbeats_without_step_progress_fire_the_stalled_alert() -> None:
    clock = FakeClock()
    with live_server(clock) as (server, sink, push):
        push.send_multipart(steps_batch(1, 4, seq=0))
        assert server.wait_for_messages(1, timeout=10)
        sent = 1
        # Heartbeats every 20 s at step 4; the default rule's limit is 300 s.
        for seconds in range(20, 321, 20):
            clock.now = T0 + seconds
            push.send_multipart(encode(Heartbeat("run-1", 0, 1, "inc-a", T0 + seconds, 4, 0)))
            sent += 1
            assert server.wait_for_messages(sent, timeout=10)
            server.tick()
            if seconds <= 300:
                assert not fired("RankStalled")(sink.transitions), f"fired early, at {seconds}s"
        got = sink.wait_for(fired("RankStalled"))
        alert = next(t.alert for t in got if t.alert.rule == "RankStalled")
        assert alert.job == "run-1" and alert.rank == 0 and alert.category == "stalled"
        assert server.ingest.stats().rejected["internal"] == 0


def test_a_new_step_keeps_the_rank_live() -> None:
    clock = FakeClock()
    with live_server(clock) as (server, sink, push):
        push.send_multipart(steps_batch(1, 4, seq=0))
        clock.now = T0 + 290
        push.send_multipart(steps_batch(5, 1, seq=1))
        clock.now = T0 + 400
        push.send_multipart(encode(Heartbeat("run-1", 0, 1, "inc-a", T0 + 400, 5, 0)))
        assert server.wait_for_messages(3, timeout=10)
        server.tick()
        assert not fired("RankStalled")(sink.transitions)


def test_eval_events_decode_nonfinite_strings_and_cap_module_names() -> None:
    many = [f"layer{i}.bn" for i in range(MAX_TRAIN_MODE_MODULES + 5)]
    ev = eval_of(eval_event(loss="-inf", acc=0.5, bleu="inf", note="x", train_mode_modules=many))
    assert ev.loss == -math.inf and ev.metrics == {"acc": 0.5, "bleu": math.inf}
    assert ev.train_mode_modules == tuple(many[:MAX_TRAIN_MODE_MODULES])
    assert math.isnan(eval_of(eval_event(loss="nan")).loss or 0.0)
    odd = eval_of(eval_event(loss=[1], train_mode_modules="bn1", big=10**400))
    assert odd.loss is None and odd.train_mode_modules == () and odd.metrics == {"big": math.inf}
    out = Ingest().feed(encode(eval_event(loss=1.5)))
    assert len(out.events) == 1 and out.evals[0].loss == 1.5
    assert Ingest().feed(encode(Event("run-1", 0, "inc-a", T0, "note", 4, {}))).evals == ()


def test_state_liveness_tracks_progress_heartbeats_and_step_time() -> None:
    clock = FakeClock()
    store = StateStore(clock=clock)
    store.observe_heartbeat(Heartbeat("run-1", 0, 1, "inc-a", T0, 0, 0))
    assert store.liveness() == []  # no step yet: nothing to stall on
    for s in (1, 2, 3):
        store.observe_step(Step(job="run-1", step=s, time=T0 + 2 * s))
    clock.now = T0 + 50
    store.observe_heartbeat(Heartbeat("run-1", 0, 1, "inc-a", T0 + 50, 3, 0))
    clock.now = T0 + 60
    [live] = store.liveness()
    assert (live.last_step, live.last_step_time, live.last_heartbeat_time) == (3, T0, T0 + 50)
    assert live.now == T0 + 60 and live.step_seconds == pytest.approx(2.0)
    store.observe_heartbeat(Heartbeat("run-1", 0, 1, "inc-b", T0 + 60, 1, 0))  # restarted
    [live] = store.liveness()
    assert (live.last_step, live.last_step_time, live.step_seconds) == (1, T0 + 60, None)


def test_cadence_statistics_batches_reach_the_engine_as_stats() -> None:
    engine = StatsSpyEngine()
    schema = Schema(wc.STATS_SCHEMA_ID, (wc.WEIGHT_NORMS,), LAYERS)
    row = np.array([0.0, 3.0, 0.5], "<f4")
    row.view("<u4")[0] = MISSING_BITS  # the marker cell carries no value
    values = row.tobytes()
    with live_server(FakeClock(), engine) as (server, sink, push):
        push.send_multipart(steps_batch(1, 4, seq=0))
        push.send_multipart(
            encode(Batch("run-1", 0, 1, schema.id, 1, "inc-a", 0, (4,), (T0 + 4,), values, schema))
        )
        assert server.wait_for_messages(2, timeout=10)
        (stats,) = engine.stats
        assert (stats.job, stats.step, stats.layers) == ("run-1", 4, LAYERS)
        assert stats.weight_norms is not None and stats.weight_norms.tolist() == [3.0, 0.5]
        assert server.ingest.stats().lost_batches == {}
        assert server.state.snapshot()[0].step == 4  # not counted as a step
