"""Slack, PagerDuty, Alertmanager and signed webhook requests against their documented fields."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from gradwatch.collector.alertmanager import AlertmanagerChannel, AlertmanagerSink
from gradwatch.collector.config import ConfigError, load_config
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.pagerduty import PagerDutyChannel, pagerduty_event
from gradwatch.collector.signing import decode_secret, verify
from gradwatch.collector.sinks import alert_payload
from gradwatch.collector.slack import SlackChannel, slack_message
from gradwatch.collector.webhook import HttpRequest, HttpResponse, WebhookChannel
from gradwatch.collector.wiring import build_sinks
from gradwatch.rules import Alert, Transition

NOW = 1_700_000_100.0
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
DIAGNOSIS = {
    "verdict": "numerical",
    "summary": "loss was nan at step 41",
    "next_checks": ["check the data loader", "lower the LR"],
}


def alert(state: str = "firing", **changes: Any) -> Alert:
    base = Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job="run-42",
        state="firing",
        step=41,
        summary="loss is nan <b>&</b>",
        started_at=1_700_000_000.0,
        evidence={"loss": float("nan"), "lr": 0.1},
        diagnosis=DIAGNOSIS,
        rank=3,
        labels={"team": "ml"},
    )
    if state == "resolved":
        base = replace(base, state="resolved", resolved_at=1_700_000_050.0)
    return replace(base, **changes)


def stored(a: Alert) -> dict[str, Any]:
    """The alert as the outbox stores it (JSON round trip)."""
    return json.loads(json.dumps(alert_payload(a)))


def test_slack_message_is_one_readable_block_kit_message() -> None:
    msg = slack_message(stored(alert()))
    assert msg["text"].startswith("[critical] NonFiniteGradients firing on job run-42")
    types = [b["type"] for b in msg["blocks"]]
    assert types == ["header", "section", "section", "section", "context"]
    header, summary, evidence, diagnosis, context = msg["blocks"]
    assert header["text"] == {
        "type": "plain_text",
        "text": "🔴 NonFiniteGradients firing",
        "emoji": True,
    }
    assert "loss is nan &lt;b&gt;&amp;&lt;/b&gt;" in summary["text"]["text"]
    assert [f["text"] for f in evidence["fields"]] == ["loss\nnan", "lr\n0.1"]
    assert "Next checks:\n• check the data loader\n• lower the LR" in diagnosis["text"]["text"]
    texts = [e["text"] for e in context["elements"]]
    assert texts[:3] == ["job run-42", "rank 3", "step 41"]


def test_slack_message_respects_block_kit_limits() -> None:
    huge = stored(
        alert(rule="R" * 500, summary="<" * 5000, evidence={f"k{i}": "v" * 3000 for i in range(25)})
    )
    msg = slack_message(huge)
    header, summary, evidence = msg["blocks"][:3]
    assert len(header["text"]["text"]) <= 150
    assert len(summary["text"]["text"]) <= 3000
    assert not summary["text"]["text"].rstrip("…").endswith(("&", "&l", "&lt"))
    assert len(evidence["fields"]) <= 10
    assert all(len(f["text"]) <= 2000 for f in evidence["fields"])
    assert evidence["fields"][-1]["text"].startswith("+16 more")
    assert len(msg["text"]) <= 3000


def test_slack_resolved_and_request() -> None:
    request = SlackChannel("https://hooks.slack.com/services/T/B/secret").request(
        "x:resolved", stored(alert("resolved")), NOW
    )
    body = json.loads(request.body)
    assert body["blocks"][0]["text"]["text"] == "✅ NonFiniteGradients resolved"
    assert request.headers["Content-Type"].startswith("application/json")


def test_pagerduty_trigger_has_the_required_fields() -> None:
    event = pagerduty_event(stored(alert()), routing_key="R" * 32)
    assert event["routing_key"] == "R" * 32 and event["event_action"] == "trigger"
    assert event["dedup_key"] == alert().id
    payload = event["payload"]
    # Required by Events API v2: summary (<= 1024 chars), source, severity.
    assert payload["summary"].startswith("NonFiniteGradients on run-42/rank-3: loss is nan")
    assert payload["source"] == "gradwatch:run-42/rank-3"
    assert payload["severity"] == "critical"
    assert datetime.fromisoformat(payload["timestamp"]).timestamp() == 1_700_000_000.0
    details = payload["custom_details"]
    assert details["evidence"] == {"loss": "nan", "lr": 0.1} and details["diagnosis"] == DIAGNOSIS


def test_pagerduty_severity_mapping_summary_limit_and_resolve() -> None:
    for severity in ("critical", "warning", "info"):
        event = pagerduty_event(stored(alert(severity=severity)), routing_key="k")
        assert event["payload"]["severity"] == severity
    long = pagerduty_event(stored(alert(summary="x" * 5000)), routing_key="k")
    assert len(long["payload"]["summary"]) == 1024
    resolve = pagerduty_event(stored(alert("resolved")), routing_key="k")
    assert resolve == {"routing_key": "k", "event_action": "resolve", "dedup_key": alert().id}


def test_pagerduty_channel_posts_to_the_configured_url_and_hides_the_key() -> None:
    channel = PagerDutyChannel("sekrit-key", url="http://127.0.0.1:9/v2/enqueue")
    request = channel.request("id:firing", stored(alert()), NOW)
    assert request.url == "http://127.0.0.1:9/v2/enqueue"
    assert json.loads(request.body)["routing_key"] == "sekrit-key"
    assert "sekrit" not in repr(channel) and "sekrit" not in channel.target


def test_alertmanager_postable_alert() -> None:
    channel = AlertmanagerChannel(
        "http://am:9093/", resend_interval=60, generator_url="http://collector:9400/metrics"
    )
    request = channel.request("id:firing", stored(alert()), NOW)
    assert request.url == "http://am:9093/api/v2/alerts"
    (posted,) = json.loads(request.body)
    assert posted["labels"] == {
        "alertname": "NonFiniteGradients",
        "severity": "critical",
        "category": "numerical",
        "training_job": "run-42",
        "job": "run-42",
        "rank": "3",
        "team": "ml",
    }
    assert set(posted["annotations"]) >= {"summary", "description", "diagnosis"}
    assert posted["startsAt"] == "2023-11-14T22:13:20.000Z"
    assert posted["endsAt"] == "2023-11-14T22:19:00.000Z"  # NOW + 4 x 60 s
    assert posted["generatorURL"] == "http://collector:9400/metrics"
    (resolved,) = json.loads(channel.request("id:resolved", stored(alert("resolved")), NOW).body)
    assert resolved["endsAt"] == "2023-11-14T22:14:10.000Z"  # the resolve time


class Recorder:
    def __init__(self) -> None:
        self.requests: list[HttpRequest] = []

    def __call__(self, request: HttpRequest) -> HttpResponse:
        self.requests.append(request)
        return HttpResponse(200)


def test_alertmanager_sink_reposts_firing_alerts_until_resolved() -> None:
    now = [NOW]
    transport = Recorder()
    sink = AlertmanagerSink(
        "http://am:9093", resend_interval=60, transport=transport, clock=lambda: now[0]
    )
    sink.notify(Transition(alert(), "pending", "firing"))
    assert sink.deliver_due() == 60.0 and len(transport.requests) == 1
    now[0] += 60
    sink.deliver_due()
    assert len(transport.requests) == 2 and sink.reposts == 1
    (reposted,) = json.loads(transport.requests[1].body)
    assert reposted["endsAt"] == "2023-11-14T22:20:00.000Z"  # pushed forward on each re-post
    sink.notify(Transition(alert("resolved"), "firing", "resolved"))
    sink.deliver_due()
    now[0] += 120
    sink.deliver_due()
    assert len(transport.requests) == 3 and sink.firing() == []
    assert json.loads(transport.requests[2].body)[0]["endsAt"] == "2023-11-14T22:14:10.000Z"


def test_generic_webhook_is_signed_per_standard_webhooks() -> None:
    key = decode_secret(SECRET)
    payload = stored(alert())
    request = WebhookChannel("http://127.0.0.1:9/hook", secret=key).request(
        f"{payload['id']}:firing", payload, NOW
    )
    assert verify(key, request.headers, request.body, now=NOW) == f"{payload['id']}:firing"
    assert json.loads(request.body) == payload
    unsigned = WebhookChannel("http://127.0.0.1:9/hook").request("a:firing", payload, NOW)
    assert "webhook-signature" not in unsigned.headers and unsigned.headers["webhook-id"]


def test_build_sinks_reads_secrets_from_env_or_files_and_never_shows_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "pd-key"
    key_file.write_text("pd-sekrit\n")
    monkeypatch.setenv(
        "GRADWATCH_SLACK_WEBHOOK_URL", "https://hooks.slack.com/services/T/B/sl-sekrit"
    )
    monkeypatch.setenv("GRADWATCH_ALERTMANAGER_URLS", "http://am-1:9093,http://am-2:9093")
    monkeypatch.setenv("GRADWATCH_ROUTES", '{"pagerduty": {"min_severity": "critical"}}')
    config = load_config(
        None,
        {
            "pagerduty_routing_key_file": key_file,
            "data_dir": tmp_path,
            "webhooks": ["http://127.0.0.1:9/hook"],
            "webhook_secret": SECRET,
        },
    )
    assert "sekrit" not in repr(config) and "MfKQ" not in repr(config)
    sinks = build_sinks(config)
    try:
        assert [s.name for s in sinks] == [
            "webhook-0",
            "slack",
            "pagerduty",
            "alertmanager-0",
            "alertmanager-1",
        ]
        assert all(isinstance(s, OutboxSink) for s in sinks)
        assert isinstance(sinks[3], AlertmanagerSink)
        assert sinks[2].router.policy.min_severity == "critical"
        # Every sink is an OutboxSink (asserted above), which has .channel.
        assert "sekrit" not in " ".join(repr(s.channel) for s in sinks)  # type: ignore[attr-defined]
        assert (tmp_path / "outbox.sqlite3").exists()
    finally:
        for sink in sinks:
            sink.close(timeout=1)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"webhook_secret": "not-a-whsec-secret"}, "webhook_secret: webhook secret must start"),
        (
            {"slack_webhook_url": "https://x/sekrit", "slack_webhook_url_file": "/nonexistent"},
            "both slack_webhook_url and slack_webhook_url_file",
        ),
        (
            {"pagerduty_routing_key_file": "/nonexistent/key"},
            "cannot read pagerduty_routing_key_file",
        ),
    ],
)
def test_bad_sink_secrets_are_clear_errors_that_hide_the_secret(
    overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        build_sinks(load_config(None, overrides))
    assert "sekrit" not in str(info.value) and "not-a-whsec" not in str(info.value)
