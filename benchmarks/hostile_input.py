"""Hostile but well-formed input (issue 15): what each bomb costs the collector now.

Run from the repository root: ``python -m benchmarks.hostile_input [--trials 3]``.
Each phase starts a fresh in-process collector (dev profile, loopback, the
default bounds unless said) and sends valid messages over a real PUSH socket,
as the issue's probes did, then prints what it cost:

1. job-name bomb: 47,000 heartbeats of new job names;
2. layer-name bomb: 300 batches, each a new schema of 670 new layer names (200k);
3. checkpoint bomb: 24,500 checkpoint reports over 245 jobs;
4. oversized batches: 40 batches of 4,096 rows (over max_rows_per_batch);
5. flood + real agent: a separate process floods (tests/security/flood.py) while
   a real agent trains; its NaN alert latency (from the log() that flushed the
   NaN step to the sink) with and without the flood, measured side by side,
   median of ``--trials``.

Every phase also reports the resident memory growth, the /metrics size and how
long a scrape took, and the refusal counters.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.limits import current_rss
from gradwatch.collector.server import Server
from gradwatch.collector.sinks import SinkStats
from tests.security.forge import NAN_RULE, batch, checkpoint, heartbeat

ROOT = Path(__file__).resolve().parents[1]


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.arrived: list[tuple[float, Any]] = []

    def start(self) -> None: ...

    def notify(self, transition: Any) -> None:
        self.arrived.append((time.monotonic(), transition.alert))

    def close(self, timeout: float) -> None: ...

    def alive(self) -> bool:
        return True

    def stats(self) -> SinkStats:
        return SinkStats()


def scrape(server: Server) -> tuple[int, float]:
    began = time.monotonic()
    with urllib.request.urlopen(server.metrics_url, timeout=60) as response:
        size = len(response.read())
    return size, time.monotonic() - began


def bomb(name: str, messages: list[list[bytes]], **bounds: Any) -> None:
    """Send ``messages`` to a fresh collector, wait until handled, report."""
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", **bounds),
        registry=CollectorRegistry(),
        sinks=[],
    )
    server.start()
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.sndhwm = 0  # the sender queues; the collector's own receive_hwm bounds its side
    push.connect(server.bound_endpoint)
    rss0 = current_rss()
    began = time.monotonic()
    for frames in messages:
        push.send_multipart(frames)
    done = server.wait_for_messages(len(messages), timeout=300)
    took = time.monotonic() - began
    size, scrape_s = scrape(server)
    rss = current_rss() - rss0
    refused = {k: v for k, v in server.admission.refused().items() if v}
    refused.update({f"wire:{k}": v for k, v in server.ingest.stats().rejected.items() if v})
    rows = server.actions.checkpoints.rows() if server.actions is not None else 0
    print(
        f"{name:<22} {len(messages):>6} msgs in {took:6.1f} s{'' if done else ' (NOT ALL)'}"
        f" | RSS +{rss / 2**20:6.0f} MiB | /metrics {size / 1024:6.0f} KiB in "
        f"{scrape_s:5.2f} s | jobs {len(server.state.jobs()):>4} | checkpoint rows {rows:>6}"
        f" | refused {refused}",
        flush=True,
    )
    push.close(linger=0)
    ctx.term()
    server.stop()


def nan_latency(flood: bool, rules: Path) -> tuple[float, int]:
    """One trial: the real agent's NaN alert latency (s) and peak collector RSS (bytes)."""
    import torch

    import gradwatch

    sink = Recorder()
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", rules=rules),
        registry=CollectorRegistry(),
        sinks=[sink],
    )
    server.start()
    proc = None
    peak = current_rss()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with gradwatch.watch(
            model,
            opt,
            job="real",
            endpoint=server.bound_endpoint,
            flush_every=5,
            stats_every=0,
            heartbeat_every=0.05,
        ) as mon:

            def steps(n: int, nan: bool) -> float:
                logged = time.monotonic()
                for _ in range(n):
                    loss = model(torch.randn(8, 4)).pow(2).mean()
                    if nan:
                        loss = loss * float("nan")
                    loss.backward()
                    opt.step()
                    logged = time.monotonic()  # this log() hands the flush to the shipper
                    mon.log(loss=loss)
                    opt.zero_grad()
                return logged

            steps(20, False)
            if flood:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.security.flood", server.bound_endpoint, "8"],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                )
                deadline = time.monotonic() + 20
                while (
                    sum(server.admission.refused().values()) < 100 and time.monotonic() < deadline
                ):
                    peak = max(peak, current_rss())
                    time.sleep(0.05)
            for _ in range(20):
                steps(5, False)
                peak = max(peak, current_rss())
            flushed = steps(5, True)
            deadline = flushed + 30
            while not any(a.job == "real" for _, a in sink.arrived) and time.monotonic() < deadline:
                peak = max(peak, current_rss())
                time.sleep(0.005)
        arrived = [t for t, a in sink.arrived if a.job == "real"]
        return (min(arrived) - flushed if arrived else float("inf")), peak
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    bomb("job-name bomb", [heartbeat(f"bomb-{i}") for i in range(47_000)])
    bomb(
        "layer-name bomb",
        [batch(f"layers-{i}", layers=670, schema_id=1, prefix=f"m{i}.") for i in range(300)],
    )
    bomb(
        "checkpoint bomb",
        [checkpoint(f"ckpt-{i % 245}", i, f"/tmp/attacker-{i}.pt") for i in range(24_500)],
    )
    bomb(
        "4,096-row batches", [batch("rows", rows=4096, first_step=1 + 4096 * i) for i in range(40)]
    )
    rules = Path("/tmp") / f"gradwatch-hostile-{time.time_ns()}.yaml"
    rules.write_text(NAN_RULE)
    quiet, flooded = [], []
    for _ in range(args.trials):  # side by side: one of each per round
        quiet.append(nan_latency(False, rules))
        flooded.append(nan_latency(True, rules))
    rules.unlink()
    for name, runs in (("no flood", quiet), ("flood", flooded)):
        lat = [r[0] for r in runs]
        print(
            f"NaN alert after its flush, {name:<9}: median {statistics.median(lat):.3f} s, "
            f"max {max(lat):.3f} s over {len(lat)} trials; peak RSS "
            f"{max(r[1] for r in runs) / 2**20:.0f} MiB (whole process, torch included)",
            flush=True,
        )


if __name__ == "__main__":
    main()
