"""The collector on real gloo jobs: assembled global norms, a hung rank, a straggler, a NaN.

Each test runs the worker job (DDP or FSDP2 ranks on CPU, one process each)
against a real in-process collector (``Server``: ZeroMQ on loopback, the real
ingest, assembler and rules engine). The engine is wrapped to keep every step
it judges, so the test compares what the rules saw with the norms the job
computed itself (``p.grad.norm()`` under DDP, ``full_tensor().norm()`` under
FSDP2).
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.exposition import JOB_LABEL
from gradwatch.collector.server import Server
from gradwatch.rules import Engine, load_rules_text
from gradwatch.rules.step import Step
from tests.distributed.harness import launch
from tests.recording_sink import RecordingSink, fired, firing_alert

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_gloo_available(), reason="this torch build has no gloo backend"
    ),
    pytest.mark.slow,
]

JOB_TIMEOUT_S = 60.0
ALERT_TIMEOUT_S = 20.0

# The default pack's rules for these failures, with thresholds a test can wait
# for: a 2 s stall (not 5 min) and a straggler held for 1 s (not 60 s).
RULES = """
groups:
  - name: distributed-test
    rules:
      - alert: NonFiniteGradients
        detector: nonfinite
        for: 1
        severity: critical
        category: numerical
      - alert: RankStalled
        detector: stalled
        params: {factor: 20.0, min_seconds: 2.0, heartbeat_timeout: 30.0}
        for: 1
        severity: critical
        category: stalled
      - alert: RankStraggling
        detector: straggler
        params: {factor: 2.0, min_excess_seconds: 0.1}
        for: 1s
        severity: warning
        category: straggler
"""


class SpyEngine(Engine):
    """The real engine, also keeping every step it judges."""

    def __init__(self) -> None:
        super().__init__(load_rules_text(RULES, source="test"))
        self.steps: list[Step] = []

    def observe(self, step: Step) -> list[Any]:
        self.steps.append(step)
        return super().observe(step)


@contextmanager
def collector() -> Iterator[tuple[Server, SpyEngine, RecordingSink]]:
    engine, sink = SpyEngine(), RecordingSink()
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0")
    server = Server(config, engine=engine, registry=CollectorRegistry(), sinks=[sink])
    server.start()
    try:
        yield server, engine, sink
    finally:
        assert server.stop(10), "the collector did not stop within its deadline"


def wait_until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling a condition with a deadline, not waiting out a race


@pytest.mark.parametrize(("mode", "world", "steps"), [("ddp", 2, 6), ("fsdp", 3, 6)])
def test_assembled_norms_equal_the_norms_computed_in_the_job(
    tmp_path: Path, mode: str, world: int, steps: int
) -> None:
    with collector() as (server, engine, sink):
        with launch(world, mode, server.bound_endpoint, f"asm-{mode}", steps, tmp_path) as job:
            job.wait(JOB_TIMEOUT_S)
        wait_until(lambda: len(engine.steps) >= steps, 10.0, "every assembled step")
        judged = list(engine.steps)
        metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    direct = {int(k): v for k, v in json.loads((tmp_path / "direct.json").read_text()).items()}
    assert [s.step for s in judged] == list(range(1, steps + 1))  # once each, in order
    for whole in judged:
        assert whole.assembled == world and whole.world == world
        assert whole.shards == (1 if mode == "ddp" else world)
        expected = direct[whole.step]
        assert whole.layers == tuple(expected)
        np.testing.assert_allclose(whole.layer_norms, list(expected.values()), rtol=1e-5, atol=1e-7)
        total = math.sqrt(sum(v * v for v in expected.values()))
        assert whole.grad_norm == pytest.approx(total, rel=1e-5)
    job_label = f'{{{JOB_LABEL}="asm-{mode}"}}'
    assert f"gradwatch_assembly_steps_total{job_label} {float(steps)}" in metrics
    assert f"gradwatch_assembly_incomplete_steps_total{job_label} 0.0" in metrics
    assert f"gradwatch_job_world_size{job_label} {float(world)}" in metrics
    assert f"gradwatch_job_absent_ranks{job_label} 0.0" in metrics
    # A healthy job: no gradient alert. (The liveness rules here use test thresholds,
    # a 2 s stall, that a loaded 2-core machine can reach between two steps.)
    assert not [
        t
        for t in sink.transitions
        if t.current == "firing" and t.alert.category not in ("stalled", "straggler")
    ]


def test_a_stalled_rank_is_reported_as_hung_and_named(tmp_path: Path) -> None:
    with collector() as (server, _engine, sink):
        # Rank 1 sticks in its data loader before step 3; rank 0 waits in the all-reduce.
        with launch(
            2,
            "ddp",
            server.bound_endpoint,
            "hang",
            4,
            tmp_path,
            stall_rank=1,
            stall_at=3,
            stall_seconds=6,
        ) as job:
            alert = firing_alert(
                sink.wait_for(fired("RankStalled"), ALERT_TIMEOUT_S), "RankStalled"
            )
            job.wait(JOB_TIMEOUT_S)
    assert alert.rank == 1 and alert.category == "stalled"
    assert alert.evidence["last_step"] == 2 and alert.evidence["waiting_ranks"] == [0]
    assert "rank 1 is alive but stuck in step 3 (last completed: 2)" in alert.summary


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_straggler_is_named(tmp_path: Path, mode: str) -> None:
    with collector() as (server, _engine, sink):
        with launch(
            3,
            mode,
            server.bound_endpoint,
            f"slow-{mode}",
            20,
            tmp_path,
            slow_rank=2,
            slow_seconds=0.25,
        ) as job:
            alert = firing_alert(
                sink.wait_for(fired("RankStraggling"), ALERT_TIMEOUT_S), "RankStraggling"
            )
            job.wait(JOB_TIMEOUT_S)
    assert alert.rank == 2 and alert.category == "straggler"
    # Its data loader is slow: under FSDP the others wait inside their forward's
    # all-gathers, so the time before the forward is what tells it apart.
    assert alert.evidence["measure"] == "data_seconds" and alert.evidence["seconds"] >= 0.25
    assert alert.evidence["slow_ranks"] == [2]


def test_a_nan_born_on_one_rank_is_blamed_on_it(tmp_path: Path) -> None:
    with collector() as (server, _engine, sink):
        # Rank 1's batch at step 4 is NaN; the all-reduce spreads it to every rank's gradients.
        with launch(
            3, "ddp", server.bound_endpoint, "nan", 5, tmp_path, nan_rank=1, nan_at=4
        ) as job:
            job.wait(JOB_TIMEOUT_S)
            alert = firing_alert(
                sink.wait_for(fired("NonFiniteGradients"), ALERT_TIMEOUT_S), "NonFiniteGradients"
            )
    assert alert.rank == 1 and alert.step == 4
    assert alert.evidence["first_bad_rank"] == 1
    assert "first on rank 1" in alert.summary
