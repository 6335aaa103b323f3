"""The collector's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

A threaded stdlib WSGI server in a background thread: ``/metrics`` is
prometheus-client's WSGI app over the given registry (rendered at scrape
time, gzip and OpenMetrics negotiated by it), ``/healthz`` answers while the
process serves, and ``/readyz`` asks a callable whether the collector is ready.

Optionally ``/metrics`` asks for HTTP basic auth (``basic_auth=(user,
password)``; a wrong or missing one gets 401) and the whole server speaks TLS
(``tls=`` an ``ssl.SSLContext``, see :func:`tls_context`). ``/healthz`` and
``/readyz`` stay open: they reveal nothing and Kubernetes probes cannot send
credentials. The TLS handshake runs in the request's thread, so a slow or
silent client never blocks the accept loop.

Example::

    from prometheus_client import CollectorRegistry
    from gradwatch.collector.httpd import MetricsHTTPServer

    http = MetricsHTTPServer("127.0.0.1", 0, CollectorRegistry(), ready=lambda: True)
    print(http.port)
    http.close()
"""

from __future__ import annotations

import base64
import hmac
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gradwatch.collector.config import CollectorError, ConfigError

TLS_HANDSHAKE_TIMEOUT_S = 10.0


def _text() -> list[tuple[str, str]]:
    # A new list per response: wsgiref adds Content-Length to it in place.
    return [("Content-Type", "text/plain; charset=utf-8")]


class MetricsHTTPServer:
    """Serves from its own thread as soon as it is built; ``close()`` stops it."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 ready: Callable[[], bool], *, tls: ssl.SSLContext | None = None,
                 basic_auth: tuple[str, str] | None = None) -> None:
        self._metrics: Callable[..., Iterable[bytes]] = make_wsgi_app(registry)
        self._ready = ready
        self._authorization = None if basic_auth is None else \
            "Basic " + base64.b64encode(":".join(basic_auth).encode("utf-8")).decode("ascii")
        server_class: type[_ThreadingWSGIServer] = \
            _IPv6WSGIServer if ":" in host else _ThreadingWSGIServer
        if tls is not None:
            server_class = type("TLS" + server_class.__name__, (_TLSMixin, server_class),
                                {"ssl_context": tls})
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
            if not self._authorized(environ.get("HTTP_AUTHORIZATION", "")):
                start_response("401 Unauthorized", [
                    *_text(), ("WWW-Authenticate", 'Basic realm="gradwatch", charset="UTF-8"')])
                return [b"credentials required: see metrics_basic_auth_user\n"]
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

    def _authorized(self, header: str) -> bool:
        if self._authorization is None:
            return True
        # Constant time: the comparison must not tell how much of a guess was right.
        return hmac.compare_digest(header.encode("utf-8", "replace"),
                                   self._authorization.encode("utf-8"))


def tls_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context (TLS 1.2+) for ``cert_file`` (PEM chain) and its key; ``ConfigError``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the metrics TLS certificate {cert_file} with key "
                          f"{key_file}: {exc}; both must be PEM files and match") from exc
    return context


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _IPv6WSGIServer(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _TLSMixin:
    """Wrap accepted sockets without I/O; handshake in the request's own thread."""

    ssl_context: ssl.SSLContext
    socket: socket.socket

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = self.socket.accept()
        return self.ssl_context.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False), address

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError):
            return  # a scanner, a plain-HTTP client or a wrong CA: nothing to answer
        request.settimeout(None)
        super().finish_request(request, client_address)  # type: ignore[misc]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # an access log line per scrape would drown the collector's own logs
