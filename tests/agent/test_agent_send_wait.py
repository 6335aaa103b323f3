"""A full pipe to a peer that was taking messages holds a send briefly; a dead peer does not.

At close, a short loop's last batches, its dense early samples and its exit note go out
within milliseconds, more than ``send_hwm`` messages; before agent/destinations.py waited
for room, the last batch and the note were dropped in about one exit in five
(tests/agent/test_agent_exit_flush.py). Real sockets on loopback, no mock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from gradwatch.agent.destinations import Destination

FRAMES = [b"x" * 65536]  # large, so the kernel's socket buffers fill after a few hundred


@pytest.fixture
def flowing() -> Iterator[tuple[zmq.Socket, Destination]]:
    """A destination whose last send went through, now facing a full pipe."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.setsockopt(zmq.RCVHWM, 1)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    dest = Destination(ctx, f"tcp://127.0.0.1:{port}", hwm=1, curve=None)
    dest.connect()
    deadline = time.monotonic() + 10
    while not dest.send(FRAMES):  # the connection is still being made
        assert time.monotonic() < deadline, "never connected"
        pull.poll(10)  # lets the handshake finish; reads nothing
    # Fill it behind the destination's back until it stays full: ZeroMQ's I/O thread
    # moves messages on into the kernel's buffers until those are full too.
    for _ in range(100_000):
        try:
            dest.sock.send_multipart(FRAMES, flags=zmq.NOBLOCK)
        except zmq.Again:
            if not dest.sock.poll(300, zmq.POLLOUT):
                break
    else:
        pytest.fail("the pipe never filled")
    try:
        yield pull, dest
    finally:
        dest.close(0)
        pull.close(0)
        ctx.term()


def test_without_a_wait_a_full_pipe_refuses_the_send(
    flowing: tuple[zmq.Socket, Destination],
) -> None:
    _, dest = flowing
    assert not dest.send(FRAMES, wait_s=0.0)


def test_a_full_pipe_holds_the_send_until_the_peer_makes_room(
    flowing: tuple[zmq.Socket, Destination],
) -> None:
    pull, dest = flowing

    def drain() -> None:
        while pull.poll(1000):
            pull.recv_multipart()

    # The peer starts reading 0.2 s from now: only a send that waits can get through.
    reader = threading.Timer(0.2, drain)
    reader.start()
    start = time.monotonic()
    try:
        assert dest.send(FRAMES, wait_s=5.0)
        assert time.monotonic() - start >= 0.1
    finally:
        reader.join(10)


def test_a_peer_that_takes_nothing_costs_one_wait_then_sends_fail_at_once(
    flowing: tuple[zmq.Socket, Destination],
) -> None:
    _, dest = flowing
    start = time.monotonic()
    assert not dest.send(FRAMES, wait_s=0.3)
    assert time.monotonic() - start >= 0.25  # it waited once, for nothing
    start = time.monotonic()
    assert not dest.send(FRAMES, wait_s=0.3)
    assert time.monotonic() - start < 0.2  # and not again until a send goes through
