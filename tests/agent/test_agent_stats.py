"""Cadence statistics: the weight norms travel as their own batch (plain schedule here;
the early, dense one is in test_agent_cost.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.collector.ingest import Ingest
from gradwatch.wire import MISSING_BITS, Batch, Heartbeat, decode, encode
from gradwatch.wire import columns as wc

WAIT_MS = 5000


def batches(sock: zmq.Socket, n_steps: int, n_stats: int) -> tuple[list[Batch], list[Batch]]:
    steps: list[Batch] = []
    stats: list[Batch] = []
    while sum(len(b.steps) for b in steps) < n_steps or len(stats) < n_stats:
        assert sock.poll(WAIT_MS), "nothing arrived from the agent in time"
        msg = decode(sock.recv_multipart())
        if isinstance(msg, Batch):
            (stats if msg.schema_id == wc.STATS_SCHEMA_ID else steps).append(msg)
    return steps, stats


def test_weight_norms_ship_every_stats_every_steps_and_decode_to_stats(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(
        model,
        opt,
        job="st",
        endpoint=endpoint,
        flush_every=2,
        stats_every=3,
        heartbeat_every=0.05,
        early_stats=False,
    )
    assert sock.poll(WAIT_MS) and isinstance(decode(sock.recv_multipart()), Heartbeat)
    expected = {}
    for step in range(1, 7):
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
        if step % 3 == 0:
            expected[step] = [p.detach().norm().item() for p in model.parameters()]
    mon.close()
    step_batches, stat_batches = batches(sock, 6, 2)
    assert mon.stats.stats_sent == 2 and mon.stats.stats_dropped == 0
    assert sum(len(b.steps) for b in step_batches) == 6  # steps are untouched
    assert [b.steps for b in stat_batches] == [(3,), (6,)]
    first = stat_batches[0]
    assert first.schema is not None and first.schema.columns[0] == wc.WEIGHT_NORMS
    assert first.schema.layers == ("0.weight", "0.bias", "2.weight", "2.bias")
    seqs = sorted(b.seq for b in step_batches + stat_batches)
    assert seqs == list(range(len(seqs)))  # one sequence: the collector sees no gap

    ingest = Ingest()
    decoded = [ingest.feed(encode(b)) for b in stat_batches]
    for out, step in zip(decoded, (3, 6), strict=True):
        (stats,) = out.stats
        assert out.steps == () and stats.step == step and stats.job == "st"
        assert stats.layers == first.schema.layers
        assert stats.weight_norms == pytest.approx(expected[step], rel=1e-5)
    raw = np.frombuffer(first.values, "<u4")
    assert raw[0] == MISSING_BITS  # the marker cell carries no value


def test_stats_every_zero_sends_none_and_negative_is_refused(pull) -> None:
    sock, endpoint = pull
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="stats_every"):
        gradwatch.watch(model, opt, job="st", endpoint=endpoint, stats_every=-1)
    mon = gradwatch.watch(
        model, opt, job="st", endpoint=endpoint, flush_every=1, stats_every=0, heartbeat_every=0.05
    )
    for _ in range(3):
        model(torch.randn(2, 2)).sum().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    assert mon.stats.stats_sent == 0 and mon.stats.steps_logged == 3


@pytest.mark.parametrize("phase_clock", [True, False])
def test_the_first_sample_carries_the_weights_the_run_started_from(pull, phase_clock) -> None:
    # Adam's first update moves every element by about the lr, whatever the gradient: at a
    # lr far too high that alone inflates the weights (minDiffusion at lr x100: x2.4), so
    # the first sample reads the weights before it; later samples read them after theirs.
    # They are read at the first training forward with the phase clock, else at the
    # first gradient read; both come before the first update.
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    initial = [p.detach().norm().item() for p in model.parameters()]
    mon = gradwatch.watch(
        model, opt, job="init", endpoint=endpoint, flush_every=2, phase_clock=phase_clock
    )
    after: dict[int, list[float]] = {}
    for step in range(1, 3):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
        after[step] = [p.detach().norm().item() for p in model.parameters()]
    mon.close()
    _, stat_batches = batches(sock, 2, 2)
    ingest = Ingest()
    got = {s.step: s.weight_norms for b in stat_batches for s in ingest.feed(encode(b)).stats}
    assert got[1] == pytest.approx(initial, rel=1e-5)
    assert got[1] != pytest.approx(after[1], rel=1e-2)  # the update moved them
    assert got[2] == pytest.approx(after[2], rel=1e-5)  # later samples: after their update
