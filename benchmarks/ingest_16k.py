"""The collector's own ingest cost for a 16,384-rank 3D job, without sockets or simulators.

``collector_load.py --layout`` runs the whole path on loopback, but on a 2-core
machine its senders (16,384 sockets, a flush burst of 16,384 batches) compete
with the collector for the same cores. This script measures the collector
alone: it encodes, with the agent's wire format, every rank's batches of
``--flush-every`` steps (32 reporters with their stage's 1,000 layer norms, the
other ranks loss, lr, skipped and ``s/grad_nonfinite``) and heartbeats every
``--heartbeat-every`` s, then hands them, one message at a time, to a real
collector pipeline (ingest, per-rank state, assembler, the default rules), on a
simulated clock that advances with the steps (so the assembly deadline measures
the job, not this script). One rank's step carries a NaN to check that the
alert fires, names that rank, and resolves. It prints, per flush interval: the
CPU seconds the ingest thread spent (it must stay under the interval for the
collector to keep up), the CPU time one flush burst takes to ingest, in all and
per batch (with a core to itself it must stay under
``assembly_deadline_seconds``, 5 s, or steps are judged without the last ranks;
the wall time shows how busy the machine was), and the process's peak RSS.
Compare two versions by running this script alternately in a worktree of each
(``PYTHONPATH=<worktree>``): CPU times vary run to run on a shared machine.

    python benchmarks/ingest_16k.py                      # pp=4,dp=512,tp=8, 3 flushes
    python benchmarks/ingest_16k.py --layout pp=4,dp=128,tp=8 --heartbeat-every 10
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import COLUMNS, QUIET_COLUMNS, layer_names

from gradwatch.agent.topology import parse_layout, reports_layers
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.step import Step
from gradwatch.wire import Batch, Heartbeat, Schema, encode


class Clock:
    """The simulated time the collector reads (its assembler deadline, its liveness)."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


class Recorder(Engine):
    """The default rules, keeping the transitions they return."""

    def __init__(self) -> None:
        super().__init__(load_default_rules())
        self.transitions: list[Any] = []

    def observe(self, step: Step) -> list[Any]:
        out = super().observe(step)
        self.transitions += out
        return out


def encode_flush(
    layout_text: str, layers: int, first: int, fe: int, t0: float, nan: tuple[int, int]
) -> list[list[bytes]]:
    layout = parse_layout(layout_text)
    stages = {
        s: Schema(id=0, columns=COLUMNS, layers=layer_names(layers, s))
        for s in range(dict(layout.dims).get("pp", 1))
    }
    quiet = Schema(id=0, columns=QUIET_COLUMNS, layers=())
    steps = tuple(range(first, first + fe))
    out = []
    for rank in range(layout.world):
        schema = stages[layout.stage(rank)] if reports_layers(layout, rank) else quiet
        values = np.ones((fe, schema.width), "<f4")
        values[:, 1], values[:, 2] = 1e-4, 0.0
        if not schema.layers:
            values[:, 3] = 0.0
        for row, step in enumerate(steps):
            if (step, rank) == nan:
                values[row, 0] = np.nan  # a NaN loss on this rank
                if schema.layers:
                    values[row, len(COLUMNS)] = np.nan
                else:
                    values[row, 3] = 1.0
        out.append(
            encode(
                Batch(
                    job="j16k",
                    rank=rank,
                    world=layout.world,
                    schema_id=0,
                    seq=first // fe,
                    incarnation=f"inc-{rank}",
                    dropped=0,
                    steps=steps,
                    times=tuple(t0 + s for s in steps),
                    values=values.tobytes(),
                    schema=schema if first == 0 else None,
                    shards=layout.shards,
                )
            )
        )
    return out


def heartbeats(world: int, now: float, step: int) -> list[list[bytes]]:
    return [
        encode(
            Heartbeat(
                job="j16k",
                rank=r,
                world=world,
                incarnation=f"inc-{r}",
                time=now,
                step=step,
                dropped=0,
            )
        )
        for r in range(world)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="pp=4,dp=512,tp=8")
    p.add_argument("--layers", type=int, default=1000, help="per pipeline stage")
    p.add_argument("--flushes", type=int, default=3)
    p.add_argument("--flush-every", type=int, default=10)
    p.add_argument("--heartbeat-every", type=float, default=2.0)
    args = p.parse_args(argv)
    layout = parse_layout(args.layout)
    world, fe = layout.world, args.flush_every
    clock, engine = Clock(), Recorder()
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0")
    server = Server(config, engine=engine, registry=CollectorRegistry(), clock=clock)
    pipeline = server.pipeline
    t0 = clock.now
    nan = (fe + fe // 2, world // 3)  # in the second flush, on a non-reporting rank
    for frames in heartbeats(world, t0, 0):  # agents heartbeat before their first step
        pipeline.handle(frames)
    print(
        f"{args.layout}: {world} ranks, {args.layers} layers per stage, a batch every {fe} "
        f"steps at 1 step/s, heartbeats every {args.heartbeat_every:g} s"
    )
    cpu, bursts = [], []
    for k in range(args.flushes):
        flush = encode_flush(args.layout, args.layers, k * fe, fe, t0, nan)
        beats = heartbeats(world, t0, k * fe)
        n_beats = int(round(world * fe / args.heartbeat_every))
        clock.now = t0 + (k + 1) * fe  # the flush happens when its last step is logged
        started, began = time.process_time(), time.perf_counter()
        for frames in flush:
            pipeline.handle(frames)
        burst, burst_cpu = time.perf_counter() - began, time.process_time() - started
        for i in range(n_beats):
            pipeline.handle(beats[i % world])
        pipeline.expire_assembly()
        cpu.append(time.process_time() - started)
        bursts.append(burst_cpu)
        print(
            f"  flush {k}: ingest CPU {cpu[-1]:.2f} s per {fe} s interval "
            f"({cpu[-1] / fe:.0%} of one core), flush burst {burst_cpu:.2f} s CPU "
            f"({burst:.2f} s wall, {burst_cpu / len(flush) * 1e6:.0f} us CPU per batch), "
            f"{len(flush)} batches + {n_beats} heartbeats"
        )
    clock.now += 30
    pipeline.expire_assembly()
    fired = [
        t
        for t in engine.transitions
        if getattr(t, "current", "") == "firing" and t.alert.category == "numerical"
    ]
    resolved = [
        t
        for t in engine.transitions
        if getattr(t, "current", "") == "resolved" and t.alert.category == "numerical"
    ]
    rank = fired[0].alert.rank if fired else None
    counts = server.assembler.counts().get("j16k")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"median ingest CPU {statistics.median(cpu) / fe:.0%} of one core; median flush burst "
        f"{statistics.median(bursts):.2f} s CPU ({statistics.median(bursts) / world * 1e6:.0f} us "
        "per batch; deadline 5 s); assembled "
        f"{counts.steps if counts else 0} steps, incomplete "
        f"{counts.incomplete if counts else '-'}; NaN at step {nan[0]} rank {nan[1]}: "
        f"{'fired, rank ' + str(rank) if fired else 'NOT fired'}"
        f"{', resolved' if resolved else ', not resolved'}; peak RSS {peak_mib:.0f} MiB "
        "(this process: collector plus the encoded messages)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
