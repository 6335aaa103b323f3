"""Generic JSON webhook: the request, its HTTP transport, and the retry policy.

:class:`WebhookChannel` turns one stored notification (``Alert.to_dict()`` plus
``"version"`` and ``"kind"``) into a POST: ``Idempotency-Key`` and
``webhook-id`` are ``<alert id>:<state>``, so a receiver can drop retried
copies, and with a secret each attempt is signed afresh (Standard Webhooks).
The collector delivers it through the durable outbox
(:class:`gradwatch.collector.outbox.OutboxSink`), which retries connection
errors, timeouts, 408, 429 and 5xx with :func:`retry_delay` (exponential
backoff with jitter; ``Retry-After`` seconds or HTTP-date honoured). HTTP goes
through an injected transport (stdlib ``urllib`` by default). URLs are masked
in logs.

Example::

    channel = WebhookChannel("https://hooks.example.com/gradwatch", secret=key)
    request = channel.request("3f2a…:firing", alert_payload(alert), now=time.time())
    response = urllib_transport(request)
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gradwatch.collector.config import VERSION, CollectorError
from gradwatch.collector.signing import signature_headers
from gradwatch.collector.sinks import (
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
    req = urllib.request.Request(
        request.url, data=request.body, headers=dict(request.headers), method="POST"
    )
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


class WebhookChannel:
    """The generic JSON webhook request for one stored notification (outbox channel).

    The body is the stored ``alert_payload`` verbatim; ``webhook-id`` and
    ``Idempotency-Key`` are the notification id ``<alert id>:<state>``. With a
    ``secret`` each attempt is signed afresh (Standard Webhooks), so a retry
    hours later still carries a timestamp the receiver accepts.
    """

    def __init__(self, url: str, *, secret: bytes | None = None, timeout: float = 5.0) -> None:
        self._url = url
        self._secret = secret
        self._timeout = timeout
        self.target = mask_url(url)

    def request(self, notification_id: str, alert: Mapping[str, Any], now: float) -> HttpRequest:
        body = json.dumps(alert, allow_nan=False, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"gradwatch/{VERSION}",
            "Idempotency-Key": notification_id,
            "webhook-id": notification_id,
        }
        if self._secret is not None:
            headers.update(signature_headers(self._secret, notification_id, body, now))
        return HttpRequest(self._url, body, headers, self._timeout)

    def __repr__(self) -> str:
        return f"WebhookChannel({self.target!r}, signed={self._secret is not None})"


def is_retryable(response: HttpResponse | None) -> bool:
    """No answer, 408, 429 and 5xx may succeed later; other statuses will not."""
    return response is None or response.status >= 500 or response.status in RETRY_STATUSES


def retry_delay(
    policy: RetryPolicy,
    attempt: int,
    response: HttpResponse | None,
    now: float,
    jitter: Callable[[], float],
) -> float:
    """Seconds before attempt ``attempt + 1``: ``Retry-After`` if given, else jittered backoff."""
    if response is not None:
        after = _retry_after(response.headers, now)
        if after is not None:
            return min(after, policy.max_retry_after)
    backoff = min(policy.max_delay, policy.base_delay * 2.0 ** (attempt - 1))
    # Half fixed, half random: spreads retries of many collectors apart.
    return backoff * (0.5 + 0.5 * jitter())


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
