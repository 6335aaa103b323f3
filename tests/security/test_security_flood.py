"""Done-when of issue 15: a flood of forged-but-valid input while a real agent trains.

A separate process floods the collector (dev profile, loopback) with job-name,
layer-name, row, alert and checkpoint bombs (``flood.py``). Meanwhile a real
agent trains; a few seconds into the flood its loss turns NaN. The real alert
must reach the sink within 1 s of the flush that carried the NaN step, the
collector's resident memory must stay under ``max_memory_bytes``, ``/metrics``
must answer well under Prometheus's 10 s scrape timeout, and the flood must be
refused and counted, not obeyed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.limits import current_rss
from gradwatch.collector.server import Server
from gradwatch.collector.sinks import SinkStats
from tests.security.forge import NAN_RULE
from tests.security.helpers import WAIT_S, agent, model_and_optimizer, wait_until

FLOOD_S = 6.0
FLUSH = 5
ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """A sink that notes when each alert arrived."""

    name = "recorder"

    def __init__(self) -> None:
        self.arrived: list[tuple[float, Any]] = []
        self.open = False

    def start(self) -> None:
        self.open = True

    def notify(self, transition: Any) -> None:
        self.arrived.append((time.monotonic(), transition.alert))

    def close(self, timeout: float) -> None:
        self.open = False

    def alive(self) -> bool:
        return self.open

    def stats(self) -> SinkStats:
        return SinkStats()


def test_a_real_nan_alert_arrives_within_a_second_under_a_flood(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(NAN_RULE)
    bound = current_rss() + 256 * 1024 * 1024
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", rules=rules, max_memory_bytes=bound
    )
    sink = Recorder()
    peak = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            peak[0] = max(peak[0], current_rss())

    server = Server(config, registry=CollectorRegistry(), sinks=[sink])
    server.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    flood: subprocess.Popen[str] | None = None
    try:
        model, opt = model_and_optimizer()
        with agent(server, model, opt, "real", flush_every=FLUSH) as mon:
            train(mon, model, opt, FLUSH * 4, nan=False)
            assert wait_until(lambda: server.state.job("real") is not None)
            flood = subprocess.Popen(
                [sys.executable, "-m", "tests.security.flood", server.bound_endpoint, str(FLOOD_S)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            # Into the flood: the forged jobs, layers and alerts are arriving.
            assert wait_until(lambda: sum(server.admission.refused().values()) > 100)
            train(mon, model, opt, FLUSH * 20, nan=False)  # the real job goes on meanwhile
            flushed = train(mon, model, opt, FLUSH, nan=True)  # the NaN step ends a flush
            assert wait_until(lambda: any(a.job == "real" for _, a in sink.arrived), WAIT_S), (
                "the real NaN alert never arrived"
            )
            latency = min(t for t, a in sink.arrived if a.job == "real") - flushed
            began = time.monotonic()
            with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
                size = len(response.read())
            scrape_s = time.monotonic() - began
        out, _ = flood.communicate(timeout=FLOOD_S + WAIT_S)
    finally:
        if flood is not None:
            if flood.poll() is None:
                flood.kill()
                flood.wait()
            if flood.stdout is not None:
                flood.stdout.close()
        sampling.set()
        assert server.stop()
    refused = server.admission.refused()
    print(
        f"\nflood: {out.strip()}; refused {refused}; real alert {latency:.3f} s after its "
        f"flush; peak RSS {peak[0] / 2**20:.0f} MiB (bound {bound / 2**20:.0f}); "
        f"/metrics {size / 1024:.0f} KiB in {scrape_s:.2f} s; "
        f"{len(server.state.jobs())} jobs tracked"
    )
    assert latency < 1.0
    assert peak[0] < bound
    assert scrape_s < 10.0 and size < 2 * 1024 * 1024  # Prometheus's scrape timeout
    assert refused["jobs"] > 0 and refused["rows"] > 0 and refused["layers"] > 0
    assert len(server.state.jobs()) <= config.max_jobs


def train(mon: Any, model: Any, opt: Any, steps: int, nan: bool) -> float:
    """Train ``steps`` steps; the time the last one's ``log()`` was called (its flush)."""
    import torch

    done = 0.0
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if nan:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        done = time.monotonic()  # the last log() hands the flush to the shipper
        mon.log(loss=loss)
        opt.zero_grad()
    return done
