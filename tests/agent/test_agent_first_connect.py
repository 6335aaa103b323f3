"""A loop's first steps, logged before the agent's connection to its collector is made,
still arrive: the shipper waits for the first connection (``FIRST_CONNECT_WAIT_S``, on
its own thread, once), so a bad init's NaN at step 1 is not dropped unseen."""

from __future__ import annotations

import threading
import time

import torch
import zmq

import gradwatch
from gradwatch.agent.destinations import FIRST_CONNECT_WAIT_S
from gradwatch.wire import Batch
from tests.agent.receiver import drain


def test_steps_logged_before_the_collector_listens_arrive_once_it_does() -> None:
    ctx = zmq.Context()
    probe = ctx.socket(zmq.PULL)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # a free port nobody listens on yet
    endpoint = f"tcp://127.0.0.1:{port}"
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(model, opt, job="late", endpoint=endpoint, flush_every=2, stats_every=0)
    began = time.monotonic()
    for step in range(6):  # a NaN at the first step, before anything listens
        loss = model(torch.randn(4, 3)).pow(2).mean() * (float("nan") if step == 0 else 1.0)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    sock = ctx.socket(zmq.PULL)  # the collector comes up now, after the steps
    sock.linger = 0
    sock.bind(endpoint)
    logged_s = time.monotonic() - began
    closing = threading.Thread(target=mon.close)
    closing.start()
    got = drain(sock)
    closing.join()
    sock.close(linger=0)
    ctx.term()
    steps = sorted(s for m in got if isinstance(m, Batch) for s in m.steps)
    assert logged_s < FIRST_CONNECT_WAIT_S  # else the test proves nothing
    assert steps == [1, 2, 3, 4, 5, 6], steps
    assert mon.stats.steps_dropped == 0
