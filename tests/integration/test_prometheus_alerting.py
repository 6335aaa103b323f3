"""gradwatch's Prometheus alerts reach a webhook through the example configs.

Prometheus (``deploy/prometheus/prometheus.yml``) scrapes a collector address
where nothing listens yet; ``GradwatchCollectorDown`` from ``alerts.yml`` (its
``for`` cut to 0 s: the 2 minutes are promtool's to test) fires, goes to a real
Alertmanager (``deploy/alertmanager/alertmanager.yml``) and on to a webhook.
Once a collector listens there, the resolve follows the same way.
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
    free_port,
    start_alertmanager,
    start_prometheus,
)
from tests.integration.training import running_collector

RULE = "GradwatchCollectorDown"
TIMEOUT_S = 30.0


def _rules_without_delay(workdir: Path) -> Path:
    """A rule file holding only ``RULE`` from alerts.yml, firing without ``for``."""
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    (rule,) = [r for group in groups for r in group["rules"] if r.get("alert") == RULE]
    rule["for"] = "0s"
    path = workdir / "collector-down.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "test", "rules": [rule]}]}))
    return path


def _ours(body: Any, status: str, instance: str) -> list[dict[str, Any]]:
    return [alert for alert in body.get("alerts", ()) if alert["status"] == status
            and alert["labels"].get("alertname") == RULE
            and alert["labels"].get("instance") == instance]


def _delivered(status: str, instance: str) -> Callable[[list[Any]], bool]:
    return lambda bodies: any(_ours(body, status, instance) for body in bodies)


def test_collector_down_reaches_the_webhook_and_resolves(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens here until the collector starts
    rules = _rules_without_delay(tmp_path)
    with WebhookReceiver() as receiver, \
            start_alertmanager(tmp_path / "alertmanager", receiver.url) as am, \
            start_prometheus(tmp_path / "prometheus", [target], [am.url], [rules]) as prom:
        bodies = receiver.wait_for(_delivered("firing", target), TIMEOUT_S)
        (alert,) = _ours(next(b for b in bodies if _ours(b, "firing", target)), "firing", target)
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["job"] == "gradwatch"
        assert alert["annotations"]["summary"] == f"gradwatch collector {target} cannot be scraped"
        assert f"curl http://{target}/readyz" in alert["annotations"]["runbook"]
        # Sent by our Prometheus (its URL names the host, not 127.0.0.1).
        assert urlsplit(alert["generatorURL"]).port == urlsplit(prom.url).port

        with running_collector(metrics_addr=target):
            receiver.wait_for(_delivered("resolved", target), TIMEOUT_S)
