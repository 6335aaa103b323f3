"""Webhook sink: payload, headers, retries and backoff through a fake transport; receiver."""

from __future__ import annotations

import email.utils
import json
import socket
import threading
from collections.abc import Sequence

import pytest

from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.sinks import mask_url
from gradwatch.collector.webhook import (
    HttpRequest,
    HttpResponse,
    RetryPolicy,
    TransportError,
    WebhookSink,
    urllib_transport,
)
from gradwatch.rules import Alert, Transition

URL = "https://hooks.example.com/services/T0/B0/s3cret"


def transition(current: str = "firing", previous: str = "pending") -> Transition:
    state = "resolved" if current == "resolved" else "firing"
    alert = Alert(rule="NonFiniteGradients", category="numerical", severity="critical",
                  job="run-1", state=state, step=12, summary="loss is nan",  # type: ignore[arg-type]
                  started_at=1.0, evidence={"loss": float("nan")}, rank=0)
    return Transition(alert, previous, current)  # type: ignore[arg-type]


class FakeTransport:
    """Answers from a script; each entry is a response or an exception to raise."""

    def __init__(self, script: Sequence[HttpResponse | Exception], done_after: int) -> None:
        self._script = list(script)
        self.requests: list[HttpRequest] = []
        self.done = threading.Event()
        self._done_after = done_after

    def __call__(self, request: HttpRequest) -> HttpResponse:
        self.requests.append(request)
        answer = self._script.pop(0) if self._script else HttpResponse(200)
        if len(self.requests) >= self._done_after:
            self.done.set()
        if isinstance(answer, Exception):
            raise answer
        return answer


def run_sink(transport: FakeTransport, *transitions: Transition,
             **kwargs: object) -> tuple[WebhookSink, list[float]]:
    delays: list[float] = []
    sink = WebhookSink(URL, transport=transport, jitter=lambda: 1.0, sleep=delays.append,
                       **kwargs)  # type: ignore[arg-type]
    sink.start()
    for t in transitions:
        sink.notify(t)
    assert transport.done.wait(10), "the sink never made the expected requests"
    sink.close(timeout=10)
    assert not sink.alive()
    return sink, delays


def test_posts_the_alert_with_envelope_and_idempotency_headers() -> None:
    transport = FakeTransport([], done_after=2)
    sink, _ = run_sink(transport, transition("pending", "inactive"), transition(),
                       transition("resolved", "firing"))
    first, second = transport.requests
    body = json.loads(first.body)
    assert body["version"] == 1 and body["kind"] == "gradwatch.alert"
    assert body["rule"] == "NonFiniteGradients" and body["state"] == "firing"
    assert body["evidence"] == {"loss": "nan"}  # strict JSON: no NaN literal
    assert first.headers["Idempotency-Key"] == first.headers["webhook-id"] == f"{body['id']}:firing"
    assert json.loads(second.body)["state"] == "resolved"
    assert first.timeout == 5.0
    assert sink.stats().delivered == 2


def test_retries_5xx_with_exponential_backoff_then_delivers() -> None:
    transport = FakeTransport([HttpResponse(503), HttpResponse(502), HttpResponse(200)], 3)
    sink, delays = run_sink(transport, transition(),
                            retry=RetryPolicy(base_delay=0.5, max_delay=30))
    assert delays == [0.5, 1.0]
    stats = sink.stats()
    assert (stats.delivered, stats.failed, stats.retries) == (1, 0, 2)


def test_honours_retry_after_on_429() -> None:
    transport = FakeTransport([HttpResponse(429, {"retry-after": "7"}), HttpResponse(204)], 2)
    sink, delays = run_sink(transport, transition())
    assert delays == [7.0]
    assert sink.stats().delivered == 1


def test_honours_retry_after_as_an_http_date() -> None:
    later = email.utils.formatdate(1_700_000_003, usegmt=True)
    transport = FakeTransport([HttpResponse(503, {"Retry-After": later})], 2)
    _, delays = run_sink(transport, transition(), clock=lambda: 1_700_000_000.0)
    assert delays == [3.0]


def test_gives_up_after_max_attempts_on_timeouts() -> None:
    transport = FakeTransport([TransportError("timed out")] * 5, 5)
    sink, delays = run_sink(transport, transition(),
                            retry=RetryPolicy(max_attempts=5, base_delay=1.0, max_delay=4.0))
    assert delays == [1.0, 2.0, 4.0, 4.0]
    stats = sink.stats()
    assert (stats.delivered, stats.failed, stats.retries) == (0, 1, 4)


def test_client_errors_are_not_retried() -> None:
    transport = FakeTransport([HttpResponse(400)], 1)
    sink, delays = run_sink(transport, transition())
    assert delays == [] and sink.stats().failed == 1


def test_full_queue_drops_the_oldest() -> None:
    sink = WebhookSink(URL, transport=FakeTransport([], 1), queue_size=2)
    for _ in range(3):
        sink.notify(transition())
    assert (sink.stats().dropped, sink.stats().queued) == (1, 2)
    sink.close(timeout=1)  # never started: what was queued is counted as dropped
    assert (sink.stats().dropped, sink.stats().queued) == (3, 0)


def test_urls_are_masked_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    assert mask_url(URL) == "https://hooks.example.com/…"
    assert mask_url("http://user:pw@[::1]:8080/x?token=1") == "http://[::1]:8080/…"
    run_sink(FakeTransport([HttpResponse(404)], 1), transition())
    assert "s3cret" not in caplog.text and "hooks.example.com/…" in caplog.text


def test_urllib_transport_and_receiver_round_trip() -> None:
    with WebhookReceiver(statuses=[503]) as receiver:
        sink = WebhookSink(receiver.url, sleep=lambda _: None)
        sink.start()
        sink.notify(transition())
        (body,) = receiver.wait_for(lambda got: len(got) == 1, timeout=10)
        sink.close(timeout=10)
        assert body["category"] == "numerical"
        assert receiver.requests[0].headers["idempotency-key"] == f"{body['id']}:firing"
        assert sink.stats().retries == 1 and sink.stats().delivered == 1


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


