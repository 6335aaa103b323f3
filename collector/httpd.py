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

Bounded against slow or idle clients (slowloris): at most ``max_connections``
are open; a client that sends nothing for ``read_timeout`` seconds is
disconnected; when the cap is reached, the oldest connection that has not yet
sent a whole request is closed to make room (an idle flood cannot lock
Prometheus or the kubelet out), and only when every open connection is busy
with a request is the new one refused. Both are logged (rate-limited) and
counted in ``gradwatch_http_connections_refused_total{reason}``.

Example::

    from prometheus_client import CollectorRegistry
    from gradwatch.collector.httpd import MetricsHTTPServer

    http = MetricsHTTPServer("127.0.0.1", 0, CollectorRegistry(), ready=lambda: True)
    print(http.port)
    http.close()
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import logging
import socket
import ssl
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from socket import socket as Socket
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradwatch.collector.config import CollectorError, ConfigError
from gradwatch.collector.ingest import RateLimitedLog

log = logging.getLogger(__name__)

TLS_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_READ_TIMEOUT_S = 10.0


def _text() -> list[tuple[str, str]]:
    # A new list per response: wsgiref adds Content-Length to it in place.
    return [("Content-Type", "text/plain; charset=utf-8")]


class MetricsHTTPServer:
    """Serves from its own thread as soon as it is built; ``close()`` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        *,
        tls: ssl.SSLContext | None = None,
        basic_auth: tuple[str, str] | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        self._metrics: Callable[..., Iterable[bytes]] = make_wsgi_app(registry)
        self._ready = ready
        self._authorization = (
            None
            if basic_auth is None
            else "Basic " + base64.b64encode(":".join(basic_auth).encode("utf-8")).decode("ascii")
        )
        server_class: type[_ThreadingWSGIServer] = (
            _IPv6WSGIServer if ":" in host else _ThreadingWSGIServer
        )
        if tls is not None:
            server_class = type(
                "TLS" + server_class.__name__, (_TLSMixin, server_class), {"ssl_context": tls}
            )
        self.connections = Connections(max_connections)
        handler = type("Handler", (_QuietHandler,), {"timeout": read_timeout})
        try:
            self._server = make_server(
                host, port, self._app, server_class=server_class, handler_class=handler
            )
            self._server.connections = self.connections
        except OSError as exc:
            raise CollectorError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; "
                "choose another --metrics-addr"
            ) from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="gradwatch-metrics-http",
            daemon=True,
        )
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
                start_response(
                    "401 Unauthorized",
                    [*_text(), ("WWW-Authenticate", 'Basic realm="gradwatch", charset="UTF-8"')],
                )
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
        return hmac.compare_digest(
            header.encode("utf-8", "replace"), self._authorization.encode("utf-8")
        )


def tls_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context (TLS 1.2+) for ``cert_file`` (PEM chain) and its key; ``ConfigError``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the metrics TLS certificate {cert_file} with key "
            f"{key_file}: {exc}; both must be PEM files and match"
        ) from exc
    return context


class Connections:
    """The open connections: idle ones (no whole request yet), oldest first, and busy ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._idle: OrderedDict[int, socket.socket] = OrderedDict()
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {"evicted_idle": 0, "full": 0}
        self._log = RateLimitedLog(log, every=100)

    def admit(self, sock: socket.socket, peer: Any) -> bool:
        """Track ``sock``; False (counted, logged) when it must be closed at once."""
        evict: socket.socket | None = None
        with self._lock:
            if len(self._idle) + len(self._busy) >= self.limit:
                if not self._idle:
                    self.refused["full"] += 1
                    self._log.warning(
                        "http_full",
                        "refused an HTTP connection from %s: all "
                        "%d connections are busy with requests; raise "
                        "http_max_connections if scrapes are this many",
                        peer,
                        self.limit,
                    )
                    return False
                _, evict = self._idle.popitem(last=False)
                self.refused["evicted_idle"] += 1
            self._idle[id(sock)] = sock
        if evict is not None:
            self._log.warning(
                "http_idle",
                "closed the oldest idle HTTP connection to admit "
                "%s: %d are open (http_max_connections), and idle connections "
                "(slow or silent clients) go first",
                peer,
                self.limit,
            )
            with contextlib.suppress(OSError):
                evict.shutdown(socket.SHUT_RDWR)  # its thread's read returns and it ends
        return True

    def busy(self, sock: socket.socket) -> None:
        with self._lock:
            if self._idle.pop(id(sock), None) is not None:
                self._busy.add(id(sock))

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.pop(id(sock), None)
            self._busy.discard(id(sock))

    def open(self) -> int:
        with self._lock:
            return len(self._idle) + len(self._busy)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            refused, open_now = dict(self.refused), len(self._idle) + len(self._busy)
        family = CounterMetricFamily(
            "gradwatch_http_connections_refused",
            "HTTP connections closed by the "
            "connection cap: 'evicted_idle' (an idle one closed for a new one) or 'full'.",
            labels=["reason"],
        )
        for reason, count in sorted(refused.items()):
            family.add_metric([reason], count)
        yield family
        yield GaugeMetricFamily(
            "gradwatch_http_connections_open",
            "Open HTTP connections (bounded by http_max_connections).",
            value=open_now,
        )


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # The listen backlog: with socketserver's 5, a burst of connections waits in the
    # kernel, out of reach of the cap's eviction of idle ones.
    request_queue_size = 128
    connections: Connections

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went silent (read timeout) or away is routine, not a traceback.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.admit(request, client_address):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def close_request(self, request: Any) -> None:
        self.connections.release(request)
        super().close_request(request)


class _IPv6WSGIServer(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _TLSMixin:
    """Wrap accepted sockets without I/O; handshake in the request's own thread."""

    ssl_context: ssl.SSLContext
    socket: Socket

    def get_request(self) -> tuple[Socket, Any]:
        sock, address = self.socket.accept()
        return self.ssl_context.wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False
        ), address

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError):
            return  # a scanner, a plain-HTTP client or a wrong CA: nothing to answer
        request.settimeout(None)
        # A mixin: the server class it is mixed into (before socketserver's) has
        # finish_request; mypy sees only object above _TLSMixin.
        super().finish_request(request, client_address)  # type: ignore[misc]


class _QuietHandler(WSGIRequestHandler):
    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:  # a whole request arrived: no longer an idle connection
            # self.server is our server class (it has .connections); the stdlib
            # types the handler's server as a plain BaseServer.
            self.server.connections.busy(self.connection)  # type: ignore[attr-defined]
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        pass  # an access log line per scrape would drown the collector's own logs
