"""One agent feeds both collectors of an HA pair (agent/destinations.py).

A PUSH socket connected to two endpoints deals messages out between them; the agent
instead keeps one socket per endpoint and sends every message to each, so both
collectors see every step. Real sockets on loopback; every wait is a condition with a
deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

import gradwatch
from gradwatch.wire import Batch, Event, Heartbeat, Message, decode
from gradwatch.wire import columns as wc
from tests.agent.receiver import rebind

WAIT_S = 15.0


class Pull:
    """A bound PULL socket and everything it received, decoded."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str | None = None) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.linger = 0
        if endpoint is None:
            self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:  # a collector back on its old port
            self.endpoint = endpoint
            rebind(self.sock, endpoint, WAIT_S)
        self.got: list[Message] = []

    def drain(self) -> None:
        while self.sock.poll(0):
            self.got.append(decode(self.sock.recv_multipart()))

    def steps(self) -> list[int]:
        return [
            s
            for m in self.got
            if isinstance(m, Batch) and m.schema_id != wc.STATS_SCHEMA_ID
            for s in m.steps
        ]


def wait_until(pulls: list[Pull], done: Callable[[], bool]) -> bool:
    poller = zmq.Poller()
    for p in pulls:
        poller.register(p.sock, zmq.POLLIN)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for p in pulls:
            p.drain()
        if done():
            return True
        poller.poll(50)  # wakes on the next message, or re-checks after 50 ms
    return False


@pytest.fixture
def pulls() -> Iterator[Callable[..., Pull]]:
    """Makes bound PULL sockets; closes every one of them after the test."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made: list[Pull] = []

    def make(endpoint: str | None = None) -> Pull:
        made.append(Pull(context, endpoint))
        return made[-1]

    yield make
    for p in made:
        p.sock.close(linger=0)
    context.term()


Watched = tuple[gradwatch.Monitor, torch.nn.Module, torch.optim.Optimizer]


def watched(endpoint: str) -> Watched:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(model, opt, job="ha", endpoint=endpoint, flush_every=5)
    return mon, model, opt


def train(run: Watched, steps: int) -> None:
    mon, model, opt = run
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()


def test_every_message_reaches_both_collectors_of_a_pair(pulls: Callable[..., Pull]) -> None:
    a, b = pulls(), pulls()
    run = watched(f"{a.endpoint}, {b.endpoint}")
    mon = run[0]
    both_up = wait_until(
        [a, b], lambda: all(any(isinstance(m, Heartbeat) for m in p.got) for p in (a, b))
    )
    assert both_up, "the agent never connected to both collectors"
    train(run, 20)
    mon.close()
    assert wait_until([a, b], lambda: len(a.steps()) == 20 and len(b.steps()) == 20)
    assert a.steps() == b.steps() == list(range(1, 21))
    for p in (a, b):  # each learnt the schema: its first batch carried it
        first = next(m for m in p.got if isinstance(m, Batch))
        assert first.schema is not None and first.schema.layers == (
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
        )
        notes = [m.fields.get("note") for m in p.got if isinstance(m, Event)]
        assert notes == ["closed"]
    assert mon.stats.steps_sent == 20 and mon.stats.steps_dropped == 0


def test_a_collector_that_is_down_does_not_hold_back_the_other(
    pulls: Callable[..., Pull],
) -> None:
    up, down = pulls(), pulls()
    down_endpoint = down.endpoint
    down.sock.close(linger=0)  # nothing listens there: its socket never connects
    run = watched(f"{down_endpoint},{up.endpoint}")
    mon = run[0]
    assert wait_until([up], lambda: any(isinstance(m, Heartbeat) for m in up.got))
    train(run, 10)
    mon.close()
    assert wait_until([up], lambda: len(up.steps()) == 10)
    assert up.steps() == list(range(1, 11))
    assert mon.stats.steps_sent == 10  # sent: one collector of the pair took each


def test_a_restarted_collector_of_the_pair_relearns_the_schema(
    pulls: Callable[..., Pull],
) -> None:
    # Each collector has its own schema state: the one that restarted gets the schema
    # again with its next batch, the one that stayed up does not need it.
    stays, restarts = pulls(), pulls()
    run = watched(f"{stays.endpoint},{restarts.endpoint}")
    mon = run[0]
    assert wait_until(
        [stays, restarts],
        lambda: all(any(isinstance(m, Heartbeat) for m in p.got) for p in (stays, restarts)),
    )
    train(run, 5)  # one batch each, with the schema
    assert wait_until([stays, restarts], lambda: len(stays.steps()) == len(restarts.steps()) == 5)
    restarts.sock.close(linger=0)  # the collector goes away and comes back on the same port
    back = pulls(restarts.endpoint)
    assert wait_until([back], lambda: any(isinstance(m, Heartbeat) for m in back.got))
    train(run, 5)
    mon.close()
    assert wait_until([stays, back], lambda: len(stays.steps()) == 10 and len(back.steps()) == 5)
    stays_batches = [
        m for m in stays.got if isinstance(m, Batch) and m.schema_id != wc.STATS_SCHEMA_ID
    ]
    back_batches = [
        m for m in back.got if isinstance(m, Batch) and m.schema_id != wc.STATS_SCHEMA_ID
    ]
    assert [b.schema is not None for b in stays_batches] == [True, False]
    assert [b.schema is not None for b in back_batches] == [True]


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("tcp://127.0.0.1:1,collector-b:5555", "ZeroMQ address"),
        (",".join(f"tcp://127.0.0.1:{p}" for p in range(1, 6)), "at most 4"),
        ("tcp://127.0.0.1:1, tcp://127.0.0.1:1", "twice"),
    ],
)
def test_a_bad_endpoint_list_says_what_to_do(endpoint: str, message: str) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        gradwatch.watch(model, opt, job="ha", endpoint=endpoint)
