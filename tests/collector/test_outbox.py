"""The durable outbox: stored before sent, retried with backoff, bounded, resumed after restart."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.outbox_store import OUTBOX_FILE, Outbox, OutboxError
from gradwatch.collector.routing import RoutePolicy, Router
from gradwatch.collector.webhook import (
    HttpRequest,
    HttpResponse,
    RetryPolicy,
    TransportError,
    WebhookChannel,
)
from gradwatch.rules import Alert, Transition

URL = "https://hooks.example.com/services/T0/B0/s3cret"


def transition(current: str = "firing", step: int = 12) -> Transition:
    alert = Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job="run-1",
        state="firing",
        step=step,
        summary="loss is nan",
        started_at=1.0,
        evidence={"loss": float("nan")},
        rank=0,
    )
    if current == "resolved":
        return Transition(replace(alert, state="resolved", resolved_at=2.0), "firing", "resolved")
    # The helper takes a plain str; callers pass valid literal values.
    return Transition(alert, "pending", current)  # type: ignore[arg-type]


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ScriptedTransport:
    """Answers from a script (a response or an exception per call), then 200."""

    def __init__(self, script: Sequence[HttpResponse | Exception] = ()) -> None:
        self.script = list(script)
        self.requests: list[HttpRequest] = []

    def __call__(self, request: HttpRequest) -> HttpResponse:
        self.requests.append(request)
        answer = self.script.pop(0) if self.script else HttpResponse(200)
        if isinstance(answer, Exception):
            raise answer
        return answer


def make_sink(
    transport: ScriptedTransport, clock: Clock, outbox: Outbox | None = None, **options: object
) -> OutboxSink:
    return OutboxSink(
        "webhook-0",
        WebhookChannel(URL),
        outbox,
        transport=transport,
        clock=clock,
        jitter=lambda: 1.0,
        retry=RetryPolicy(base_delay=1.0, max_delay=8.0),
        **options,
    )  # type: ignore[arg-type]  # options are untyped test overrides, passed through as given


def test_every_notification_is_stored_before_delivery_and_sent_once() -> None:
    transport, clock = ScriptedTransport(), Clock()
    sink = make_sink(transport, clock)
    sink.notify(transition("pending"))
    sink.notify(transition())
    sink.notify(transition())  # a repeat of the same id and state
    assert sink.stats().queued == 1 and transport.requests == []
    sink.deliver_due()
    sink.notify(transition())  # already delivered: never sent again
    sink.notify(transition("resolved"))
    sink.deliver_due()
    ids = [r.headers["webhook-id"] for r in transport.requests]
    first = json.loads(transport.requests[0].body)
    assert ids == [f"{first['id']}:firing", f"{first['id']}:resolved"]
    assert first["evidence"] == {"loss": "nan"} and first["kind"] == "gradwatch.alert"
    stats = sink.stats()
    assert (stats.delivered, stats.queued, stats.retries, stats.failed) == (2, 0, 0, 0)


def test_failures_back_off_exponentially_then_deliver() -> None:
    transport, clock = ScriptedTransport([HttpResponse(503), TransportError("refused")]), Clock()
    sink = make_sink(transport, clock)
    sink.notify(transition())
    waits = []
    for _ in range(3):
        waits.append(sink.deliver_due())
        clock.now += waits[-1]
    assert waits[:2] == [1.0, 2.0]
    assert len(transport.requests) == 3
    stats = sink.stats()
    assert (stats.delivered, stats.retries, stats.queued) == (1, 2, 0)


def test_retry_after_is_honoured() -> None:
    transport = ScriptedTransport([HttpResponse(429, {"Retry-After": "7"})])
    sink = make_sink(transport, Clock())
    sink.notify(transition())
    assert sink.deliver_due() == 7.0
    assert sink.deliver_due() == 7.0 and len(transport.requests) == 1  # not due yet


def test_gives_up_only_after_max_age() -> None:
    transport, clock = ScriptedTransport([HttpResponse(500)] * 100), Clock()
    sink = make_sink(transport, clock, max_age=60.0)
    sink.notify(transition())
    while sink.stats().queued:
        clock.now += sink.deliver_due()
    stats = sink.stats()
    assert (stats.failed, stats.delivered) == (1, 0)
    assert stats.retries == len(transport.requests) - 1 >= 5  # 1+2+4+8+8+8+8+8+8 s ~ 60 s


def test_a_rejection_is_retried_loudly_until_the_receiver_is_fixed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport, clock = ScriptedTransport([HttpResponse(404), HttpResponse(404)]), Clock()
    sink = make_sink(transport, clock)
    sink.notify(transition())
    for _ in range(3):
        clock.now += sink.deliver_due()
    assert (sink.stats().delivered, sink.stats().retries, len(transport.requests)) == (1, 2, 3)
    assert caplog.text.count("rejected notification") == 1
    assert "s3cret" not in caplog.text and "hooks.example.com/…" in caplog.text


def test_pending_rows_are_bounded_oldest_dropped() -> None:
    transport, clock = ScriptedTransport(), Clock()
    sink = make_sink(transport, clock, Outbox(max_pending=2))
    for step in (1, 2, 3):
        clock.now += 1
        sink.notify(transition(step=step))
    assert (sink.stats().dropped, sink.stats().queued) == (1, 2)
    sink.deliver_due()
    steps = [json.loads(r.body)["step"] for r in transport.requests]
    assert steps == [2, 3]


def test_rate_limit_queues_the_excess_instead_of_dropping_it() -> None:
    transport, clock = ScriptedTransport(), Clock()
    sink = make_sink(transport, clock, router=Router(RoutePolicy(rate_per_minute=6, flap_max=100)))
    for step in range(5):
        sink.notify(transition(step=step))
    wait = sink.deliver_due()
    assert len(transport.requests) == 1 and 5.0 < wait <= 10.0
    assert (sink.stats().queued, sink.stats().dropped) == (4, 0)


def test_pending_rows_survive_a_restart_on_disk(tmp_path: Path) -> None:
    clock = Clock()
    down = ScriptedTransport([HttpResponse(503)])
    first = make_sink(down, clock, Outbox.open(tmp_path))
    first.notify(transition())
    assert first.deliver_due() == 1.0
    first.outbox.close()  # as if killed: no close(), nothing else flushed
    with sqlite3.connect(tmp_path / OUTBOX_FILE) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("SELECT state, attempts FROM outbox").fetchall() == [("pending", 1)]
    up = ScriptedTransport()
    second = make_sink(up, clock, Outbox.open(tmp_path))
    second.start()  # resumes the pending row and makes it due now
    try:
        second.notify(transition())  # the restarted engine may fire it again: not re-stored
        second.wait_for(lambda stats: stats.delivered == 1, timeout=10)
    finally:
        second.close(timeout=5)
    assert len(up.requests) == 1
    assert up.requests[0].headers["webhook-id"] == down.requests[0].headers["webhook-id"]


def test_prune_forgets_only_old_finished_rows() -> None:
    outbox = Outbox()
    outbox.put("s", "a:firing", "{}", now=0.0)
    outbox.put("s", "b:firing", "{}", now=0.0)
    (row, _) = outbox.due("s", now=0.0)
    outbox.finish(row, "delivered", now=10.0)
    assert outbox.prune(before=5.0) == 0 and outbox.prune(before=11.0) == 1
    assert outbox.pending("s") == 1
    assert outbox.put("s", "a:firing", "{}", now=12.0) == (True, 0)  # forgotten: stored anew


def test_an_unwritable_data_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutboxError, match="data dir"):
        Outbox.open(blocker / "sub")


def test_closing_an_in_memory_outbox_counts_what_is_lost() -> None:
    sink = make_sink(ScriptedTransport(), Clock())
    sink.notify(transition())
    sink.close(timeout=1)  # never started: nothing was sent, and nothing can be later
    sink.close(timeout=1)
    assert (sink.stats().dropped, sink.stats().queued, sink.alive()) == (1, 0, False)
