"""The inhibit rules in ``deploy/alertmanager/alertmanager.yml``, in a real Alertmanager.

Alerts are posted straight to its API v2 (as Prometheus and the collector's
Alertmanager sink do) and the test reads back which ones it suppresses.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradwatch.collector.alertmanager import alertmanager_alert
from gradwatch.collector.receiver import WebhookReceiver
from tests.integration.promstack import (
    Running,
    http_get,
    start_alertmanager,
    wait_until,
)

TIMEOUT_S = 15.0
COLLECTOR = "collector:9400"
NAN_ALERT = {
    "rule": "NonFiniteGradients",
    "severity": "critical",
    "category": "numerical",
    "job": "run-42",
    "rank": 0,
    "state": "firing",
    "step": 7,
    "summary": "NaN in the loss",
    "evidence": {},
}


@pytest.fixture()
def alertmanager(tmp_path: Path) -> Iterator[Running]:
    with (
        WebhookReceiver() as receiver,
        start_alertmanager(tmp_path / "alertmanager", receiver.url) as am,
    ):
        yield am


def _post(am: Running, *labels: dict[str, str]) -> None:
    body = json.dumps(
        [{"labels": label_set, "annotations": {"summary": "test"}} for label_set in labels]
    ).encode()
    request = urllib.request.Request(
        f"{am.url}/api/v2/alerts", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


Key = tuple[str, str]  # (alertname, training job, else scrape job, else instance)


def _held(am: Running) -> dict[Key, str]:
    """What Alertmanager holds: (alertname, training job, job or instance) -> its state."""
    alerts: list[dict[str, Any]] = json.loads(http_get(f"{am.url}/api/v2/alerts"))
    return {
        (
            a["labels"]["alertname"],
            a["labels"].get("training_job")
            or a["labels"].get("job")
            or a["labels"].get("instance", ""),
        ): a["status"]["state"]
        for a in alerts
    }


def _assert_states(am: Running, expected: dict[Key, str]) -> None:
    # Inhibition is applied asynchronously: poll until it settles (bounded).
    try:
        wait_until(lambda: _held(am) == expected or None, TIMEOUT_S, "inhibition settled")
    except TimeoutError:
        pass
    assert _held(am) == expected


def test_a_collector_down_mutes_its_warnings_but_not_other_collectors(
    alertmanager: Running,
) -> None:
    _post(
        alertmanager,
        {
            "alertname": "GradwatchCollectorDown",
            "severity": "critical",
            "job": "gradwatch-collector",
            "instance": COLLECTOR,
        },
        {
            "alertname": "GradwatchNotificationBacklog",
            "severity": "warning",
            "job": "gradwatch-collector",
            "instance": COLLECTOR,
            "sink": "webhook-0",
        },
        {"alertname": "GradwatchCollectorAbsent", "severity": "warning"},
        {
            "alertname": "GradwatchIngestRejecting",
            "severity": "warning",
            "instance": "other:9400",
            "reason": "malformed",
        },
    )
    _assert_states(
        alertmanager,
        {
            ("GradwatchCollectorDown", "gradwatch-collector"): "active",
            ("GradwatchNotificationBacklog", "gradwatch-collector"): "suppressed",
            ("GradwatchCollectorAbsent", ""): "suppressed",
            ("GradwatchIngestRejecting", "other:9400"): "active",
        },
    )


def test_the_collectors_own_nan_alert_mutes_the_prometheus_backup_for_that_job_only(
    alertmanager: Running,
) -> None:
    _post(
        alertmanager,
        # The labels each producer really sets: the collector's Alertmanager sink, and
        # Prometheus (job = its scrape job, the training job in training_job).
        alertmanager_alert(NAN_ALERT, now=time.time(), valid_for=300.0)["labels"],
        {
            "alertname": "GradwatchNonFiniteGradients",
            "severity": "critical",
            "job": "gradwatch-collector",
            "training_job": "run-42",
            "instance": COLLECTOR,
        },
        {
            "alertname": "GradwatchNonFiniteGradients",
            "severity": "critical",
            "job": "gradwatch-collector",
            "training_job": "run-43",
            "instance": COLLECTOR,
        },
    )
    _assert_states(
        alertmanager,
        {
            ("NonFiniteGradients", "run-42"): "active",
            ("GradwatchNonFiniteGradients", "run-42"): "suppressed",
            ("GradwatchNonFiniteGradients", "run-43"): "active",
        },
    )


def _collector_alert(rule: str, category: str, job: str) -> dict[str, str]:
    """The labels the collector's Alertmanager sink sets on one of its alerts."""
    alert = dict(NAN_ALERT, rule=rule, severity="warning", category=category, job=job)
    labels: dict[str, str] = alertmanager_alert(alert, now=time.time(), valid_for=300.0)["labels"]
    return labels


def test_inflating_weights_over_a_stalled_loss_mute_that_jobs_weight_runaway(
    alertmanager: Running,
) -> None:
    # nanoGPT at lr x100 raised both at step 121: one cause, one page.
    _post(
        alertmanager,
        _collector_alert("WeightsInflatingLossStalled", "lr_too_high", "run-42"),
        _collector_alert("WeightNormRunaway", "weight_runaway", "run-42"),
        _collector_alert("WeightNormRunaway", "weight_runaway", "run-43"),
    )
    _assert_states(
        alertmanager,
        {
            ("WeightsInflatingLossStalled", "run-42"): "active",
            ("WeightNormRunaway", "run-42"): "suppressed",
            ("WeightNormRunaway", "run-43"): "active",
        },
    )
