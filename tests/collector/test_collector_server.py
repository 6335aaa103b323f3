"""The collector in-process on loopback: real sockets, real HTTP, bounded waits."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig, CollectorError
from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.server import Server
from gradwatch.rules.step import Step
from gradwatch.wire import Batch, Event, Heartbeat, Schema, encode
from tests.collector.conftest import Connect

LAYERS = ("embed.weight", "fc.weight", "fc.bias")


def batch(
    rows: Sequence[Sequence[float]],
    first_step: int,
    *,
    seq: int,
    job: str = "run-1",
    send_schema: bool = True,
) -> list[bytes]:
    steps = tuple(range(first_step, first_step + len(rows)))
    schema = Schema(1, ("loss", "lr/0"), LAYERS) if send_schema else None
    return encode(
        Batch(
            job,
            0,
            1,
            1,
            seq,
            "inc-a",
            0,
            steps,
            tuple(map(float, steps)),
            np.array(rows, "<f4").tobytes(),
            schema,
        )
    )


HEALTHY = [[2.0 - 0.1 * i, 0.1, 1.0, 0.5, 0.1] for i in range(4)]
POISONED = [[1.5, 0.1, float("nan"), 0.5, 0.1]]


@contextmanager
def running(engine: Any = None, clock: Any = time.time, **overrides: Any) -> Iterator[Server]:
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", **overrides)
    server = Server(config, engine=engine, registry=CollectorRegistry(), clock=clock)
    server.start()
    try:
        yield server
    finally:
        assert server.stop(10), "the server did not stop within its deadline"


def get(server: Server, path: str = "/metrics") -> tuple[int, str]:
    url = f"http://127.0.0.1:{server.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def test_nan_layer_norm_fires_a_numerical_alert_end_to_end(connect: Connect) -> None:
    with WebhookReceiver() as receiver, running(webhooks=[receiver.url]) as server:
        push = connect(server)
        push.send_multipart(batch(HEALTHY, 1, seq=0))
        push.send_multipart(batch(POISONED, 5, seq=1, send_schema=False))
        assert server.wait_for_messages(2, timeout=10)
        status, text = get(server)
        assert status == 200
        assert 'gradwatch_job_step{training_job="run-1"} 5.0' in text
        assert 'gradwatch_job_nonfinite_layers{training_job="run-1"} 1.0' in text
        assert (
            'gradwatch_alerts_firing{category="numerical",rule="NonFiniteGradients",'
            'severity="critical",training_job="run-1"} 1.0'
        ) in text
        (alert,) = receiver.wait_for(lambda got: len(got) >= 1, timeout=10)
        assert (alert["category"], alert["state"], alert["step"]) == ("numerical", "firing", 5)
        assert alert["evidence"]["first_nonfinite"] == ["embed.weight"]


def test_heartbeats_events_and_unknown_schemas(connect: Connect) -> None:
    with running() as server:
        push = connect(server)
        push.send_multipart(batch(HEALTHY, 1, seq=0, send_schema=False))
        push.send_multipart(encode(Heartbeat("run-1", 0, 1, "inc-a", 1.0, 0, 3)))
        push.send_multipart(
            encode(Event("run-1", 0, "inc-a", 1.0, "checkpoint", 100, {"path": "ckpt/100.pt"}))
        )
        assert server.wait_for_messages(3, timeout=10)
        _, text = get(server)
        assert 'gradwatch_ingest_rejected_total{reason="unknown_schema"} 1.0' in text
        assert 'gradwatch_agent_dropped_steps_total{training_job="run-1"} 3.0' in text
        job = server.state.job("run-1")
        assert job is not None and job.checkpoints[0].path == "ckpt/100.pt"


def test_health_endpoints(connect: Connect) -> None:
    with running() as server:
        assert get(server, "/healthz") == (200, "ok\n")
        assert get(server, "/readyz") == (200, "ready\n")
        assert get(server, "/nope")[0] == 404
        assert server.ready


def test_the_rules_inhibits_are_applied_and_counted_on_metrics(connect: Connect) -> None:
    # collector/inhibition.py: the default pack's pair, taken from the engine at start.
    with running() as server:
        assert (
            "WeightsInflatingLossStalled",
            "WeightNormRunaway",
        ) in server.pipeline.inhibition.pairs
        assert "gradwatch_alerts_inhibited" in get(server, "/metrics")[1]


def test_oversized_messages_are_counted_and_the_server_survives(connect: Connect) -> None:
    with running(max_message_bytes=1024) as server:
        push = connect(server)
        # Every frame under ZeroMQ's MAXMSGSIZE, the whole message over the cap.
        push.send_multipart([b"x" * 600] * 3)
        assert server.wait_for_messages(1, timeout=10)
        # One frame over the cap but within ZeroMQ's MAXMSGSIZE headroom (4x): counted too.
        push.send(b"x" * 4096)
        assert server.wait_for_messages(2, timeout=10)
        # Beyond the headroom ZeroMQ drops the connection without telling us.
        push.send(b"x" * 4097)
        fresh = connect(server)
        fresh.send_multipart(encode(Heartbeat("run-1", 0, 1, "inc-a", 1.0, 0, 0)))
        assert server.wait_for_messages(3, timeout=10)
        assert server.ingest.stats().rejected["oversized"] == 2
        assert server.ingest.stats().messages["heartbeat"] == 1
        assert server.ready


def test_random_frames_never_take_the_server_down(connect: Connect) -> None:
    with running() as server:
        push = connect(server)
        sent = 0

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(st.lists(st.binary(max_size=256), min_size=1, max_size=4))
        def send(frames: list[bytes]) -> None:
            nonlocal sent
            push.send_multipart(frames)
            sent += 1

        send()
        push.send_multipart(batch(HEALTHY, 1, seq=0))
        assert server.wait_for_messages(sent + 1, timeout=30)
        assert server.ready and get(server, "/readyz")[0] == 200
        stats = server.ingest.stats()
        assert sum(stats.messages.values()) + sum(stats.rejected.values()) == sent + 1
        assert stats.rejected["internal"] == 0


class ExplodingEngine:
    def observe(self, step: Step) -> list[Any]:
        raise RuntimeError("boom")

    def observe_eval(self, ev: Any) -> list[Any]:
        raise RuntimeError("boom")

    def observe_stats(self, stats: Any) -> list[Any]:
        raise RuntimeError("boom")

    def tick(self, liveness: Any) -> list[Any]:
        return []

    def firing(self) -> list[Any]:
        return []

    def forget(self, job: str) -> list[Any]:
        return []


def test_engine_errors_are_counted_not_fatal(connect: Connect) -> None:
    with running(engine=ExplodingEngine()) as server:
        connect(server).send_multipart(batch(HEALTHY, 1, seq=0))
        assert server.wait_for_messages(1, timeout=10)
        assert server.ingest.stats().rejected["internal"] == len(HEALTHY)
        assert server.ready


def test_silent_jobs_are_forgotten_and_their_alerts_resolved(connect: Connect) -> None:
    now = [1_700_000_000.0]
    with (
        WebhookReceiver() as receiver,
        running(clock=lambda: now[0], job_ttl_seconds=60, webhooks=[receiver.url]) as server,
    ):
        push = connect(server)
        push.send_multipart(batch(POISONED, 1, seq=0))
        receiver.wait_for(lambda got: len(got) == 1, timeout=10)
        now[0] += 120  # the ingest thread looks for silent jobs about once a second
        bodies = receiver.wait_for(lambda got: len(got) == 2, timeout=10)
        assert [b["state"] for b in bodies] == ["firing", "resolved"]
        assert server.state.jobs() == []
        assert 'job="run-1"' not in get(server)[1]


def test_a_taken_endpoint_is_a_clear_error(connect: Connect) -> None:
    with running() as first:
        config = CollectorConfig(listen=first.bound_endpoint, metrics_addr="127.0.0.1:0")
        second = Server(config, registry=CollectorRegistry())
        with pytest.raises(CollectorError, match="cannot listen"):
            second.start()
        assert second.stop(1)
        assert first.ready


def test_ready_file_names_the_random_ports_and_goes_away(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    with running(ready_file=ready) as server:
        body = json.loads(ready.read_text())
        assert body["listen"] == server.bound_endpoint
        assert body["metrics_url"] == f"http://127.0.0.1:{server.metrics_port}/metrics"
        assert body["pid"] == os.getpid()
    assert not ready.exists()


def test_sigterm_drains_and_exits_zero(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradwatch.collector",
            "--listen",
            "tcp://127.0.0.1:*",
            "--metrics-addr",
            "127.0.0.1:0",
            "--log-level",
            "info",
            "--ready-file",
            str(ready),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stderr, selectors.EVENT_READ)
            deadline = time.monotonic() + 30
            line = ""
            while "collector receiving on" not in line:
                assert selector.select(deadline - time.monotonic()), "collector did not start"
                line = proc.stderr.readline()
                assert line, "collector exited before it started"
        assert json.loads(ready.read_text())["listen"].startswith("tcp://127.0.0.1:")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 5 + 1  # shutdown_timeout plus process exit
        assert "collector stopping" in proc.stderr.read()
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
