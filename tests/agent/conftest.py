"""Shared fixtures for agent tests: a real PULL socket standing in for a collector."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def pull() -> Iterator[tuple[zmq.Socket, str]]:
    """A PULL socket bound to a random loopback port, and its endpoint."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()
