"""gradwatch's self-alerts, as shipped, against a real Prometheus scraping a real collector.

Prometheus scrapes the collector under the job name the Prometheus Operator
gives a ServiceMonitor's targets (the Service's name, ``gradwatch-collector``,
with its ``namespace``/``service``/``endpoint`` target labels), not the
``gradwatch`` of ``deploy/prometheus/prometheus.yml``: the rules must find the
collector whatever its job is called. The ``gradwatch-collector`` group of
``alerts.yml`` is loaded as shipped, only its ``for`` cut to 0 s (the minutes
are promtool's to test, in ``alerts.test.yml``). In one run:

1. no collector yet: ``GradwatchCollectorAbsent`` fires, ``GradwatchCollectorDown``
   does not (a target that never answered is not known to be a collector);
2. the collector starts: both are inactive (``Absent`` does not fire forever, as
   ``absent(up{job="gradwatch"})`` did under the Operator's job name);
3. it stops: ``Down`` fires and reaches a webhook through a real Alertmanager
   (``deploy/alertmanager/alertmanager.yml``), with the Operator's labels;
4. it starts again: ``Down`` resolves, and the resolve reaches the webhook.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

pytest.importorskip("torch")

from gradwatch.collector.receiver import WebhookReceiver
from tests.integration.promstack import (
    PROMETHEUS_DIR,
    Running,
    api,
    free_port,
    start_alertmanager,
    start_prometheus,
    wait_until,
)
from tests.integration.training import running_collector

GROUP = "gradwatch-collector"
DOWN = "GradwatchCollectorDown"
ABSENT = "GradwatchCollectorAbsent"
# What the Prometheus Operator sets on a ServiceMonitor's targets (deploy/k8s/collector.yaml).
OPERATOR_JOB = "gradwatch-collector"
OPERATOR_LABELS = {"namespace": "ml", "service": "gradwatch-collector", "endpoint": "metrics"}
TIMEOUT_S = 30.0


def _shipped_rules_without_delay(workdir: Path) -> Path:
    """The collector group of alerts.yml as shipped, every ``for`` cut to 0 s."""
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    (group,) = [g for g in groups if g["name"] == GROUP]
    alerts = {rule["alert"] for rule in group["rules"] if "alert" in rule}
    assert {DOWN, ABSENT} <= alerts, f"alerts.yml's {GROUP} group lost a self-alert: {alerts}"
    for rule in group["rules"]:
        if "for" in rule:
            rule["for"] = "0s"
    path = workdir / "collector-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    return path


def _states(prom: Running) -> dict[str, list[dict[str, Any]]]:
    """Alert name -> the alerts Prometheus holds for it now (pending or firing)."""
    held: dict[str, list[dict[str, Any]]] = {DOWN: [], ABSENT: []}
    for alert in api(prom.url, "/api/v1/alerts")["alerts"]:
        held.setdefault(alert["labels"]["alertname"], []).append(alert)
    return held


def _settles(
    prom: Running, want: Callable[[dict[str, list[dict[str, Any]]]], bool], what: str
) -> dict[str, list[dict[str, Any]]]:
    """Wait until the held alerts satisfy ``want`` in an evaluation begun after now."""

    def last_evaluation() -> str:
        (group,) = [g for g in api(prom.url, "/api/v1/rules")["groups"] if g["name"] == GROUP]
        return str(group["lastEvaluation"])

    before = last_evaluation()

    def probe() -> dict[str, list[dict[str, Any]]] | None:
        if last_evaluation() == before:
            return None
        states = _states(prom)
        return states if want(states) else None

    return wait_until(probe, TIMEOUT_S, f"{what}; Prometheus log:\n{prom.log_tail()}")


def _ours(body: Any, status: str, instance: str) -> list[dict[str, Any]]:
    return [
        alert
        for alert in body.get("alerts", ())
        if alert["status"] == status
        and alert["labels"].get("alertname") == DOWN
        and alert["labels"].get("instance") == instance
    ]


def _delivered(status: str, instance: str) -> Callable[[list[Any]], bool]:
    return lambda bodies: any(_ours(body, status, instance) for body in bodies)


def _scraped_as_collector(prom: Running, target: str) -> None:
    """Wait until Prometheus has scraped the collector at ``target`` at least once."""
    selector = f'gradwatch_build_info{{job="{OPERATOR_JOB}",instance="{target}"}}'
    wait_until(
        lambda: api(prom.url, "/api/v1/query", query=selector)["result"] or None,
        TIMEOUT_S,
        f"{selector} in Prometheus; log:\n{prom.log_tail()}",
    )


def test_self_alerts_under_the_operators_job_name(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens here until the collector starts
    rules = _shipped_rules_without_delay(tmp_path)
    with (
        WebhookReceiver() as receiver,
        start_alertmanager(tmp_path / "alertmanager", receiver.url) as am,
        start_prometheus(
            tmp_path / "prometheus",
            [target],
            [am.url],
            [rules],
            job_name=OPERATOR_JOB,
            target_labels=OPERATOR_LABELS,
        ) as prom,
    ):
        # 1. No collector has ever answered: absent, but nothing known to be down.
        states = _settles(prom, lambda s: bool(s[ABSENT]), f"{ABSENT} before any collector")
        assert states[DOWN] == []

        # 2. A healthy collector under the Operator's job name: neither fires.
        with running_collector(metrics_addr=target):
            _scraped_as_collector(prom, target)
            _settles(
                prom,
                lambda s: not s[ABSENT] and not s[DOWN],
                f"{ABSENT} resolving once the collector is scraped",
            )

        # 3. It stops: Down fires, with the scrape's labels, and reaches the webhook.
        states = _settles(prom, lambda s: bool(s[DOWN]), f"{DOWN} after the collector stopped")
        (down,) = states[DOWN]
        assert down["labels"]["job"] == OPERATOR_JOB
        assert down["labels"]["instance"] == target
        assert down["labels"]["namespace"] == OPERATOR_LABELS["namespace"]
        bodies = receiver.wait_for(_delivered("firing", target), TIMEOUT_S)
        (alert,) = _ours(next(b for b in bodies if _ours(b, "firing", target)), "firing", target)
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["job"] == OPERATOR_JOB
        assert alert["annotations"]["summary"] == f"gradwatch collector {target} cannot be scraped"
        assert f"curl http://{target}/readyz" in alert["annotations"]["runbook"]
        # Sent by our Prometheus (its URL names the host, not 127.0.0.1).
        assert urlsplit(alert["generatorURL"]).port == urlsplit(prom.url).port

        # 4. Back again: Down resolves, and so does its notification.
        with running_collector(metrics_addr=target):
            _settles(
                prom,
                lambda s: not s[DOWN] and not s[ABSENT],
                f"{DOWN} resolving once the collector is back",
            )
            receiver.wait_for(_delivered("resolved", target), TIMEOUT_S)
