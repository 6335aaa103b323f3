"""Slack incoming webhook: one readable Block Kit message per firing or resolved alert.

The message has a ``text`` fallback (notifications, screen readers) and
``blocks``: a header (rule and state), the summary, the evidence as fields, the
diagnosis with the checks to run next, and a context line with job, rank, step
and alert id. Every text is cut to Block Kit's limits (header 150 characters,
section text 3000, at most 10 fields of 2000, at most 10 context elements), so
no alert is ever refused by Slack for its size. Send it through the outbox:
``OutboxSink("slack", SlackChannel(url), outbox)``.

Example::

    from gradwatch.collector.slack import slack_message

    message = slack_message(alert.to_dict())
    message["blocks"][0]["text"]["text"]   # '🔴 NonFiniteGradients firing'
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gradwatch.collector.config import VERSION
from gradwatch.collector.sinks import mask_url
from gradwatch.collector.webhook import HttpRequest

HEADER_MAX = 150
SECTION_MAX = 3000
FIELD_MAX = 2000
FIELDS_MAX = 10
CONTEXT_MAX = 10
TEXT_MAX = 3000
ICONS = {"critical": "🔴", "warning": "🟠", "info": "🔵"}
RESOLVED_ICON = "✅"


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def escape(text: str) -> str:
    """Slack mrkdwn control characters as entities (Slack's own escaping rule)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def mrkdwn(text: str, limit: int) -> str:
    """Escaped ``text`` within ``limit`` characters, never cut inside an entity."""
    escaped = escape(text)
    if len(escaped) <= limit:
        return escaped
    cut = limit - 1
    while len(escape(text[:cut])) > limit - 1:
        cut -= len(escape(text[:cut])) - (limit - 1)
    return escape(text[:cut]) + "…"


def slack_message(alert: Mapping[str, Any]) -> dict[str, Any]:
    """The incoming-webhook JSON for one alert (``Alert.to_dict()`` form)."""
    firing = alert["state"] == "firing"
    icon = ICONS.get(alert["severity"], "") if firing else RESOLVED_ICON
    title = f"{icon} {alert['rule']} {alert['state']}".strip()
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {"type": "plain_text", "text": clip(title, HEADER_MAX), "emoji": True},
        },
        _section(f"*{alert['severity'].upper()}* {alert['category']}: {alert['summary']}"),
    ]
    fields = _evidence_fields(alert.get("evidence") or {})
    if fields:
        blocks.append({"type": "section", "fields": fields})
    diagnosis = _diagnosis_text(alert.get("diagnosis"))
    if diagnosis:
        blocks.append(_section(diagnosis))
    blocks.append({"type": "context", "elements": _context(alert)})
    text = (
        f"[{alert['severity']}] {alert['rule']} {alert['state']} on job {alert['job']}: "
        f"{alert['summary']}"
    )
    return {"text": clip(text, TEXT_MAX), "blocks": blocks}


def _section(text: str) -> dict[str, Any]:
    # Escaping leaves '*' alone, so the bold markers callers add survive.
    return {"type": "section", "text": {"type": "mrkdwn", "text": mrkdwn(text, SECTION_MAX)}}


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "))
    return str(value)


def _evidence_fields(evidence: Mapping[str, Any]) -> list[dict[str, str]]:
    items = list(evidence.items())
    shown = items if len(items) <= FIELDS_MAX else items[: FIELDS_MAX - 1]
    fields = [
        {"type": "mrkdwn", "text": mrkdwn(f"{key}\n{_value(value)}", FIELD_MAX)}
        for key, value in shown
    ]
    if len(items) > len(shown):
        fields.append(
            {
                "type": "mrkdwn",
                "text": f"+{len(items) - len(shown)} more (see the webhook or /metrics)",
            }
        )
    return fields


def _diagnosis_text(diagnosis: Mapping[str, Any] | None) -> str:
    if not diagnosis:
        return ""
    lines = [f"Diagnosis: {diagnosis.get('verdict', '?')}"]
    if diagnosis.get("summary"):
        lines.append(str(diagnosis["summary"]))
    checks = list(diagnosis.get("next_checks") or ())
    if checks:
        lines.append("Next checks:")
        lines += [f"• {check}" for check in checks]
    return "\n".join(lines)


def _context(alert: Mapping[str, Any]) -> list[dict[str, str]]:
    parts = [
        f"job {alert['job']}",
        f"rank {'-' if alert.get('rank') is None else alert['rank']}",
        f"step {alert['step']}",
        f"alert {alert['id']}",
    ]
    if alert.get("last_good_checkpoint"):
        parts.append(f"last good checkpoint {alert['last_good_checkpoint']}")
    return [{"type": "mrkdwn", "text": mrkdwn(part, FIELD_MAX)} for part in parts[:CONTEXT_MAX]]


class SlackChannel:
    """POSTs :func:`slack_message` to a Slack incoming webhook URL (a secret: never logged)."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self._url = url
        self._timeout = timeout
        self.target = mask_url(url)

    def request(self, notification_id: str, alert: Mapping[str, Any], now: float) -> HttpRequest:
        body = json.dumps(slack_message(alert), ensure_ascii=False).encode()
        return HttpRequest(
            self._url,
            body,
            {
                "Content-Type": "application/json; charset=utf-8",
                "User-Agent": f"gradwatch/{VERSION}",
            },
            self._timeout,
        )

    def __repr__(self) -> str:
        return f"SlackChannel({self.target!r})"
