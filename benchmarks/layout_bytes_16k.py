"""Bytes on the wire per step, per rank and per job, under each parallel layout at 16,384 ranks.

Encodes, with ``gradwatch.wire.encode`` (what the agent ships), one step batch
of ``--flush-every`` rows per kind of rank, a heartbeat and the schema, and
prints per step: what one rank sends (a flush's batch / rows, plus heartbeats
at ``--heartbeat-every`` s and the schema re-sent every 30 s, at 1 step/s) and
what the whole job sends. The model has ``--layers`` parameters per pipeline
stage (a 4-stage model: 4,000). Layouts (outermost first):

* DDP, 16,384 replicas: every rank sends all 4,000 layers (before issue 17), or
  with ``layout="dp=16384"`` one rank does;
* FSDP over 16,384 ranks: every rank sends the norms of its shards;
* ``pp=4,dp=512,tp=8`` with every rank sending its stage's layers (before);
* the same with one replica per model shard sending layers (agent/topology.reports_layers):
  32 reporters, the other 16,352 ranks send loss, lr, skipped and a non-finite flag.

    python benchmarks/layout_bytes_16k.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import COLUMNS, QUIET_COLUMNS, SCHEMA_EVERY_S, layer_names

from gradwatch.wire import Batch, Heartbeat, Schema, encode

WORLD = 16_384


def rank_bytes(
    layers: tuple[str, ...], columns: tuple[str, ...], rows: int, heartbeat_every: float
) -> tuple[float, float, int]:
    """(batch bytes per step, heartbeat bytes per step, schema bytes) of one rank at 1 step/s."""
    schema = Schema(id=0, columns=columns, layers=layers)
    values = np.ones((rows, schema.width), "<f4").tobytes()
    batch = Batch(
        job="pretrain-70b",
        rank=WORLD - 1,
        world=WORLD,
        schema_id=0,
        seq=12345,
        incarnation="3f2a9c1d-16383",
        dropped=0,
        steps=tuple(range(100_000, 100_000 + rows)),
        times=tuple(1.7e9 + i for i in range(rows)),
        values=values,
        shards=8,
    )
    plain = sum(len(f) for f in encode(batch))
    schema_bytes = sum(len(f) for f in encode(replace(batch, schema=schema))) - plain
    hb = Heartbeat(
        job="pretrain-70b",
        rank=WORLD - 1,
        world=WORLD,
        incarnation="3f2a9c1d-16383",
        time=1.7e9,
        step=100_000,
        dropped=0,
        started=100_001,
    )
    return plain / rows, sum(len(f) for f in encode(hb)) / heartbeat_every, schema_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1000, help="parameters per pipeline stage")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--flush-every", type=int, default=10)
    p.add_argument("--heartbeat-every", type=float, default=2.0)
    args = p.parse_args(argv)
    whole = layer_names(args.layers * args.stages)
    stage = layer_names(args.layers)
    fe, hb = args.flush_every, args.heartbeat_every
    kinds = {
        "all layers": rank_bytes(whole, COLUMNS, fe, hb),
        "one stage": rank_bytes(stage, COLUMNS, fe, hb),
        "no layers": rank_bytes((), QUIET_COLUMNS, fe, hb),
    }
    reporters = args.stages * 8
    layouts = [
        ("DDP x16384", [("all layers", WORLD)]),
        ("DDP x16384, one reporter", [("all layers", 1), ("no layers", WORLD - 1)]),
        ("FSDP 16384", [("all layers", WORLD)]),
        ("pp=4,dp=512,tp=8, every rank", [("one stage", WORLD)]),
        (
            "pp=4,dp=512,tp=8, reporters only",
            [("one stage", reporters), ("no layers", WORLD - reporters)],
        ),
    ]
    print(
        f"per rank, per step at 1 step/s (flush every {fe}, heartbeat every {hb:g} s, "
        f"schema re-sent every {SCHEMA_EVERY_S:g} s):"
    )
    print(
        f"{'rank sends':>12}  {'batch B':>9}  {'heartbeat B':>11}  {'schema B':>9}  {'total B':>9}"
    )
    for kind, (batch, beat, schema) in kinds.items():
        print(
            f"{kind:>12}  {batch:9.0f}  {beat:11.0f}  {schema / SCHEMA_EVERY_S:9.0f}  "
            f"{batch + beat + schema / SCHEMA_EVERY_S:9.0f}"
        )
    print("\nper job, per step (16,384 ranks):")
    base = None
    for name, mix in layouts:
        total = sum(n * (kinds[k][0] + kinds[k][1] + kinds[k][2] / SCHEMA_EVERY_S) for k, n in mix)
        values = sum(
            n * (len(whole) if k == "all layers" else len(stage) if k == "one stage" else 0)
            for k, n in mix
        )
        base = base or total
        print(
            f"  {name:>34}: {total / 1e6:8.2f} MB/step, {values:>10,} layer values "
            f"({total / base:.3f} of DDP)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
