"""Webhook request, retry policy, HTTP transport and the loopback receiver.

Delivery itself (queueing, retries over time, restarts) is the outbox's and is
tested in test_outbox.py and test_delivery_outage.py; here are the pieces.
"""

from __future__ import annotations

import email.utils
import json
import socket

import pytest

from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.signing import decode_secret, verify
from gradwatch.collector.sinks import alert_payload, idempotency_key, mask_url
from gradwatch.collector.webhook import (
    HttpRequest,
    HttpResponse,
    RetryPolicy,
    TransportError,
    WebhookChannel,
    is_retryable,
    retry_delay,
    urllib_transport,
)
from gradwatch.rules import Alert

URL = "https://hooks.example.com/services/T0/B0/s3cret"
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def alert(state: str = "firing") -> Alert:
    return Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job="run-1",
        state=state,
        step=12,
        # The helper takes a plain str; callers pass valid literal values.
        summary="loss is nan",  # type: ignore[arg-type]
        started_at=1.0,
        evidence={"loss": float("nan")},
        rank=0,
    )


def test_the_request_carries_the_envelope_and_idempotency_headers() -> None:
    a = alert()
    request = WebhookChannel(URL, timeout=3.0).request(idempotency_key(a), alert_payload(a), 1e9)
    body = json.loads(request.body)
    assert body["version"] == 1 and body["kind"] == "gradwatch.alert"
    assert body["rule"] == "NonFiniteGradients" and body["state"] == "firing"
    assert body["evidence"] == {"loss": "nan"}  # strict JSON: no NaN literal
    assert request.headers["Idempotency-Key"] == request.headers["webhook-id"] == f"{a.id}:firing"
    assert "webhook-signature" not in request.headers and request.timeout == 3.0


def test_a_signed_request_verifies_and_a_retry_is_signed_afresh() -> None:
    key = decode_secret(SECRET)
    a = alert("resolved")
    channel = WebhookChannel(URL, secret=key)
    first = channel.request(idempotency_key(a), alert_payload(a), 1_700_000_000.0)
    later = channel.request(idempotency_key(a), alert_payload(a), 1_700_003_600.0)
    assert verify(key, first.headers, first.body, now=1_700_000_010.0) == f"{a.id}:resolved"
    assert verify(key, later.headers, later.body, now=1_700_003_610.0) == f"{a.id}:resolved"
    assert first.headers["webhook-timestamp"] != later.headers["webhook-timestamp"]
    assert "s3cret" not in repr(channel) and "signed=True" in repr(channel)


def test_backoff_doubles_up_to_the_cap_with_half_of_it_jittered() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=4.0)
    assert [retry_delay(policy, n, None, 0.0, lambda: 1.0) for n in range(1, 6)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        4.0,
    ]
    assert retry_delay(policy, 3, None, 0.0, lambda: 0.0) == 1.0  # half of 2.0 is fixed


def test_retry_after_seconds_and_http_date_are_honoured_and_capped() -> None:
    policy = RetryPolicy(max_retry_after=60.0)
    seconds = HttpResponse(429, {"retry-after": "7"})
    later = email.utils.formatdate(1_700_000_003, usegmt=True)
    date = HttpResponse(503, {"Retry-After": later})
    assert retry_delay(policy, 1, seconds, 0.0, lambda: 1.0) == 7.0
    assert retry_delay(policy, 1, date, 1_700_000_000.0, lambda: 1.0) == 3.0
    assert (
        retry_delay(policy, 1, HttpResponse(503, {"Retry-After": "86400"}), 0.0, lambda: 1.0)
        == 60.0
    )


def test_which_answers_may_succeed_later() -> None:
    assert is_retryable(None)  # no answer: connection refused, reset, timeout
    assert all(is_retryable(HttpResponse(s)) for s in (408, 429, 500, 502, 503))
    assert not any(is_retryable(HttpResponse(s)) for s in (200, 400, 401, 404, 422))


def test_urls_are_masked() -> None:
    assert mask_url(URL) == "https://hooks.example.com/…"
    assert mask_url("http://user:pw@[::1]:8080/x?token=1") == "http://[::1]:8080/…"
    assert "s3cret" not in repr(WebhookChannel(URL))


def test_urllib_transport_and_receiver_round_trip() -> None:
    a = alert()
    with WebhookReceiver(statuses=[503]) as receiver:
        request = WebhookChannel(receiver.url).request(idempotency_key(a), alert_payload(a), 1e9)
        assert urllib_transport(request).status == 503  # an HTTP error status is an answer
        assert urllib_transport(request).status in (200, 204)
        (body,) = receiver.wait_for(lambda got: len(got) == 1, timeout=10)
        assert body["category"] == "numerical"
        assert receiver.requests[0].headers["idempotency-key"] == f"{a.id}:firing"


def test_urllib_transport_turns_connection_errors_into_transport_errors() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    request = HttpRequest(f"http://127.0.0.1:{port}/", b"{}", {}, 2.0)
    with pytest.raises(TransportError):
        urllib_transport(request)


def test_receiver_wait_for_times_out_with_what_it_got() -> None:
    with WebhookReceiver() as receiver, pytest.raises(TimeoutError, match="received 0"):
        receiver.wait_for(lambda got: bool(got), timeout=0.05)
