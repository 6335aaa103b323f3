"""A parallel layout (agent/topology.py) decides which rank sends per-layer norms.

Under data parallelism the replicas hold the same gradients after the reduce,
so one replica per model shard reports the layers; the others send what only
they know: their loss, whether any of their gradients is NaN/Inf, their step
phases and heartbeats.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import gradwatch
from gradwatch.wire import columns as wc
from tests.agent.receiver import Received, receive, wait_connected

NONFINITE = wc.scalar(wc.GRAD_NONFINITE_SCALAR)


def run(pull, rank: int, poison_at: int | None = None, steps: int = 6) -> Received:
    """Train a small model as ``rank`` of a two-replica job; NaN gradients at ``poison_at``."""
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model,
        opt,
        job="layout",
        endpoint=endpoint,
        rank=rank,
        world=2,
        layout={"dp": 2},
        flush_every=2,
        stats_every=2,
        heartbeat_every=0.05,
    )
    seen = wait_connected(sock)
    assert mon.config.shards == 1
    for step in range(1, steps + 1):
        loss = model(torch.randn(16, 4)).square().mean()
        loss.backward()
        if step == poison_at:
            model[0].weight.grad[0, 0] = math.nan
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    mon.close()
    assert mon.stats.disabled is None
    return receive(sock, mon, seen)


def test_the_first_replica_reports_layers_as_without_a_layout(pull) -> None:
    got = run(pull, rank=0)
    assert got.layers == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert sorted(got.steps) == [1, 2, 3, 4, 5, 6]
    assert all(len(row.layers) == 4 and None not in row.layers for row in got.steps.values())
    assert got.stats_steps  # cadence statistics as usual


def test_another_replica_sends_loss_and_a_nonfinite_flag_but_no_layers(pull) -> None:
    got = run(pull, rank=1, poison_at=4)
    assert got.layers == ()
    assert sorted(got.steps) == [1, 2, 3, 4, 5, 6]
    flags = {step: row.columns.get(NONFINITE) for step, row in got.steps.items()}
    assert flags == {1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 1.0, 6: 1.0}  # NaN weights after 4
    assert all(row.layers == [] for row in got.steps.values())
    assert all(row.columns.get(wc.LOSS) is not None for step, row in got.steps.items() if step < 4)
    assert got.stats_steps == []  # its reporter's statistics stand for it


def test_the_default_heartbeat_slows_with_the_world_so_a_large_job_beats_2048_a_second() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    periods = {}
    for world in (1, 4096, 16384):
        mon = gradwatch.watch(
            model, opt, job="hb", endpoint="tcp://127.0.0.1:1", rank=0, world=world
        )
        periods[world] = mon.config.heartbeat_every
        mon.close()
    assert periods == {1: 2.0, 4096: 2.0, 16384: 8.0}
    explicit = gradwatch.watch(
        model, opt, job="hb", endpoint="tcp://127.0.0.1:1", rank=0, world=16384, heartbeat_every=1.0
    )
    assert explicit.config.heartbeat_every == 1.0
    explicit.close()
