"""A one-step NaN logged while no collector takes messages still arrives, before any later
step, once one does (agent/holdback.py); what comes after it in the meantime is dropped
and counted, and every step is accounted for at close."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import zmq

import gradwatch
from gradwatch.wire import Batch, Message, Schema, decode
from gradwatch.wire import columns as wc
from tests.agent.receiver import _rows, drain, rebind

WAIT_S = 10.0


def _until(condition: Callable[[], bool], step: Callable[[], None]) -> None:
    """Log healthy steps until ``condition`` holds (``WAIT_S`` at most)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"the condition did not hold in {WAIT_S} s of steps"
        step()


def _wait(condition: Callable[[], bool]) -> None:
    """Wait, logging nothing, until the shipper thread's counters satisfy ``condition``."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"the shipper did not get there in {WAIT_S} s"
        time.sleep(0.01)  # polling another thread's counters; nothing to block on


def _send_failed(mon: gradwatch.Monitor) -> Callable[[], bool]:
    """Whether a send has found no collector: until then ZeroMQ may still take batches
    into the pipe of the closed peer, where they are lost (``stats`` counts them sent)."""
    failed = mon._counters.steps_dropped_send
    return lambda: mon._counters.steps_dropped_send > failed


def _flush_poisoned(step: Callable[[], None]) -> None:
    """Log the poisoned step and two more: with ``flush_every=2`` its batch is flushed."""
    for _ in range(3):
        step()


class Rows:
    """Step rows in the order they arrived, decoded with the schemas seen so far."""

    def __init__(self) -> None:
        self.schemas: dict[int, Schema] = {}
        self.order: list[int] = []
        self.loss: dict[int, float | None] = {}

    def add(self, messages: Sequence[Message]) -> None:
        for msg in messages:
            if not isinstance(msg, Batch) or msg.schema_id == wc.STATS_SCHEMA_ID:
                continue
            if msg.schema is not None:
                self.schemas[msg.schema_id] = msg.schema
            for step, row in _rows(msg, self.schemas[msg.schema_id]).items():
                self.order.append(step)
                self.loss[step] = row.columns.get(wc.LOSS)


def _watched(
    job: str,
) -> tuple[zmq.Context, zmq.Socket, str, torch.nn.Module, torch.optim.Optimizer, gradwatch.Monitor]:
    """A collector's socket on a free port, and a small model watched by an agent sending
    to it in batches of two steps."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model, opt, job=job, endpoint=endpoint, flush_every=2, stats_every=0, heartbeat_every=0.05
    )
    return ctx, sock, endpoint, model, opt, mon


def test_a_nan_no_collector_took_arrives_first_once_one_is_back() -> None:
    ctx, sock, endpoint, model, opt, mon = _watched("held")
    poison = [False]

    def step() -> None:
        loss = model(torch.randn(4, 3)).pow(2).mean()
        loss.backward()
        opt.step()
        # One bad step, as reported; the weights stay finite for the steps after it.
        mon.log(loss=loss.detach() * float("nan") if poison[0] else loss)
        poison[0] = False
        opt.zero_grad()

    rows = Rows()
    try:
        _until(lambda: mon.stats.steps_sent >= 4, step)
        sock.close(linger=0)  # the collector goes away
        _until(_send_failed(mon), step)
        poison[0] = True
        _flush_poisoned(step)
        nan_step = mon.step - 2
        _wait(lambda: mon.stats.steps_held > 0)
        dropped = mon.stats.steps_dropped
        _until(lambda: mon.stats.steps_dropped > dropped, step)  # later batches: dropped
        last_down = mon.step
        # The loop stops logging (it crashed, or hangs); a collector comes back.
        sock = ctx.socket(zmq.PULL)
        sock.linger = 0
        rebind(sock, endpoint)
        deadline = time.monotonic() + WAIT_S
        while nan_step not in rows.loss and time.monotonic() < deadline:
            if sock.poll(100):
                rows.add([decode(sock.recv_multipart())])
        assert nan_step in rows.loss, "the kept NaN batch never arrived"
        for _ in range(6):  # the loop goes on; its steps follow the kept batch
            step()
        mon.close()
        rows.add(drain(sock))
    finally:
        mon.close()
        sock.close(linger=0)
        ctx.term()
    loss = rows.loss[nan_step]
    assert loss is not None and math.isnan(loss)
    after = rows.order[rows.order.index(nan_step) :]
    assert after == sorted(after), after  # nothing overtook it
    assert [s for s in after if s > last_down] == list(range(last_down + 1, mon.step + 1))
    stats = mon.stats
    assert stats.steps_held == 0
    assert stats.steps_sent + stats.steps_dropped == stats.steps_logged


def test_a_kept_batch_that_never_goes_out_is_counted_dropped_at_close() -> None:
    ctx, sock, endpoint, model, opt, mon = _watched("held-lost")
    scale = [1.0]

    def step() -> None:
        loss = model(torch.randn(4, 3)).pow(2).mean() * scale[0]
        mon.log(loss=loss)  # no update: the weights stay finite
        scale[0] = 1.0

    try:
        _until(lambda: mon.stats.steps_sent >= 4, step)
        sock.close(linger=0)  # the collector goes away for good
        _until(_send_failed(mon), step)
        scale[0] = float("inf")
        _flush_poisoned(step)
        _wait(lambda: mon.stats.steps_held > 0)
        held = mon.stats.steps_held
        dropped = mon.stats.steps_dropped
        mon.close()
    finally:
        mon.close()
        sock.close(linger=0)
        ctx.term()
    stats = mon.stats
    assert stats.steps_held == 0
    assert stats.steps_dropped >= dropped + held
    assert stats.steps_sent + stats.steps_dropped == stats.steps_logged
