"""One rank of a job under a declared layout, paced by a shared clock, for the takeover test.

No collective: each rank trains its own copy of a small model on the batch of
its step number (seeded by the number, so replicas hold the same gradients, as
after a data-parallel all-reduce) and logs that number, paced so that every
rank logs step ``n`` about ``t0 + n * step_s``. A rank started late (a restart)
begins at the step the others are at, and a rank that fell behind logs its
missed steps at once, in order: no step is skipped. Runs until ``--stop-file``
exists or ``--until`` (epoch seconds) passes, then closes its monitor.

The command key comes from ``$GRADWATCH_COMMAND_KEY``; ``RANK`` and
``WORLD_SIZE`` from the environment (tests/distributed/harness.py sets them).

Example::

    RANK=0 WORLD_SIZE=4 GRADWATCH_COMMAND_KEY=... python -m tests.distributed.takeover_worker \\
        --endpoint tcp://127.0.0.1:5555 --command-endpoint tcp://127.0.0.1:5556 \\
        --job demo --layout dp=2,tp=2 --t0 1700000000 --step-s 0.1 \\
        --until 1700000090 --stop-file /tmp/stop
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import gradwatch

LAYERS = ("0.weight", "0.bias", "2.weight", "2.bias")  # the model's, in order


def model() -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--command-endpoint", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--t0", type=float, required=True)
    parser.add_argument("--step-s", type=float, required=True)
    parser.add_argument("--until", type=float, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    mon = gradwatch.watch(
        net,
        opt,
        job=args.job,
        endpoint=args.endpoint,
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        layout=args.layout,
        flush_every=2,
        heartbeat_every=0.25,
        stats_every=0,
        command_endpoint=args.command_endpoint,
        command_key=os.environ["GRADWATCH_COMMAND_KEY"],
    )
    # The step the job is at now: a restarted rank joins there.
    step = max(1, math.floor((time.time() - args.t0) / args.step_s))
    with mon:
        while time.time() < args.until and not args.stop_file.exists():
            due = args.t0 + step * args.step_s
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)  # pacing to the shared clock, not waiting for a result
            x, y = batch(step)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            mon.log(step=step, loss=loss)
            opt.zero_grad()
            step += 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
