"""Generic JSON webhook: POST every firing and resolved alert to a URL.

Delivery never blocks the ingest thread. ``notify`` puts the alert on a bounded
queue (when it is full the oldest notification is dropped and counted) and a
background thread POSTs ``Alert.to_dict()`` plus ``"version"`` and ``"kind"``,
retrying connection errors, timeouts, 408, 429 and 5xx with exponential backoff
and jitter (``Retry-After`` seconds or HTTP-date honoured). ``Idempotency-Key``
and ``webhook-id`` are ``<alert id>:<state>``, so a receiver can drop retried
copies. HTTP goes through an injected transport (stdlib ``urllib`` by default),
so tests and users can substitute their own. URLs are masked in logs.

Example::

    from gradwatch.collector.webhook import WebhookSink

    sink = WebhookSink("https://hooks.example.com/gradwatch")
    sink.start()
    # for transition in engine.observe(step): sink.notify(transition)
    sink.close(timeout=5.0)
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradwatch.collector.config import VERSION, CollectorError
from gradwatch.collector.sinks import (
    NOTIFY_STATES,
    SinkStats,
    alert_payload,
    idempotency_key,
    mask_url,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429})


@dataclass(frozen=True, slots=True)
class HttpRequest:
    url: str
    body: bytes
    headers: Mapping[str, str]
    timeout: float


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: Mapping[str, str] = field(default_factory=dict)


class TransportError(CollectorError):
    """The request never got an HTTP answer: connection refused, reset, timeout."""


Transport = Callable[[HttpRequest], HttpResponse]


def urllib_transport(request: HttpRequest) -> HttpResponse:
    """POST with the standard library; HTTP error statuses are answers, not errors."""
    req = urllib.request.Request(request.url, data=request.body,
                                 headers=dict(request.headers), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=request.timeout) as resp:
            resp.read()
            return HttpResponse(resp.status, dict(resp.headers.items()))
    except urllib.error.HTTPError as exc:
        with exc:
            return HttpResponse(exc.code, dict(exc.headers.items()) if exc.headers else {})
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise TransportError(f"{type(exc).__name__}: {reason}") from exc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """At most ``max_attempts`` tries; delays double from ``base_delay`` up to ``max_delay``."""

    max_attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_retry_after: float = 60.0


class WebhookSink:
    """Posts alert transitions to one URL from a background thread."""

    def __init__(self, url: str, *, name: str = "webhook", transport: Transport = urllib_transport,
                 timeout: float = 5.0, queue_size: int = 1024, retry: RetryPolicy = RetryPolicy(),
                 jitter: Callable[[], float] = random.random,
                 sleep: Callable[[float], object] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self._url = url
        self._masked = mask_url(url)
        self._transport = transport
        self._timeout = timeout
        self._retry = retry
        self._jitter = jitter
        self._clock = clock
        self._queue: deque[Any] = deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._closing = threading.Event()
        # Backoff waits end early on close, so shutdown is never held by a retry.
        self._sleep = sleep or self._closing.wait
        self._thread: threading.Thread | None = None
        self._counts = {"delivered": 0, "failed": 0, "dropped": 0, "retries": 0}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"gradwatch-{self.name}",
                                            daemon=True)
            self._thread.start()

    def notify(self, transition: Any) -> None:
        """Queue a firing or resolved transition; other transitions are ignored."""
        if transition.current not in NOTIFY_STATES:
            return
        with self._cond:
            if self._closing.is_set():
                return
            if len(self._queue) >= self._queue_size:
                dropped = self._queue.popleft()
                self._counts["dropped"] += 1
                if self._counts["dropped"] == 1 or self._counts["dropped"] % 1000 == 0:
                    log.warning("webhook %s: queue full (%d), dropped the oldest notification "
                                "(%s); the receiver is too slow or down [%d dropped so far]",
                                self._masked, self._queue_size, dropped.rule,
                                self._counts["dropped"])
            self._queue.append(transition.alert)
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Send what is queued (one attempt each) within ``timeout``, then stop."""
        with self._cond:
            self._closing.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("webhook %s: still sending after %.1fs at shutdown; giving up",
                            self._masked, timeout)
        with self._cond:
            if self._queue:
                log.warning("webhook %s: %d notification(s) not sent at shutdown",
                            self._masked, len(self._queue))
                self._counts["dropped"] += len(self._queue)
                self._queue.clear()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> SinkStats:
        with self._cond:
            return SinkStats(queued=len(self._queue), **self._counts)

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing.is_set():
                    self._cond.wait()
                if not self._queue:
                    return
                alert = self._queue.popleft()
            try:
                outcome = self._deliver(alert)
            except Exception:  # a bug here must not kill the thread for good
                log.exception("webhook %s: failed to send %r", self._masked, alert)
                outcome = "failed"
            with self._cond:
                self._counts[outcome] += 1

    def _deliver(self, alert: Any) -> str:
        body = json.dumps(alert_payload(alert), allow_nan=False, separators=(",", ":"))
        key = idempotency_key(alert)
        request = HttpRequest(self._url, body.encode(), {
            "Content-Type": "application/json", "User-Agent": f"gradwatch/{VERSION}",
            "Idempotency-Key": key, "webhook-id": key}, self._timeout)
        for attempt in range(1, self._retry.max_attempts + 1):
            response: HttpResponse | None = None
            try:
                response = self._transport(request)
                problem = f"HTTP {response.status}"
            except Exception as exc:  # any transport failure is a failed attempt
                problem = str(exc) or type(exc).__name__
            if response is not None and 200 <= response.status < 300:
                log.debug("webhook %s: sent %s (%s)", self._masked, key, alert.rule)
                return "delivered"
            retryable = response is None or response.status >= 500 or \
                response.status in RETRY_STATUSES
            if not retryable or attempt == self._retry.max_attempts or self._closing.is_set():
                log.warning("webhook %s: gave up on alert %s of job %r after %d attempt(s): %s; "
                            "check that the receiver is up and accepts POSTed JSON",
                            self._masked, alert.rule, alert.job, attempt, problem)
                return "failed"
            delay = self._delay(attempt, response)
            log.debug("webhook %s: %s, retrying in %.2fs", self._masked, problem, delay)
            with self._cond:
                self._counts["retries"] += 1
            self._sleep(delay)
        return "failed"

    def _delay(self, attempt: int, response: HttpResponse | None) -> float:
        if response is not None:
            after = _retry_after(response.headers, self._clock())
            if after is not None:
                return min(after, self._retry.max_retry_after)
        backoff = min(self._retry.max_delay, self._retry.base_delay * 2.0 ** (attempt - 1))
        # Half fixed, half random: spreads retries of many collectors apart.
        return backoff * (0.5 + 0.5 * self._jitter())


def _retry_after(headers: Mapping[str, str], now: float) -> float | None:
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, float(when.timestamp()) - now)
