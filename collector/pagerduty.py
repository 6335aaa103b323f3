"""PagerDuty Events API v2: trigger on firing, resolve on resolved, one incident per alert.

``POST https://events.pagerduty.com/v2/enqueue`` with ``routing_key`` (the
integration key: a secret, never logged or stored in the outbox; it is added
when the request is built), ``event_action`` (``trigger`` / ``resolve``) and
``dedup_key`` = the alert id, stable for the whole incident, so retries and
restarts update one PagerDuty alert instead of opening new ones. A trigger
carries ``payload`` with ``summary`` (at most 1024 characters), ``source``,
``severity`` (critical / warning / info map one to one), ``timestamp``,
``component``, ``group``, ``class`` and ``custom_details`` (evidence,
diagnosis, step, rank). PagerDuty answers 202; anything else (429, 5xx, a
400 for an invalid key) is retried by the outbox until its max age, and a
rejection is logged as a warning.

Example::

    from gradwatch.collector.pagerduty import pagerduty_event

    event = pagerduty_event(alert.to_dict(), routing_key="R0123456789ABCDEF0123456789ABCDE")
    event["event_action"], event["dedup_key"]   # ('trigger', '3f2a…')
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from gradwatch.collector.config import VERSION
from gradwatch.collector.sinks import mask_url
from gradwatch.collector.slack import clip
from gradwatch.collector.webhook import HttpRequest

EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
SUMMARY_MAX = 1024
DEDUP_KEY_MAX = 255
SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}


def iso8601(seconds: float) -> str:
    """Unix seconds as an RFC 3339 UTC timestamp with milliseconds."""
    return (
        datetime.fromtimestamp(seconds, timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def pagerduty_event(alert: Mapping[str, Any], routing_key: str) -> dict[str, Any]:
    """The Events API v2 body for one alert (``Alert.to_dict()`` form)."""
    event: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "trigger" if alert["state"] == "firing" else "resolve",
        "dedup_key": clip(str(alert["id"]), DEDUP_KEY_MAX),
    }
    if alert["state"] != "firing":
        return event  # a resolve needs only the key; PagerDuty ignores a payload on it
    rank = alert.get("rank")
    where = alert["job"] if rank is None else f"{alert['job']}/rank-{rank}"
    started = alert.get("started_at")
    event["client"] = "gradwatch"
    event["payload"] = {
        "summary": clip(f"{alert['rule']} on {where}: {alert['summary']}", SUMMARY_MAX),
        "source": f"gradwatch:{where}",
        "severity": SEVERITY.get(alert["severity"], "error"),
        **({"timestamp": iso8601(started)} if isinstance(started, (int, float)) else {}),
        "component": alert["job"],
        "group": alert["category"],
        "class": alert["rule"],
        "custom_details": {
            "alert_id": alert["id"],
            "step": alert["step"],
            "rank": rank,
            "evidence": alert.get("evidence") or {},
            "diagnosis": alert.get("diagnosis"),
            "last_good_checkpoint": alert.get("last_good_checkpoint"),
        },
    }
    return event


class PagerDutyChannel:
    """POSTs :func:`pagerduty_event` to the Events API (``url`` configurable for tests)."""

    def __init__(self, routing_key: str, *, url: str = EVENTS_URL, timeout: float = 5.0) -> None:
        self._routing_key = routing_key
        self._url = url
        self._timeout = timeout
        self.target = f"PagerDuty {mask_url(url)}"

    def request(self, notification_id: str, alert: Mapping[str, Any], now: float) -> HttpRequest:
        body = json.dumps(pagerduty_event(alert, self._routing_key), allow_nan=False).encode()
        return HttpRequest(
            self._url,
            body,
            {"Content-Type": "application/json", "User-Agent": f"gradwatch/{VERSION}"},
            self._timeout,
        )

    def __repr__(self) -> str:
        return f"PagerDutyChannel({self.target!r})"
