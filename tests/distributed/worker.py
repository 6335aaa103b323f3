"""One rank of a small DDP or FSDP2 training job on CPU (gloo), watched by gradwatch.

Run once per rank by :mod:`tests.distributed.harness`; reads ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the environment.
Before every ``optimizer.step()`` it also computes each layer's *global*
gradient norm the way the job itself sees it, so a test can compare what the
agent put on the wire with the truth. Rank 0 writes those to
``OUT/direct.json`` (``{step: {layer: norm}}``); every rank writes
``OUT/shards{rank}.json`` (``{layer: [local numel, full numel]}``) and, last,
``OUT/rank{rank}.done``.

Example::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m tests.distributed.worker --mode ddp --steps 3 \\
        --endpoint tcp://127.0.0.1:5555 --job demo --out /tmp/gw
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

import gradwatch

IN_FEATURES = 8
WIDTH = 32
BATCH = 16
# Long enough for a stalled rank's peers to wait in their collective, short
# enough that a broken job fails a test instead of hanging it.
PG_TIMEOUT = timedelta(seconds=120)


class Net(nn.Module):
    """Four Linear layers and a LayerNorm, deterministic under a fixed seed.

    FSDP2 shards every parameter along dim 0; with 2 or 3 ranks the sizes
    here give even shards (32 rows over 2), uneven ones (32 rows over 3:
    11, 11, 10) and empty ones (``fc4``'s single output row over 2 or 3).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.fc3 = nn.Linear(WIDTH, WIDTH)
        self.fc4 = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.norm(self.fc2(x)))
        x = torch.relu(self.fc3(x))
        return self.fc4(x)


def rendezvous(rank: int, world: int) -> dist.Store:
    """The env:// rendezvous (MASTER_ADDR, MASTER_PORT), listening on that address only.

    init_process_group's own store would bind every interface; rank 0 binds
    the socket here and hands it over, so the job stays on loopback.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fd = socket.create_server((host, port)).detach() if rank == 0 else None
    return dist.TCPStore(
        host, port, world, rank == 0, PG_TIMEOUT, master_listen_fd=fd, multi_tenant=True
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ddp", "fsdp"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-at", type=int, default=-1, help="step (from 1) whose forward stalls")
    p.add_argument("--stall-seconds", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--nan-rank", type=int, default=-1)
    p.add_argument("--nan-at", type=int, default=-1, help="step (from 1) whose input is NaN")
    return p.parse_args(argv)


def wrap(net: Net, mode: str, world: int) -> tuple[nn.Module, nn.Module]:
    """(the module to train, the module whose parameters the optimizer and agent see)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # The agent gets the inner module: the same parameters, without DDP's
        # "module." prefix, so layer names match the FSDP run's.
        return DistributedDataParallel(net), net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Without a mesh fully_shard builds one on the current accelerator type;
    # a CPU-only job names "cpu" so the gloo group backs it.
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net.fc1, net.fc2, net.fc3, net.fc4):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, net


def global_norms(model: nn.Module, mode: str) -> dict[str, float]:
    """Each layer's whole-gradient L2 norm as the job sees it; collective under FSDP."""
    out: dict[str, float] = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is None:
            continue
        if mode == "fsdp":
            grad = grad.full_tensor()  # an all-gather: every rank must call it, in order
        out[name] = float(grad.float().norm())
    return out


def shard_sizes(model: nn.Module) -> dict[str, list[int]]:
    """``{layer: [numel of this rank's shard, numel of the whole parameter]}``."""
    sizes: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        sizes[name] = [local.numel(), p.numel()]
    return sizes


def main(argv: Sequence[str] | None = None) -> tuple[Path, int]:
    """Run the job; the output folder and this rank, for :func:`finish`."""
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=rendezvous(rank, world), rank=rank, world_size=world, timeout=PG_TIMEOUT
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model, watched = wrap(Net(), args.mode, world)
    params = watched.parameters()
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=0.05)
        if args.optimizer == "sgd"
        else torch.optim.AdamW(params, lr=1e-3)
    )
    mon = gradwatch.watch(
        watched,
        optimizer,
        args.job,
        args.endpoint,
        rank=rank,
        world=world,
        flush_every=2,
        heartbeat_every=0.2,
        stats_every=0,
    )
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    direct: dict[int, dict[str, float]] = {}
    for step in range(1, args.steps + 1):
        if rank == args.slow_rank:
            time.sleep(args.slow_seconds)  # a slow data loader, every step
        if rank == args.stall_rank and step == args.stall_at:
            time.sleep(args.stall_seconds)  # a data loader stuck once; peers wait in a collective
        x = torch.randn(BATCH, IN_FEATURES, generator=data)
        y = torch.randn(BATCH, 1, generator=data)
        if rank == args.nan_rank and step == args.nan_at:
            x = x * float("nan")  # one rank's bad batch: its loss, then every gradient, is NaN
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        direct[step] = global_norms(watched, args.mode)
        optimizer.step()
        mon.log(loss=loss.detach())
        optimizer.zero_grad()
    mon.close()
    args.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (args.out / "direct.json").write_text(json.dumps(direct))
    (args.out / f"shards{rank}.json").write_text(json.dumps(shard_sizes(watched)))
    return args.out, rank


def finish(out: Path, rank: int) -> NoReturn:
    """End a rank whose work is done and written, after ``main`` returned.

    DDP, FSDP and the optimizer sit in reference cycles: collected here, while the
    interpreter is whole, rather than at its finalization, where gloo's threads have
    aborted a finished rank ("terminate called without an active exception": twice in
    CI, 0 in 40 runs here; torch's own fix, pytorch PR 179291, was abandoned). Then the
    group is destroyed, the rank marks itself done, and the process exits without
    finalization: what is left to tear down is torch's, and nothing a test reads.
    """
    gc.collect()
    dist.destroy_process_group()
    (out / f"rank{rank}.done").write_text(str(os.getpid()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    finish(*main())
