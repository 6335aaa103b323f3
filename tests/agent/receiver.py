"""Everything a closed monitor sent, read back from a real PULL socket and decoded by step."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import zmq

import gradwatch
from gradwatch.agent import AgentConfig
from gradwatch.wire import MISSING_BITS, Batch, Event, Heartbeat, Message, Schema, decode
from gradwatch.wire import columns as wc

WAIT_S = 10.0


def batch_config(job: str, endpoint: str, **overrides: object) -> AgentConfig:
    """A rank-0 agent flushing every 4 steps, with host buffers for every batch of a short
    run (the agent drops rather than wait when a busy machine starves the shipper, and
    the tests using this are about values, not that policy), and no early statistics."""
    settings: dict[str, object] = {
        "flush_every": 4,
        "heartbeat_every": 0.05,
        "pool_size": 16,
        "early_stats": False,
    }
    settings.update(overrides)
    return AgentConfig(job=job, rank=0, world=1, endpoint=endpoint, **settings)  # type: ignore[arg-type]  # the overrides are AgentConfig fields


@dataclass
class Row:
    """One step as it arrived: its columns (NaN-free floats or None when MISSING) and layers."""

    incarnation: str
    columns: dict[str, float | None]
    layers: list[float | None]


@dataclass
class Received:
    layers: tuple[str, ...] = ()
    steps: dict[int, Row] = field(default_factory=dict)  # the last incarnation wins
    step_order: list[int] = field(default_factory=list)  # as they arrived
    stats_steps: list[int] = field(default_factory=list)
    # Cadence statistics by step: columns (update ratios, activations) and weight norms.
    stats: dict[int, Row] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def kinds(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


def wait_connected(sock: zmq.Socket) -> list[Message]:
    """Wait for a heartbeat, which proves the agent's PUSH socket is connected (nothing sent
    from then on is dropped); returns the messages read, for :func:`receive`."""
    seen: list[Message] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if sock.poll(100):
            seen.append(decode(sock.recv_multipart()))
            if isinstance(seen[-1], Heartbeat):
                return seen
    raise AssertionError("the agent never connected")


def receive(sock: zmq.Socket, mon: gradwatch.Monitor, before: list[Message]) -> Received:
    """Every message ``mon`` (closed) sent, as its counters account for them: ``before``
    (read by :func:`wait_connected`) and the rest, read from ``sock``."""
    s = mon.stats
    expected = s.batches_sent + s.stats_sent + s.heartbeats_sent + s.events_sent
    out = Received()
    schemas: dict[int, Schema] = {}
    pending = list(before)
    got = 0
    deadline = time.monotonic() + WAIT_S
    while got < expected:
        if pending:
            msg = pending.pop(0)
        else:
            assert time.monotonic() < deadline, f"got {got} of the {expected} messages sent"
            if not sock.poll(100):
                continue
            msg = decode(sock.recv_multipart())
        got += 1
        if isinstance(msg, Event):
            out.events.append(msg)
        elif isinstance(msg, Batch):
            if msg.schema is not None:
                schemas[msg.schema_id] = msg.schema
            if msg.schema_id == wc.STATS_SCHEMA_ID:
                out.stats_steps.extend(msg.steps)
                out.stats.update(_rows(msg, schemas[msg.schema_id]))
                continue
            rows = _rows(msg, schemas[msg.schema_id])
            out.layers = schemas[msg.schema_id].layers
            out.steps.update(rows)
            out.step_order.extend(rows)
    return out


def _rows(batch: Batch, schema: Schema) -> dict[int, Row]:
    n = len(batch.values) // 4
    floats = struct.unpack(f"<{n}f", batch.values)
    bits = struct.unpack(f"<{n}I", batch.values)

    def value(i: int) -> float | None:
        return None if bits[i] == MISSING_BITS else floats[i]

    out = {}
    for r, step in enumerate(batch.steps):
        base = r * schema.width
        columns = {c: value(base + i) for i, c in enumerate(schema.columns)}
        layers = [value(i) for i in range(base + len(schema.columns), base + schema.width)]
        out[step] = Row(batch.incarnation, columns, layers)
    return out


def rebind(sock: zmq.Socket, endpoint: str, timeout: float = 10.0) -> None:
    """ZeroMQ releases a closed socket's port on its I/O thread, after close()
    returns: until then a bind to the same port fails with EADDRINUSE."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def drain(sock: zmq.Socket) -> list[Message]:
    """Everything the agent still sends, until it has been quiet for half a second (10 s
    at most)."""
    got: list[Message] = []
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and sock.poll(500):
        got.append(decode(sock.recv_multipart()))
    return got
