"""Hard bounds on hostile but well-formed input (issue 15, finding 2 and 4).

Each bound refuses what exceeds it, counts it by reason and by the sender that
caused it, logs it (rate-limited), and keeps /metrics small and fast.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.limits import Admission, Bounds
from gradwatch.collector.server import Server
from gradwatch.wire import Heartbeat
from tests.security.forge import batch, heartbeat


@pytest.fixture
def server() -> Iterator[Server]:
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        max_jobs=50,
        max_ranks_per_job=8,
        max_layers_per_schema=1000,
        max_rows_per_batch=64,
    )
    server = Server(config, registry=CollectorRegistry(), sinks=[])
    server.start()
    yield server
    assert server.stop()


def scrape(server: Server) -> tuple[str, float]:
    began = time.monotonic()
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return text, time.monotonic() - began


def test_a_job_name_bomb_is_refused_past_max_jobs_and_metrics_stay_small(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    baseline, _ = scrape(server)
    caplog.set_level(logging.WARNING, logger="gradwatch")
    for i in range(5000):  # finding 2: 47k names took 1.63 GB and a 14.8 s /metrics
        server.pipeline.handle(heartbeat(f"bomb-{i}"))
    assert len(server.state.jobs()) == 50
    assert server.admission.refused()["jobs"] == 4950
    text, took = scrape(server)
    assert took < 2.0 and len(text) < len(baseline) + 50 * 4000
    assert 'gradwatch_ingest_refused_total{reason="jobs"} 4950.0' in text
    # The sender is named: which job names were refused (the worst offenders, bounded).
    assert 'gradwatch_ingest_refused_by_sender_total{reason="jobs",sender="bomb-50"} 1.0' in text
    assert text.count("gradwatch_ingest_refused_by_sender_total{") <= 20
    logged = [r.getMessage() for r in caplog.records if "max_jobs=50" in r.getMessage()]
    assert 1 <= len(logged) <= 5 and "bomb-50" in logged[0]  # rate-limited, names the job


def test_ranks_rows_and_layers_are_bounded(server: Server) -> None:
    for rank in range(20):  # a header may claim up to 2^20 ranks
        server.pipeline.handle(heartbeat("wide", rank=rank, world=1 << 20))
    job = server.state.job("wide")
    assert job is not None and len(job.ranks) == 8
    server.pipeline.handle(batch("rows", rows=15_000 // 100))  # finding 4, scaled: over 64 rows
    server.pipeline.handle(batch("layers", layers=1001))  # one layer over the cap
    server.pipeline.handle(batch("fine", rows=64, layers=1000))  # exactly at both caps
    refused = server.admission.refused()
    assert (refused["ranks"], refused["rows"], refused["layers"]) == (12, 1, 1)
    assert server.state.job("rows") is None and server.state.job("layers") is None
    assert server.state.job("fine") is not None


def test_the_memory_bound_stops_new_jobs_ranks_and_schemas() -> None:
    rss = [0]
    admission = Admission(
        Bounds(max_memory_bytes=100 << 20), clock=time.monotonic, rss=lambda: rss[0]
    )
    assert admission.admit(Heartbeat("a", 0, 1, "i", 0.0, 0, 0)) is None
    rss[0] = 200 << 20
    time.sleep(0.11)  # the resident size is read at most every 0.1 s
    assert admission.admit(Heartbeat("b", 0, 1, "i", 0.0, 0, 0)) == "memory"
    assert admission.admit(Heartbeat("a", 1, 1, "i", 0.0, 0, 0)) == "memory"
    assert admission.admit(Heartbeat("a", 0, 1, "i", 0.0, 0, 0)) is None  # known: goes on
    assert not admission.may_grow("a", 0)
    assert admission.refused()["memory"] == 3


def test_curve_keys_have_their_own_job_cap_and_forgotten_jobs_free_slots() -> None:
    admission = Admission(Bounds(max_jobs=10, max_jobs_per_key=3), rss=lambda: 0)
    jobs = [
        admission.admit(Heartbeat(f"k-{i}", 0, 1, "i", 0.0, 0, 0), key="KEY1") for i in range(5)
    ]
    assert jobs == [None, None, None, "jobs_per_key", "jobs_per_key"]
    assert admission.admit(Heartbeat("other", 0, 1, "i", 0.0, 0, 0), key="KEY2") is None
    admission.forget("k-0")
    assert admission.admit(Heartbeat("k-9", 0, 1, "i", 0.0, 0, 0), key="KEY1") is None
    assert ("KEY1", "jobs_per_key", 2) in admission.offenders()


def test_a_sender_over_its_share_is_refused_only_under_contention() -> None:
    now = [0.0]
    admission = Admission(
        Bounds(ingest_share=0.5, ingest_burst_seconds=0.2), clock=lambda: now[0], rss=lambda: 0
    )
    # Alone and idle: even a costly sender goes on (the thread is not contended).
    admission.charge("flood", 0.3)
    assert admission.allow("flood")
    assert admission.allow("light")  # another sender: the shares matter from now on
    admission.charge("flood", 0.4)  # now 0.7 s of the last second: contended
    assert not admission.allow("flood")  # in debt: refused after a header read
    assert admission.allow("light")  # a light sender still gets its share
    now[0] += 2.0  # refilled, and the thread idle again
    assert admission.allow("flood")
    assert admission.refused()["share"] == 1


def test_a_layer_name_bomb_keeps_metrics_within_the_family_caps() -> None:
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", max_series_per_family=2000
    )
    server = Server(config, registry=CollectorRegistry(), sinks=[])
    server.start()
    try:
        for i in range(60):  # finding 2: distinct layer (and so block) names per job
            server.pipeline.handle(batch(f"layers-{i}", layers=670, prefix=f"m{i}."))
        text, took = scrape(server)
    finally:
        assert server.stop()
    blocks = [line for line in text.splitlines() if line.startswith("gradwatch_block_grad_norm{")]
    assert 60 <= len(blocks) <= 2000 and took < 5.0


def test_jobs_that_never_reach_the_state_do_not_hold_a_slot() -> None:
    now = [0.0]
    admission = Admission(Bounds(max_jobs=2), clock=lambda: now[0], rss=lambda: 0)
    for job in ("a", "b"):  # admitted, then refused further on (say, an unknown schema)
        assert admission.admit(Heartbeat(job, 0, 1, "i", 0.0, 0, 0)) is None
    assert admission.admit(Heartbeat("c", 0, 1, "i", 0.0, 0, 0)) == "jobs"
    now[0] = 11.0
    assert admission.retain({"a"}) == ["b"]  # "a" is in the state: kept
    assert admission.admit(Heartbeat("c", 0, 1, "i", 0.0, 0, 0)) is None
