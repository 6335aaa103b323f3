"""A real Prometheus scrapes a live collector fed by the real agent.

Prometheus runs from ``deploy/prometheus/prometheus.yml`` (scrape every 1 s,
the repo's alert rules loaded); the test reads back through its HTTP API what
the training loop measured and checks every alert rule evaluates cleanly
against the collector's real series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("torch")

from tests.binaries import require_binary
from tests.integration.promstack import (
    Running,
    api,
    query,
    start_prometheus,
    wait_until,
)
from tests.integration.training import (
    FLUSH_EVERY,
    LEARNING_RATE,
    Sent,
    running_collector,
    train,
)

JOB = "it-scrape"
# The training job has a label of its own; `job` is the scrape job, whatever it is named.
OF_JOB = f'job="gradwatch",training_job="{JOB}"'
STEPS = 20
TIMEOUT_S = 30.0


def _value(base: str, promql: str) -> float:
    (sample,) = query(base, promql)
    return float(sample["value"][1])


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Sent], Running]]:
    """One collector that a training job reported to, and a Prometheus that scraped it.

    Shared by the module: Prometheus applies new targets on a 5 s tick, the
    slowest part of these tests.
    """
    require_binary("prometheus")  # before training: skip (or fail in CI) at once
    with running_collector() as collector:
        sent = train(collector, JOB, STEPS)
        target = urlsplit(collector.metrics_url).netloc
        with start_prometheus(tmp_path_factory.mktemp("prometheus"), [target]) as prom:
            step = f'gradwatch_job_step{{training_job="{JOB}"}}'
            wait_until(
                lambda: query(prom.url, f"{step} == {STEPS}") or None,
                TIMEOUT_S,
                f"{step} reaching {STEPS} in Prometheus; log:\n{prom.log_tail()}",
            )
            yield sent, prom


def test_the_collector_target_is_up(scraped: tuple[list[Sent], Running]) -> None:
    _, prom = scraped
    active = api(prom.url, "/api/v1/targets")["activeTargets"]
    (target,) = [t for t in active if t["labels"]["job"] == "gradwatch"]
    assert target["health"] == "up", target
    assert target["scrapeUrl"].startswith("http://127.0.0.1:")
    assert target["scrapeUrl"].endswith("/metrics")
    assert _value(prom.url, 'up{job="gradwatch"}') == 1


def test_prometheus_holds_what_the_agent_sent(scraped: tuple[list[Sent], Running]) -> None:
    sent, prom = scraped
    last = sent[-1]
    # The training job has a label of its own; `job` stays the scrape job on every series.
    assert _value(prom.url, f"gradwatch_job_loss{{{OF_JOB}}}") == pytest.approx(last.loss, rel=1e-6)
    assert _value(prom.url, f"gradwatch_job_grad_norm{{{OF_JOB}}}") == pytest.approx(
        last.grad_norm, rel=1e-4
    )
    assert _value(prom.url, f'gradwatch_job_learning_rate{{{OF_JOB},group="0"}}') == pytest.approx(
        LEARNING_RATE, rel=1e-6
    )
    assert _value(prom.url, f"gradwatch_job_ranks{{{OF_JOB}}}") == 1
    assert _value(prom.url, f"gradwatch_job_nonfinite_layers{{{OF_JOB}}}") == 0
    # The collector's own series keep the scrape job.
    batches = 'gradwatch_ingest_messages_total{job="gradwatch",kind="batch"}'
    assert _value(prom.url, batches) == STEPS // FLUSH_EVERY
    assert _value(prom.url, 'sum(gradwatch_ingest_rejected_total{job="gradwatch"})') == 0


def test_every_alert_rule_evaluates_cleanly_against_live_series(
    scraped: tuple[list[Sent], Running],
) -> None:
    _, prom = scraped

    def rules_now() -> dict[str, dict[str, Any]]:
        groups = api(prom.url, "/api/v1/rules", type="alert")["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}

    # Judge only evaluations that started after the collector's data had landed.
    before = {name: rule["lastEvaluation"] for name, rule in rules_now().items()}

    def evaluated_again() -> dict[str, dict[str, Any]] | None:
        now = rules_now()
        fresh = all(rule["lastEvaluation"] > before[name] for name, rule in now.items())
        return now if fresh else None

    rules = wait_until(
        evaluated_again,
        TIMEOUT_S,
        f"a rule evaluation after the scrape; Prometheus log:\n{prom.log_tail()}",
    )
    assert len(rules) >= 10, sorted(rules)
    broken = {name: rule.get("lastError") for name, rule in rules.items() if rule["health"] != "ok"}
    assert not broken, broken
    # A healthy collector whose job just reported fires nothing.
    assert [name for name, rule in rules.items() if rule["state"] != "inactive"] == []
