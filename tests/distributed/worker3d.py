"""One rank of a small pipeline- or tensor-parallel job with data parallelism, on CPU (gloo).

Run once per rank by :mod:`tests.distributed.harness` (``--mode pp`` or
``--mode tp``, 4 ranks):

* ``pp``: layout ``pp=2,dp=2`` (ranks 0, 1 are stage 0; 2, 3 stage 1). Stage 0
  holds ``fc1``, ``norm``, ``fc2``; stage 1 ``fc3``, ``fc4`` and the loss. One
  micro-batch per step: stage 0 sends its activation to the stage-1 rank of its
  replica, which sends the activation's gradient back.
* ``tp``: layout ``dp=2,tp=2`` on a DeviceMesh ``("dp", "tp")``: ``fc1`` column-
  and ``fc2`` row-parallel DTensors (``fc2`` without a bias), after a plain
  ``norm`` (LayerNorm) that every TP rank holds whole: its norm goes out as
  norm/sqrt(2) from each (agent/topology.share_scales).

With ``--declare`` the agent is told the layout (``watch(layout=...)``), so only
replica 0 of each model shard sends per-layer norms; without it every rank sends.

Gradients are averaged across the replicas with an explicit all-reduce (what
DDP does). Before every ``optimizer.step()`` each rank computes the global norm
of the layers it holds, as the job sees them (``full_tensor()`` for DTensors),
and writes ``OUT/direct{rank}.json`` (``{step: {layer: norm}}``) at the end,
then ``OUT/rank{rank}.done``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradwatch
from gradwatch.agent.topology import parse_layout
from tests.distributed.worker import (
    BATCH,
    IN_FEATURES,
    PG_TIMEOUT,
    WIDTH,
    Net,
    finish,
    rendezvous,
)

LAYOUTS = {"pp": "pp=2,dp=2", "tp": "dp=2,tp=2"}


class Part(nn.Module):
    """Some of :class:`Net`'s submodules under their own names, so layer names stay global."""

    def __init__(self, net: Net, names: Sequence[str]) -> None:
        super().__init__()
        self.names = tuple(names)
        for name in names:
            setattr(self, name, getattr(net, name))


class Stage0(Part):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        return torch.relu(self.norm(self.fc2(x)))


class Stage1(Part):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc4(torch.relu(self.fc3(x)))


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(IN_FEATURES)  # left whole on every TP rank: a copy
        self.fc1 = nn.Linear(IN_FEATURES, WIDTH)
        self.fc2 = nn.Linear(WIDTH, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--declare", type=int, default=0, help="1: watch(layout=...)")
    return p.parse_args(argv)


def average(params: Sequence[nn.Parameter], group: dist.ProcessGroup, replicas: int) -> None:
    """Average the local gradients across ``group`` (the data-parallel replicas), as DDP does."""
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(grad, group=group)
        grad /= replicas


def norms(model: nn.Module) -> dict[str, float]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = float(grad.float().norm())  # full_tensor: a collective, in order
    return out


def main(argv: Sequence[str] | None = None) -> tuple[Path, int]:
    """Run the job; the output folder and this rank, for :func:`finish`."""
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=rendezvous(rank, world), rank=rank, world_size=world, timeout=PG_TIMEOUT
    )
    layout = parse_layout(LAYOUTS[args.mode])
    coords = layout.coords(rank)
    torch.manual_seed(0)  # the same initial weights on every rank
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "pp":
        net = Net()
        stage = coords["pp"]
        model: nn.Module = (
            Stage0(net, ("fc1", "norm", "fc2")) if stage == 0 else Stage1(net, ("fc3", "fc4"))
        )
        peer = rank + 2 if stage == 0 else rank - 2  # the other stage of this replica
        # Every rank creates every group, in the same order (new_group is collective).
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_group = groups[stage]
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(
            TPNet(), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        dp_group = mesh["dp"].get_group()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05)
    mon = gradwatch.watch(
        model,
        optimizer,
        args.job,
        args.endpoint,
        rank=rank,
        world=world,
        flush_every=2,
        heartbeat_every=0.2,
        stats_every=0,
        layout=LAYOUTS[args.mode] if args.declare else None,
    )
    data = torch.Generator().manual_seed(1000 + coords.get("dp", 0))  # one batch per replica
    direct: dict[int, dict[str, float]] = {}
    for step in range(1, args.steps + 1):
        x = torch.randn(BATCH, IN_FEATURES, generator=data)
        y = torch.randn(BATCH, 1, generator=data)
        loss: torch.Tensor | None = None
        if args.mode == "tp":
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        elif coords["pp"] == 0:
            h = model(x)
            dist.send(h.detach(), peer)
            grad = torch.empty_like(h)
            dist.recv(grad, peer)
            h.backward(grad)
        else:
            h = torch.empty(BATCH, WIDTH)
            dist.recv(h, peer)
            h.requires_grad_(True)
            loss = nn.functional.mse_loss(model(h), y)
            loss.backward()
            assert h.grad is not None
            dist.send(h.grad, peer)
        average(params, dp_group, 2)
        direct[step] = norms(model)
        optimizer.step()
        if loss is None:
            mon.log()
        else:
            mon.log(loss=loss.detach())
        optimizer.zero_grad()
    mon.close()
    (args.out / f"direct{rank}.json").write_text(json.dumps(direct))
    return args.out, rank


if __name__ == "__main__":
    finish(*main())  # tests/distributed/worker.py: why a finished rank exits this way
