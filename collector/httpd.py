"""The collector's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

A threaded stdlib WSGI server in a background thread: ``/metrics`` is
prometheus-client's WSGI app over the given registry (rendered at scrape
time, gzip and OpenMetrics negotiated by it), ``/healthz`` answers while the
process serves, and ``/readyz`` asks a callable whether the collector is ready.

Example::

    from prometheus_client import CollectorRegistry
    from gradwatch.collector.httpd import MetricsHTTPServer

    http = MetricsHTTPServer("127.0.0.1", 0, CollectorRegistry(), ready=lambda: True)
    print(http.port)
    http.close()
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gradwatch.collector.config import CollectorError


def _text() -> list[tuple[str, str]]:
    # A new list per response: wsgiref adds Content-Length to it in place.
    return [("Content-Type", "text/plain; charset=utf-8")]


class MetricsHTTPServer:
    """Serves from its own thread as soon as it is built; ``close()`` stops it."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 ready: Callable[[], bool]) -> None:
        self._metrics: Callable[..., Iterable[bytes]] = make_wsgi_app(registry)
        self._ready = ready
        server_class = _IPv6WSGIServer if ":" in host else _ThreadingWSGIServer
        try:
            self._server = make_server(host, port, self._app, server_class=server_class,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise CollectorError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; "
                "choose another --metrics-addr") from exc
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={
            "poll_interval": 0.1}, name="gradwatch-metrics-http", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(1.0)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/healthz":
            start_response("200 OK", _text())
            return [b"ok\n"]
        if path == "/readyz":
            if self._ready():
                start_response("200 OK", _text())
                return [b"ready\n"]
            start_response("503 Service Unavailable", _text())
            return [b"not ready\n"]
        start_response("404 Not Found", _text())
        return [b"try /metrics, /healthz or /readyz\n"]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _IPv6WSGIServer(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # an access log line per scrape would drown the collector's own logs
