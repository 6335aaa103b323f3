"""A process that exits without ``mon.close()`` still sends its last steps (agent/exit_flush.py).

Each case runs a real training loop in a child process against a real PULL socket. The
child waits until the parent has seen its first heartbeat (the agent's socket is
connected), logs 25 steps (flush_every 10: steps 21-25 sit in the buffer), then ends in
the way the case names, without calling ``close()``.
"""

from __future__ import annotations

import math
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import zmq

import gradwatch
from gradwatch.agent.exit_flush import MAX_REASON_CHARS, exit_note, open_monitors
from gradwatch.wire import Batch, Event, Heartbeat, Schema, decode
from gradwatch.wire import columns as wc
from gradwatch.wire.messages import CLOSED_NOTE
from tests.agent.receiver import receive, wait_connected

WAIT_S = 20.0

CHILD = textwrap.dedent(
    """
    import sys, torch, gradwatch
    end = sys.argv[1]
    if end == "stale":  # an exception an earlier session left there, not this run's
        sys.last_value = ValueError("from before the run")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(model, opt, job="exit", endpoint=sys.argv[2], flush_every=10)
    sys.stdin.readline()  # the parent saw a heartbeat: the socket is connected
    for step in range(25):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if step == 23:
            loss = loss * float("nan")  # the step the loop's own guard dies on below
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    if end == "raise":
        raise RuntimeError("loss is NaN, giving up")
    if end == "interrupt":
        raise KeyboardInterrupt
    # "return": the script just ends
    """
)


def run_child(end: str) -> tuple[int, dict[int, float], list[str]]:
    """The child's exit code, the loss of every step received and the notes it sent."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, end, f"tcp://127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    messages = []
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(m, Heartbeat) for m in messages):
            assert time.monotonic() < deadline, "the child's agent never connected"
            if sock.poll(100):
                messages.append(decode(sock.recv_multipart()))
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        _, stderr = child.communicate(timeout=WAIT_S)
        # Everything the child sent is queued in this socket by the time it exited.
        while sock.poll(200):
            messages.append(decode(sock.recv_multipart()))
    finally:
        child.kill()
        sock.close()
    losses: dict[int, float] = {}
    schemas: dict[int, Schema] = {}
    for msg in messages:
        if not isinstance(msg, Batch) or msg.schema_id == wc.STATS_SCHEMA_ID:
            continue
        if msg.schema is not None:
            schemas[msg.schema_id] = msg.schema
        schema = schemas[msg.schema_id]
        at = schema.columns.index(wc.LOSS)
        floats = struct.unpack(f"<{len(msg.values) // 4}f", msg.values)
        for r, step in enumerate(msg.steps):
            losses[step] = floats[r * schema.width + at]
    notes = [str(m.fields.get("note")) for m in messages if isinstance(m, Event)]
    # The agent said nothing at exit (its log lines start "gradwatch:"), and no
    # thread of it was still running when the interpreter finalised.
    assert "gradwatch:" not in stderr and "terminate called" not in stderr, stderr
    return child.returncode, losses, notes


def test_a_loop_that_dies_by_an_exception_still_sends_its_last_steps() -> None:
    code, losses, notes = run_child("raise")
    assert code == 1
    # Steps 21-25 were in the buffer when the loop raised; step 24 is the NaN.
    assert sorted(losses) == list(range(1, 26))
    assert math.isnan(losses[24])
    # Not the "closed" note: the collector still treats the rank as gone (and pages).
    assert notes == ["exited: RuntimeError: loss is NaN, giving up"]


@pytest.mark.parametrize("end", ["return", "interrupt", "stale"])
def test_a_loop_that_ends_or_is_stopped_without_close_closes_cleanly(end: str) -> None:
    code, losses, notes = run_child(end)
    # An uncaught KeyboardInterrupt ends the process by SIGINT, after the atexit handlers.
    assert code == (-signal.SIGINT if end == "interrupt" else 0)
    assert sorted(losses) == list(range(1, 26))
    assert notes == [CLOSED_NOTE]


def test_a_with_block_that_raises_sends_the_exit_note(pull: tuple[zmq.Socket, str]) -> None:
    sock, endpoint = pull
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(ValueError),
        gradwatch.watch(model, opt, job="with", endpoint=endpoint) as mon,
    ):
        before = wait_connected(sock)
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            mon.log(loss=1.0)
            opt.zero_grad()
        raise ValueError("bad batch")
    got = receive(sock, mon, before)
    assert sorted(got.steps) == [1, 2, 3]
    assert [e.fields.get("note") for e in got.kinds("note")] == ["exited: ValueError: bad batch"]
    assert mon not in open_monitors()


def test_the_exit_note_names_a_failure_and_is_bounded() -> None:
    assert exit_note(None) == CLOSED_NOTE
    assert exit_note(SystemExit(0)) == exit_note(SystemExit()) == CLOSED_NOTE
    assert exit_note(KeyboardInterrupt()) == CLOSED_NOTE
    # Inside a with block a failing exit code is a failure (atexit cannot see the code).
    assert exit_note(SystemExit(1)) == "exited: SystemExit: 1"

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert exit_note(Unprintable()) == "exited: Unprintable: (its message could not be read)"
    long = exit_note(ValueError("x" * 1000))
    assert long.startswith("exited: ValueError: xxx") and len(long) == MAX_REASON_CHARS
