"""The priority lane with a real server on loopback: a flagged NaN pages on arrival, once.

Real sockets, a real webhook receiver and the default rules; each rank has its
own PUSH socket, and every wait is bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.priority import RECEIVE_EVERY, Inbox, PriorityLane, Received
from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.server import Server
from gradwatch.wire import Batch, Heartbeat, Schema, encode
from tests.collector.conftest import Connect

LAYERS = ("embed.weight", "fc.weight")
SCHEMA = Schema(1, ("loss", "lr/0"), LAYERS)
NAN = float("nan")


@contextmanager
def running(lane: PriorityLane | None = None, **overrides: Any) -> Iterator[Server]:
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", **overrides)
    server = Server(config, registry=CollectorRegistry())
    if lane is not None:
        server.intake.lane = lane
    server.start()
    try:
        yield server
    finally:
        assert server.stop(10), "the server did not stop within its deadline"


def batch(
    job: str,
    rank: int,
    world: int,
    first: int,
    rows: Sequence[Sequence[float]],
    seq: int,
    *,
    flag: bool = False,
    schema: bool = False,
) -> list[bytes]:
    steps = tuple(range(first, first + len(rows)))
    return encode(
        Batch(
            job,
            rank,
            world,
            SCHEMA.id,
            seq,
            f"inc-{rank}",
            0,
            steps,
            tuple(1000.0 + s for s in steps),
            np.array(rows, "<f4").tobytes(),
            SCHEMA if schema else None,
            shards=world if world > 1 else None,
            nonfinite=flag,
        )
    )


def clean(n: int) -> list[list[float]]:
    return [[2.0, 0.1, 1.0, 0.5]] * n


def latest_step(server: Server, job: str) -> int | None:
    state = server.state.job(job)
    latest = None if state is None else state.ranks[0].latest
    return None if latest is None else latest.step


def firings(bodies: list[Any]) -> list[Any]:
    return [b for b in bodies if b["state"] == "firing"]


class Sender:
    """Sends one message and waits until the server handled it (bounded)."""

    def __init__(self, server: Server) -> None:
        self.server, self.sent = server, 0

    def __call__(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        self.counted()

    def counted(self) -> None:
        self.sent += 1
        assert self.server.wait_for_messages(self.sent, timeout=10)


@contextmanager
def ddp_pair(
    connect: Connect,
) -> Iterator[tuple[WebhookReceiver, Server, Sender, zmq.Socket, zmq.Socket]]:
    """A two-rank job "ddp" judged as a whole, both ranks clean at steps 1-2 (handled);
    yields the receiver, the server, the sender and rank 0's and rank 1's sockets."""
    with WebhookReceiver() as receiver, running(webhooks=[receiver.url]) as server:
        r0, r1 = connect(server), connect(server)
        send = Sender(server)
        send(r0, batch("ddp", 0, 2, 1, clean(2), 0, schema=True))
        send(r1, batch("ddp", 1, 2, 1, clean(2), 0, schema=True))
        yield receiver, server, send, r0, r1


def test_a_flagged_nan_pages_before_its_step_is_assembled_and_only_once(
    connect: Connect,
) -> None:
    with WebhookReceiver() as receiver, running(webhooks=[receiver.url]) as server:
        r0, r1 = connect(server), connect(server)
        send = Sender(server)

        for rank, sock in enumerate((r0, r1)):
            send(sock, encode(Heartbeat("big", rank, 2, f"inc-{rank}", 1000.0, 0, 0)))
        send(r0, batch("big", 0, 2, 1, clean(2), 0, schema=True))
        send(r1, batch("big", 1, 2, 1, clean(2), 0, schema=True))
        assert server.assembler.counts()["big"].steps == 2
        # Rank 0's batch of steps 3-4 has a NaN loss and layer at step 4; rank 1 has not
        # reported steps 3-4, so they cannot be assembled: only the early look can page.
        r0.send_multipart(batch("big", 0, 2, 3, [clean(1)[0], [NAN, 0.1, NAN, 0.5]], 1, flag=True))
        (page,) = receiver.wait_for(lambda got: len(got) >= 1, timeout=10)
        send.counted()
        with server.assembler_lock:
            assert server.assembler.counts()["big"].steps == 2, "paged only after assembly"
        assert (page["state"], page["step"], page["rank"]) == ("firing", 4, 0)
        assert page["category"] == "numerical"
        # Rank 1 completes steps 3 (clean: before the paged step, it resolves nothing)
        # and 4 (the assembled NaN continues the incident), then steps 5-6 are clean.
        send(r1, batch("big", 1, 2, 3, clean(2), 1))
        assert server.assembler.counts()["big"].steps == 4
        send(r0, batch("big", 0, 2, 5, clean(2), 2))
        send(r1, batch("big", 1, 2, 5, clean(2), 2))
        bodies = receiver.wait_for(lambda got: any(b["state"] == "resolved" for b in got), 10)
        (resolved,) = [b for b in bodies if b["state"] == "resolved"]
        assert firings(bodies) == [page], "the assembled verdict must not page again"
        assert resolved["id"] == page["id"] and resolved["rank"] == 0
        assert resolved["evidence"]["paged_early_from_rank"] == 0
        assert resolved["evidence"]["first_bad_rank"] == 0  # assembly agrees
        assert server.intake.lane.outcomes()["paged"] == 1


def test_a_shared_nan_gradient_waits_for_the_assembled_verdict_to_name_its_rank(
    connect: Connect,
) -> None:
    # DDP: rank 1's batch went NaN at step 4, the reduce spread NaN gradients to rank 0 too,
    # and step 5's loss is NaN everywhere (the NaN update was applied on every rank). Rank 0's
    # report arrives first: paging it early, at step 4 (finite loss) or at step 5 (its NaN
    # loss), would blame rank 0 by arrival order (seen in the gloo test).
    with ddp_pair(connect) as (receiver, server, send, r0, r1):
        after = [NAN, 0.1, NAN, NAN]
        send(r0, batch("ddp", 0, 2, 3, [clean(1)[0], [2.0, 0.1, NAN, NAN], after], 1, flag=True))
        assert server.intake.lane.outcomes()["shared"] == 1
        assert receiver.bodies == [], "a shared NaN gradient must not page before assembly"
        send(r1, batch("ddp", 1, 2, 3, [clean(1)[0], [NAN, 0.1, NAN, NAN], after], 1, flag=True))
        (page,) = firings(receiver.wait_for(lambda got: len(got) >= 1, timeout=10))
        assert (page["step"], page["rank"]) == (4, 1)  # where the loss went bad
        assert server.intake.lane.outcomes()["paged"] == 1  # rank 1's own NaN loss


def test_a_flush_that_opens_on_a_nan_loss_pages_only_after_a_clean_step_of_its_rank(
    connect: Connect,
) -> None:
    # A batch's first row has no row before it in the batch: the rank's latest handled step
    # says whether the NaN loss was born there (a clean step before it) or is the NaN update
    # the reduce shared coming back as loss (NaN gradients the step before).
    with ddp_pair(connect) as (receiver, server, send, r0, r1):
        send(r0, batch("ddp", 0, 2, 3, [[2.0, 0.1, NAN, NAN]], 1, flag=True))
        send(r0, batch("ddp", 0, 2, 4, [[NAN, 0.1, NAN, NAN]], 2, flag=True))
        assert server.intake.lane.outcomes()["shared"] == 2
        assert receiver.bodies == [], "rank 0's NaN loss follows its NaN gradients"
        send(r1, batch("ddp", 1, 2, 3, [[NAN, 0.1, NAN, NAN]], 1, flag=True))
        assert server.intake.lane.outcomes()["paged"] == 1  # after rank 1's clean step 2
        (page,) = firings(receiver.wait_for(lambda got: len(got) >= 1, timeout=10))
        assert (page["step"], page["rank"]) == (3, 1)


def test_a_flag_on_finite_values_pages_nothing(connect: Connect) -> None:
    with WebhookReceiver() as receiver, running(webhooks=[receiver.url]) as server:
        sock = connect(server)
        sock.send_multipart(batch("solo", 0, 1, 1, clean(2), 0, schema=True))
        assert server.wait_for_messages(1, timeout=10)
        sock.send_multipart(batch("solo", 0, 1, 3, clean(2), 1, flag=True))
        assert server.wait_for_messages(2, timeout=10)
        assert server.intake.lane.outcomes()["finite"] == 1  # looked at, nothing non-finite
        assert server.pipeline.firing() == [] and receiver.bodies == []
        assert latest_step(server, "solo") == 4  # and it was handled in turn


def test_a_sender_flagging_every_batch_gets_bounded_priority_counted_and_named(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    # A frozen clock: the buckets never refill, so the bound is exactly the burst.
    lane = PriorityLane(rate=1.0, burst=3.0, clock=lambda: 0.0)
    with WebhookReceiver() as receiver, running(lane, webhooks=[receiver.url]) as server:
        flood, honest = connect(server), connect(server)
        honest.send_multipart(batch("honest", 0, 1, 1, clean(1), 0, schema=True))
        flood.send_multipart(batch("flood", 0, 1, 1, clean(1), 0, schema=True))
        assert server.wait_for_messages(2, timeout=10)
        n = 40
        with caplog.at_level(logging.WARNING, logger="gradwatch.collector.priority"):
            for i in range(n):
                flood.send_multipart(batch("flood", 0, 1, 2 + i, clean(1), 1 + i, flag=True))
            honest.send_multipart(batch("honest", 0, 1, 2, [[NAN, 0.1, NAN, 0.5]], 1, flag=True))
            assert server.wait_for_messages(2 + n + 1, timeout=20)
            (page,) = receiver.wait_for(lambda got: len(got) >= 1, timeout=10)
        outcomes = lane.outcomes()
        assert outcomes["over_share"] == n - 3  # the flood's looks stop at its burst
        assert outcomes["finite"] + outcomes["unread"] == 3
        assert outcomes["paged"] == 1  # the honest sender keeps its own share
        assert lane.over_share() == [("flood", n - 3)]
        assert (page["job"], page["state"], page["step"]) == ("honest", "firing", 2)
        assert any("'flood'" in r.getMessage() for r in caplog.records), "name who flagged"
        # Every flooded batch was still handled, in turn: nothing is lost.
        assert latest_step(server, "flood") == n + 1
        exposed = generate_latest(server.registry).decode()
        assert f'gradwatch_ingest_priority_total{{outcome="over_share"}} {n - 3}.0' in exposed
        assert (
            f'gradwatch_ingest_priority_over_share_by_sender_total{{sender="flood"}} {n - 3}.0'
            in exposed
        )


def test_the_lane_refills_at_its_rate() -> None:
    now = [0.0]
    lane = PriorityLane(rate=2.0, burst=2.0, clock=lambda: now[0])
    assert [lane.take("a") for _ in range(3)] == [True, True, False]
    now[0] = 0.5  # one token back
    assert [lane.take("a"), lane.take("a"), lane.take("b")] == [True, False, True]
    assert lane.outcomes()["over_share"] == 2


def _received(nbytes: int) -> Received:
    return Received(parts=(), head=b"", header=None, sender="", nbytes=nbytes)


def test_the_inbox_is_bounded_by_count_and_bytes_and_shrinks_over_the_memory_bound() -> None:
    inbox = Inbox(max_messages=1_000, max_bytes=10_000)
    while inbox.room():
        inbox.put(_received(100))
    assert len(inbox) == 100  # the byte bound, not the count, stopped it
    inbox.squeezed = True  # the process went over max_memory_bytes: one receive's worth
    assert not inbox.room()
    while len(inbox) >= RECEIVE_EVERY:
        inbox.pop()
    assert inbox.room()
    inbox.put(_received(100))
    assert not inbox.room()


def test_the_lookahead_is_a_share_of_the_memory_bound() -> None:
    # The inbox sits on top of what max_memory_bytes gates (new jobs and ranks): a small
    # bound gets a small lookahead, so a flood cannot carry the process past it.
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", max_memory_bytes=320 * 2**20),
        registry=CollectorRegistry(),
        sinks=[],
    )
    assert server.intake.inbox.max_bytes == 20 * 2**20
