"""AMP: a step GradScaler skips for overflow is still reported, marked skipped."""

from __future__ import annotations

import math
import struct

import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.wire import Batch, Heartbeat, Schema, decode
from gradwatch.wire import columns as wc


def receive_rows(sock: zmq.Socket, n_steps: int) -> dict[int, tuple[dict[str, float], list[float]]]:
    schemas: dict[int, Schema] = {}
    out: dict[int, tuple[dict[str, float], list[float]]] = {}
    while len(out) < n_steps:
        assert sock.poll(5000), "no batch arrived in time"
        msg = decode(sock.recv_multipart())
        if not isinstance(msg, Batch) or msg.schema_id == wc.STATS_SCHEMA_ID:  # steps only
            continue
        if msg.schema is not None:
            schemas[msg.schema.id] = msg.schema
        schema = schemas[msg.schema_id]
        values = struct.unpack(f"<{len(msg.values) // 4}f", msg.values)
        for r, step in enumerate(msg.steps):
            row = values[r * schema.width : (r + 1) * schema.width]
            out[step] = (
                dict(zip(schema.columns, row, strict=False)),
                list(row[len(schema.columns) :]),
            )
    return out


def test_skipped_step_is_reported_with_non_finite_norms(pull):
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = gradwatch.watch(
        model, opt, job="amp", endpoint=endpoint, flush_every=2, scaler=scaler, heartbeat_every=0.05
    )
    assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), Heartbeat)
    overflow_at = 3  # the third step (steps count from 1)
    for i in range(4):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        if i + 1 == overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)  # skips opt.step() when it finds the inf: no pre-hook
        scaler.update()
        mon.log(loss=loss)
        opt.zero_grad()
    mon.close()

    table = receive_rows(sock, 4)
    assert [table[s][0]["skipped"] for s in range(1, 5)] == [0.0, 0.0, 1.0, 0.0]
    cols, layers = table[overflow_at]
    assert math.isinf(layers[0])  # the layer that overflowed
    assert all(math.isfinite(v) for v in layers[1:])
    assert all(all(math.isfinite(v) for v in table[s][1]) for s in (1, 2, 4))
    assert math.isfinite(cols["loss"])
    # The scale is read at log() (after update()): halved by the overflow.
    assert table[2][0]["loss_scale"] == 1024.0
    assert table[overflow_at][0]["loss_scale"] == 512.0
    assert mon.stats.steps_logged == 4


def test_scaler_before_first_scale_has_no_loss_scale_yet(pull):
    sock, endpoint = pull
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    mon = gradwatch.watch(
        model,
        opt,
        job="amp0",
        endpoint=endpoint,
        flush_every=1,
        scaler=scaler,
        heartbeat_every=0.05,
    )
    assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), Heartbeat)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # the scaler was never used: its _scale is still None
    mon.log(loss=1.0)
    mon.close()
    cols, _ = receive_rows(sock, 1)[1]
    assert math.isnan(cols["loss_scale"]) and cols["skipped"] == 0.0
