"""A sink that hangs (accepts the request, answers much later) never stalls ingest, and the
outbox stays bounded while it hangs.

``tests/collector/test_delivery_outage.py`` covers a receiver that is down (503,
connection refused) and comes back; what it does not cover is a receiver that
holds the connection open: the delivery thread is stuck inside one request, and
meanwhile more alerts than ``outbox_max_pending`` fire. Real HTTP on loopback,
the real in-process ``Server`` and its outbox.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import zmq
from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.server import Server
from gradwatch.wire import Batch, Schema, encode

INCIDENTS = 10
MAX_PENDING = 3
HEALTHY = 300  # ordinary step messages sent while the sink hangs
SINK_TIMEOUT_S = 30.0  # the collector waits this long for the hanging receiver
HANG_LIMIT_S = 30.0  # the receiver never holds a request longer (bounded teardown)


class HangingReceiver:
    """Takes POSTs and answers 200 only once ``release()`` is called; counts arrivals."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.arrived = 0
        self._released = threading.Event()
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._cond:
                    receiver.arrived += 1
                    receiver._cond.notify_all()
                receiver._released.wait(HANG_LIMIT_S)
                with receiver._cond:
                    receiver.bodies.append(json.loads(raw))
                    receiver._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}/hook"

    def wait_arrived(self, count: int, timeout: float) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.arrived >= count, timeout), (
                f"{self.arrived} of {count} requests arrived"
            )

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def batch(job: str, nan: bool, first_step: int = 1) -> list[bytes]:
    loss = 10.0 / first_step  # a loss that keeps falling: a healthy run, no rule fires
    last = float("nan") if nan else 1.0
    rows = np.array([[loss, 0.1, 1.0], [loss, 0.1, last]], "<f4").tobytes()
    return encode(
        Batch(
            job,
            0,
            1,
            1,
            first_step,
            "inc-a",
            0,
            (first_step, first_step + 1),
            (1.0, 2.0),
            rows,
            Schema(1, ("loss", "lr/0"), ("fc.weight",)),
        )
    )


@contextmanager
def collector(url: str) -> Iterator[tuple[Server, zmq.Socket[Any]]]:
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        webhooks=[url],
        outbox_max_pending=MAX_PENDING,
        webhook_timeout=SINK_TIMEOUT_S,
        shutdown_timeout=5.0,
    )
    server = Server(config, registry=CollectorRegistry())
    server.start()
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(server.bound_endpoint)
    try:
        yield server, push
    finally:
        push.close(linger=0)
        ctx.term()
        server.stop(5.0)


def test_a_hanging_sink_never_stalls_ingest_and_the_outbox_stays_bounded() -> None:
    receiver = HangingReceiver()
    try:
        with collector(receiver.url) as (server, push):
            (sink,) = server.sinks
            assert isinstance(sink, OutboxSink)
            push.send_multipart(batch("incident-0", nan=True))
            receiver.wait_arrived(1, timeout=20)  # the delivery thread is now stuck in it
            start = time.monotonic()
            for i in range(1, INCIDENTS):
                push.send_multipart(batch(f"incident-{i}", nan=True))
            for i in range(HEALTHY):
                push.send_multipart(batch("healthy", nan=False, first_step=1 + 2 * i))
            assert server.wait_for_messages(INCIDENTS + HEALTHY, timeout=SINK_TIMEOUT_S / 2)
            ingest_s = time.monotonic() - start
            stuck = sink.stats()
            assert receiver.arrived == 1 and receiver.bodies == []  # still hanging
            assert stuck.queued <= MAX_PENDING
            # The one being sent is kept: it may arrive, and must not count as dropped.
            assert stuck.dropped == INCIDENTS - MAX_PENDING
            receiver.release()
            done = sink.wait_for(lambda s: s.queued == 0, timeout=20)
    finally:
        receiver.close()
    # Ingest ran at its own pace while the sink hung: far below one sink timeout.
    assert ingest_s < SINK_TIMEOUT_S / 3
    # Eventual delivery of what was kept: the one in flight and the newest others.
    delivered = sorted(b["job"] for b in receiver.bodies)
    newest = [f"incident-{i}" for i in range(INCIDENTS - MAX_PENDING + 1, INCIDENTS)]
    assert delivered == sorted(["incident-0", *newest])
    # Each notification counted exactly once: delivered or dropped.
    assert (done.delivered, done.dropped, done.failed) == (MAX_PENDING, INCIDENTS - MAX_PENDING, 0)
