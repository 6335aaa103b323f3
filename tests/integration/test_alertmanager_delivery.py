"""The collector's alerts reach a real Alertmanager, which delivers them to a webhook.

agent (NaN at a known step) -> collector (``alertmanager_urls``) -> Alertmanager
(``deploy/alertmanager/alertmanager.yml``, grouping in 1 s) -> ``WebhookReceiver``.
The job then goes silent, the collector forgets it (``job_ttl_seconds``) and
resolves its alerts, and Alertmanager sends ``status: resolved``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from gradwatch.collector.receiver import WebhookReceiver
from tests.integration.promstack import start_alertmanager
from tests.integration.training import running_collector, train

JOB = "it-alertmanager"
NAN_STEP = 7
RULE = "NonFiniteGradients"
TIMEOUT_S = 30.0
JOB_TTL_S = 1.0  # how soon the silent job is forgotten and its alerts resolved


def _delivered(status: str) -> Callable[[list[Any]], bool]:
    def match(bodies: list[Any]) -> bool:
        return any(_ours(body, status) for body in bodies)

    return match


def _ours(body: Any, status: str) -> list[dict[str, Any]]:
    """The alerts for our job and rule in one Alertmanager webhook body with ``status``."""
    return [
        alert
        for alert in body.get("alerts", ())
        if alert["status"] == status
        and alert["labels"].get("alertname") == RULE
        and alert["labels"].get("job") == JOB
    ]


def test_alertmanager_delivers_the_collector_alert_and_its_resolve(tmp_path: Path) -> None:
    with (
        WebhookReceiver() as receiver,
        start_alertmanager(tmp_path / "alertmanager", receiver.url) as am,
        running_collector(alertmanager_urls=[am.url], job_ttl_seconds=JOB_TTL_S) as collector,
    ):
        train(collector, JOB, 2 * NAN_STEP, nan_step=NAN_STEP)

        bodies = receiver.wait_for(_delivered("firing"), TIMEOUT_S)
        body = next(b for b in bodies if _ours(b, "firing"))
        (alert,) = _ours(body, "firing")
        assert body["version"] == "4" and body["receiver"] == "gradwatch-webhook"
        assert body["groupLabels"]["alertname"] == RULE
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["category"] == "numerical"
        assert alert["labels"]["rank"] == "0"
        assert alert["annotations"]["summary"]
        assert f"since step {NAN_STEP}" in alert["annotations"]["description"]

        bodies = receiver.wait_for(_delivered("resolved"), TIMEOUT_S)
        body = next(b for b in bodies if _ours(b, "resolved"))
        (resolved,) = _ours(body, "resolved")
        assert body["status"] == "resolved"  # the group holds only this alert
        assert resolved["fingerprint"] == alert["fingerprint"]
        assert resolved["endsAt"] >= resolved["startsAt"] == alert["startsAt"]

        stats = [sink.stats() for sink in collector.sinks]
        assert sum(s.delivered for s in stats) >= 2, stats
        assert sum(s.failed + s.dropped for s in stats) == 0, stats
