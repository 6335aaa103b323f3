"""Fixtures shared by the collector's tests: PUSH sockets to a real server on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from gradwatch.collector.server import Server

Connect = Callable[[Server], "zmq.Socket[Any]"]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """PUSH sockets to a server, all closed (linger 0) and the context ended after the test."""
    ctx: zmq.Context[Any] = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []

    def push_to(server: Server) -> zmq.Socket[Any]:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.bound_endpoint)
        sockets.append(sock)
        return sock

    yield push_to
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
