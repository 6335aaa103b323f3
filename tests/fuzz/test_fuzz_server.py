"""End to end: hostile multipart messages over real ZeroMQ, then a valid batch, to a real Server."""

from __future__ import annotations

import struct
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import zmq
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.ingest import REASONS
from gradwatch.collector.server import Server
from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.wire import Batch, Schema, encode
from tests.fuzz.hostile import nested

GW = struct.Struct("<2sBB")
HB = b'{"job":"j","rank":0,"world":1,"inc":"i","time":1.0,"step":1,"dropped":0}'

# (frames, the reason it must be counted under)
HOSTILE: list[tuple[list[bytes], str]] = [
    ([b""], "malformed"),
    ([b"GET / HTTP/1.1\r\n\r\n"], "malformed"),
    ([GW.pack(b"GW", 1, 2) + nested(100_000).encode()], "malformed"),
    ([GW.pack(b"GW", 1, 2) + HB.replace(b"1.0", b"1" + b"0" * 400)], "malformed"),
    ([GW.pack(b"GW", 1, 2) + HB.replace(b'"j"', b'"j\\u0007"')], "malformed"),
    ([GW.pack(b"GW", 1, 2) + HB.replace(b'"world":1', b'"world":-1')], "malformed"),
    ([GW.pack(b"GW", 1, 2) + HB, b"extra", b"frames", b"too many"], "malformed"),
    ([GW.pack(b"GW", 9, 2) + HB], "version"),
    # Every frame under ZeroMQ's per-frame MAXMSGSIZE, the message over max_message_bytes.
    ([GW.pack(b"GW", 1, 1) + b"{}", b" " * 600_000, b"\0" * 600_000], "oversized"),
    (encode(Batch("j", 0, 1, 77, 0, "i", 0, (1,), (0.0,), b"\0" * 8)), "unknown_schema"),
]


@contextmanager
def collector(engine: Engine | None = None, **overrides: Any) -> Iterator[tuple[Server, Any]]:
    """A started in-process Server and a PUSH socket connected to it; both closed after."""
    config = CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", **overrides)
    server = Server(config, engine=engine, registry=CollectorRegistry())
    server.start()
    try:
        with pushing(server) as push:
            yield server, push
    finally:
        assert server.stop(10), "the server did not stop within its deadline"


@contextmanager
def pushing(server: Server) -> Iterator[Any]:
    """A PUSH connection to ``server`` with its own context, closed (linger 0) after."""
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.setsockopt(zmq.LINGER, 0)
        push.connect(server.bound_endpoint)
        yield push
    finally:
        push.close(linger=0)
        ctx.term()


def metrics(server: Server) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_hostile_messages_are_counted_and_a_valid_batch_still_arrives() -> None:
    with collector(max_message_bytes=1024 * 1024) as (server, push):
        for frames, _ in HOSTILE:
            push.send_multipart(frames)
        schema = Schema(1, ("loss", "lr/0"), ("fc.weight",))
        rows = np.array([[2.0, 0.1, 0.5], [1.9, 0.1, 0.4]], "<f4").tobytes()
        push.send_multipart(
            encode(Batch("run-ok", 0, 1, 1, 0, "inc", 0, (7, 8), (1.0, 2.0), rows, schema))
        )
        assert server.wait_for_messages(len(HOSTILE) + 1, timeout=20)
        assert server.ready, "a hostile message took the collector down"
        text = metrics(server)
        job = server.state.job("run-ok")
        lead = job.lead() if job is not None else None
        assert lead is not None and lead.last_step == 8
    assert 'gradwatch_job_step{training_job="run-ok"} 8.0' in text
    expected: dict[str, int] = {}
    for _, reason in HOSTILE:
        expected[reason] = expected.get(reason, 0) + 1
    for reason, count in expected.items():
        assert f'gradwatch_ingest_rejected_total{{reason="{reason}"}} {count}.0' in text, reason
    assert 'gradwatch_ingest_rejected_total{reason="internal"} 0.0' in text
    # Every reason is exposed from the start, so a rate() over it never begins with a gap.
    for reason in REASONS:
        assert f'gradwatch_ingest_rejected_total{{reason="{reason}"}}' in text


class _BrokenEngine(Engine):
    """The real engine, except that evaluating a step fails (a rule bug)."""

    def observe(self, step: Step) -> list[Any]:
        raise RuntimeError("a rule bug")


def test_a_collector_bug_on_a_valid_message_is_counted_as_internal() -> None:
    with collector(engine=_BrokenEngine(load_default_rules())) as (server, push):
        schema = Schema(1, ("loss",), ("w",))
        for seq in range(2):
            push.send_multipart(
                encode(
                    Batch(
                        "run-bug",
                        0,
                        1,
                        1,
                        seq,
                        "inc",
                        0,
                        (seq,),
                        (0.0,),
                        np.array([[1.0, 0.5]], "<f4").tobytes(),
                        schema,
                    )
                )
            )
        assert server.wait_for_messages(2, timeout=20)
        assert server.ready, "an internal error took the collector down"
        text = metrics(server)
    assert 'gradwatch_ingest_rejected_total{reason="internal"} 2.0' in text


def test_a_single_frame_over_the_limit_is_counted_as_oversized() -> None:
    with collector(max_message_bytes=64 * 1024) as (server, big), pushing(server) as ok:
        big.send_multipart([GW.pack(b"GW", 1, 2) + HB + b" " * 100_000])
        ok.send_multipart([GW.pack(b"GW", 1, 2) + HB])  # a fresh connection: always arrives
        # A frame up to 4x the limit reaches Ingest (MAXMSGSIZE headroom) and is counted.
        assert server.wait_for_messages(2, timeout=10)
        assert server.ingest.stats().messages["heartbeat"] == 1
        assert server.ingest.stats().rejected["oversized"] == 1
