"""A receiver that is down for a stretch, then back: every alert arrives exactly once per id.

Real HTTP on loopback (the stdlib transport and ``WebhookReceiver``), the real
outbox; only the backoff is shortened so the outage lasts a fraction of a second.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import zmq
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.server import Server
from gradwatch.collector.signing import decode_secret, verify
from gradwatch.collector.webhook import RetryPolicy, WebhookChannel
from gradwatch.rules import Alert, Transition
from gradwatch.wire import Batch, Schema, encode

FAST = RetryPolicy(base_delay=0.02, max_delay=0.2)
INCIDENTS = 5
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def firing(step: int) -> Transition:
    alert = Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job=f"run-{step}",
        state="firing",
        step=step,
        summary="loss is nan",
        started_at=1.0,
        rank=0,
    )
    return Transition(alert, "pending", "firing")


def resolving(t: Transition) -> Transition:
    return Transition(replace(t.alert, state="resolved", resolved_at=2.0), "firing", "resolved")


@contextmanager
def sink_to(url: str) -> Iterator[OutboxSink]:
    sink = OutboxSink("webhook-0", WebhookChannel(url, timeout=2.0), retry=FAST)
    sink.start()
    try:
        yield sink
    finally:
        sink.close(timeout=10)
        assert not sink.alive()


def test_a_receiver_answering_503_gets_everything_once_when_it_recovers() -> None:
    with WebhookReceiver() as receiver, sink_to(receiver.url) as sink:
        receiver.fail_with(503)
        transitions = [firing(step) for step in range(INCIDENTS)]
        for t in transitions:
            sink.notify(t)
        receiver.wait_for_attempts(3 * INCIDENTS, timeout=20)  # every alert failed a few times
        for t in transitions:
            sink.notify(resolving(t))
        receiver.fail_with(None)
        stats = sink.wait_for(lambda s: s.delivered == 2 * INCIDENTS, timeout=20)
        ids = [r.headers["webhook-id"] for r in receiver.requests]
        assert Counter(ids) == Counter(
            f"{t.alert.id}:{state}" for t in transitions for state in ("firing", "resolved")
        )
        failed_attempts = sum(a.status == 503 for a in receiver.attempts)
        assert stats.retries == failed_attempts >= 3 * INCIDENTS
        assert (stats.failed, stats.dropped, stats.queued) == (0, 0, 0)


def test_a_receiver_refusing_connections_gets_everything_once_when_it_starts() -> None:
    with socket.socket() as probe:  # a free port, nobody listening on it yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with sink_to(f"http://127.0.0.1:{port}/hook") as sink:
        transitions = [firing(step) for step in range(INCIDENTS)]
        for t in transitions:
            sink.notify(t)
        sink.wait_for(lambda s: s.retries >= 2 * INCIDENTS, timeout=20)
        with WebhookReceiver(port=port) as receiver:
            sink.wait_for(lambda s: s.delivered == INCIDENTS, timeout=20)
            ids = [r.headers["webhook-id"] for r in receiver.requests]
        assert sorted(ids) == sorted(f"{t.alert.id}:firing" for t in transitions)
        assert sink.stats().queued == 0


def test_the_server_signs_and_redelivers_through_the_outbox() -> None:
    """The collector's own sinks (``build_sinks``): signed, retried on 503, delivered once."""
    rows = np.array([[1.0, 0.1, 1.0], [1.0, 0.1, float("nan")]], "<f4").tobytes()
    message = encode(
        Batch(
            "run-1",
            0,
            1,
            1,
            0,
            "inc-a",
            0,
            (1, 2),
            (1.0, 2.0),
            rows,
            Schema(1, ("loss", "lr/0"), ("fc.weight",)),
        )
    )
    with WebhookReceiver(statuses=[503]) as receiver:
        config = CollectorConfig(
            listen="tcp://127.0.0.1:*",
            metrics_addr="127.0.0.1:0",
            webhooks=[receiver.url],
            webhook_secret=SECRET,
        )
        server = Server(config, registry=CollectorRegistry())
        server.start()
        ctx: zmq.Context[object] = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        try:
            push.connect(server.bound_endpoint)
            push.send_multipart(message)
            (received,) = receiver.wait_for(lambda got: len(got) == 1, timeout=20)
            request = receiver.requests[0]
        finally:
            push.close(linger=0)
            ctx.term()
            assert server.stop(10)
    key = decode_secret(SECRET)
    raw = next(a.raw for a in receiver.attempts if a.status == 200)
    assert verify(key, request.headers, raw, now=time.time()) == f"{received['id']}:firing"
    assert [a.status for a in receiver.attempts] == [503, 200]
    assert len({a.headers["webhook-id"] for a in receiver.attempts}) == 1
