"""A tiny webhook receiver on loopback, for tests, demos and local debugging.

``WebhookReceiver`` listens on ``127.0.0.1`` (port 0 picks a free one), keeps
the JSON body and headers of every POST, and lets a caller wait, without sleep
loops, until what it received satisfies a predicate. It can also answer the
first requests with chosen statuses (e.g. ``503``) to exercise retries, or
every request with one status while it plays "down" (``fail_with(503)``, then
``fail_with(None)``). ``attempts`` lists every POST with the status it got.

Example::

    from gradwatch.collector.receiver import WebhookReceiver

    with WebhookReceiver() as receiver:
        print(receiver.url)          # give this to the collector as --webhook
        bodies = receiver.wait_for(lambda got: any(b["state"] == "firing" for b in got), 10.0)
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Received:
    """One POST: its path, headers (lower-cased names) and parsed JSON body."""

    path: str
    headers: Mapping[str, str]
    body: Any


@dataclass(frozen=True, slots=True)
class Attempt:
    """One POST as it arrived, accepted or not: path, headers, raw body, status answered."""

    path: str
    headers: Mapping[str, str]
    raw: bytes
    status: int


class WebhookReceiver:
    """Collects POSTed JSON bodies; thread-safe; close it (or use ``with``)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, statuses: Iterable[int] = ()
    ) -> None:
        self._received: list[Received] = []
        self._statuses = deque(statuses)
        self._attempts: list[Attempt] = []
        self._failing: int | None = None
        self._cond = threading.Condition()
        self._host = host
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="gradwatch-webhook-receiver",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._server.server_port}/hook"

    @property
    def requests(self) -> list[Received]:
        with self._cond:
            return list(self._received)

    @property
    def bodies(self) -> list[Any]:
        with self._cond:
            return [r.body for r in self._received]

    @property
    def attempts(self) -> list[Attempt]:
        with self._cond:
            return list(self._attempts)

    def fail_with(self, status: int | None) -> None:
        """Answer every POST with ``status`` (e.g. 503) until called with None."""
        with self._cond:
            self._failing = status

    def wait_for_attempts(self, count: int, timeout: float) -> list[Attempt]:
        """Block until ``count`` POSTs arrived (accepted or not); raise ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._attempts) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"webhook receiver: {len(self._attempts)} of {count} "
                        f"POSTs arrived within {timeout}s"
                    )
                self._cond.wait(remaining)
            return list(self._attempts)

    def wait_for(self, predicate: Callable[[list[Any]], bool], timeout: float) -> list[Any]:
        """Block until ``predicate(bodies)`` holds; return the bodies, or raise ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                bodies = [r.body for r in self._received]
                if predicate(bodies):
                    return bodies
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"webhook receiver: condition not met within {timeout}s; "
                        f"received {len(bodies)} bodies: {bodies!r:.2000}"
                    )
                self._cond.wait(remaining)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _record(self, path: str, headers: Mapping[str, str], raw: bytes) -> int:
        try:
            body = json.loads(raw)
        except ValueError:
            body, status = None, 400
        with self._cond:
            if body is not None:
                status = self._statuses.popleft() if self._statuses else (self._failing or 200)
            if 200 <= status < 300:
                self._received.append(Received(path, headers, body))
            self._attempts.append(Attempt(path, headers, raw, status))
            self._cond.notify_all()
            return status

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 <= length <= MAX_BODY_BYTES:
                    self.send_error(413)
                    return
                raw = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                status = receiver._record(self.path, headers, raw)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # tests and demos read bodies, not access logs

        return Handler
