"""The Prometheus and Alertmanager files in deploy/ are valid, tested and match the collector.

promtool and amtool validate the files; ``promtool test rules`` runs the unit
tests in ``alerts.test.yml``; and every metric (and label value) the alert
expressions use must be one a live collector really exports, so a renamed
metric cannot leave an alert silently matching nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.binaries import require_binary
from tests.integration.promstack import ALERTMANAGER_DIR, PROMETHEUS_DIR, http_get

ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts.test.yml"
SEVERITIES = {"info", "warning", "critical"}
ANNOTATIONS = {"summary", "description", "runbook"}
SELECTOR = re.compile(r"\b(gradwatch_[a-z0-9_]+)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|on)\s*\(([^)]*)\)")
TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")
TARGET_LABELS = {"job", "instance"}  # set by Prometheus on every scraped series
TOOL_TIMEOUT_S = 30


def _run(tool: str, *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [require_binary(tool), *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{tool} {' '.join(args)} failed:\n{output}"
    return output


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alert_rules() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def test_promtool_checks_the_alert_rules() -> None:
    output = _run("promtool", "check", "rules", ALERTS.name, cwd=PROMETHEUS_DIR)
    assert f"SUCCESS: {len(_rules())} rules found" in output


def test_promtool_runs_the_alert_unit_tests() -> None:
    output = _run("promtool", "test", "rules", ALERT_TESTS.name, cwd=PROMETHEUS_DIR)
    assert "SUCCESS" in output


def test_promtool_checks_the_example_prometheus_config() -> None:
    output = _run("promtool", "check", "config", "prometheus.yml", cwd=PROMETHEUS_DIR)
    assert "SUCCESS: 1 rule files found" in output


def test_amtool_checks_the_example_alertmanager_config() -> None:
    output = _run("amtool", "check-config", "alertmanager.yml", cwd=ALERTMANAGER_DIR)
    assert "SUCCESS" in output


def test_every_alert_has_for_severity_annotations_and_both_unit_test_outcomes() -> None:
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    rules = _alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules), "duplicate alert names"
    for rule in rules:
        name = rule["alert"]
        assert "for" in rule, f"{name}: say how long it must hold (`for:`)"
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert ANNOTATIONS <= set(rule["annotations"]), f"{name}: needs {sorted(ANNOTATIONS)}"
        assert sorted(set(cases.get(name, []))) == [False, True], (
            f"{name}: alerts.test.yml needs a firing and a not-firing case"
        )


def _exported(metrics_text: str) -> dict[str, list[dict[str, str]]]:
    """Metric name -> label sets of its samples; families without samples map to []."""
    from prometheus_client.parser import text_string_to_metric_families

    exported: dict[str, list[dict[str, str]]] = {
        line.split()[2]: [] for line in metrics_text.splitlines() if line.startswith("# TYPE ")
    }
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            exported.setdefault(sample.name, []).append(dict(sample.labels))
    return exported


def _check_matchers(name: str, matchers: str, samples: list[dict[str, str]]) -> list[str]:
    problems = []
    for label, op, value in MATCHER.findall(matchers):
        seen = {labels[label] for labels in samples if label in labels}
        if not seen:
            problems.append(f"{name}: no exported sample has label {label!r}")
        elif op in ("=", "=~"):
            # Regex matchers here are plain alternatives (a|b): each must exist.
            missing = set(value.split("|") if op == "=~" else [value]) - seen
            if missing:
                problems.append(
                    f"{name}{{{label}{op}{value!r}}}: {sorted(missing)} never "
                    f"exported (exported: {sorted(seen)})"
                )
    return problems


def test_every_metric_the_alerts_use_is_exported_by_a_live_collector() -> None:
    pytest.importorskip("torch")
    from gradwatch.collector.receiver import WebhookReceiver
    from tests.integration.training import running_collector, train

    with (
        WebhookReceiver() as receiver,
        running_collector(webhooks=[receiver.url], per_layer_metrics=True) as collector,
    ):
        train(collector, "it-names", 10)
        exported = _exported(http_get(collector.metrics_url).decode())

    problems = []
    used = set()
    for rule in _alert_rules():
        for name, matchers in SELECTOR.findall(rule["expr"]):
            used.add(name)
            if name not in exported:
                problems.append(f"{rule['alert']}: {name} is not exported")
            elif matchers:
                problems += [
                    f"{rule['alert']}: {p}" for p in _check_matchers(name, matchers, exported[name])
                ]
    assert used, "no gradwatch metric found in alerts.yml"
    assert not problems, "\n".join(problems)


def test_every_label_the_alerts_group_by_or_print_is_one_the_collector_exports() -> None:
    """A label renamed in the collector (``job`` -> ``training_job``) must not leave an
    alert grouping by, or a summary printing, a label no series has."""
    pytest.importorskip("torch")
    from gradwatch.collector.receiver import WebhookReceiver
    from tests.integration.training import running_collector, train

    with WebhookReceiver() as receiver, running_collector(webhooks=[receiver.url]) as collector:
        train(collector, "it-labels", 10)
        exported = _exported(http_get(collector.metrics_url).decode())
    labels = TARGET_LABELS | {
        label for samples in exported.values() for sample in samples for label in sample
    }
    assert "training_job" in labels and "job" not in {
        label for samples in exported.values() for sample in samples for label in sample
    }
    problems = []
    for rule in _alert_rules():
        text = rule["expr"] + " ".join(rule["annotations"].values())
        used = {
            label.strip()
            for group in GROUPING.findall(rule["expr"])
            for label in group.split(",")
            if label.strip()
        }
        used |= set(TEMPLATE_LABEL.findall(text))
        problems += [
            f"{rule['alert']}: label {label!r} is on no series" for label in sorted(used - labels)
        ]
    assert not problems, "\n".join(problems)
