"""The Grafana dashboard: a valid dashboard model, and only metrics a live collector exports.

The live test runs the real path: a PyTorch training loop with the agent ->
ZeroMQ -> an in-process collector (per-layer metrics on, Grafana annotations
on, pointed at the local Grafana API) -> default rules. A NaN at a known step
must become an annotation tagged as the dashboard's annotation query expects,
and every metric name in every PromQL expression of the dashboard must be in
the collector's scrape.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from tests.binaries import require_binary
from tests.grafana.fake_grafana import FakeGrafana

DASHBOARD = Path(__file__).resolve().parents[2] / "collector/dashboards/gradwatch.json"
METRIC = re.compile(r"\b(gradwatch_[a-z0-9_]+)\b")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTIN = {"type": "grafana", "uid": "-- Grafana --"}
JOB = "dash"
HEALTHY_JOB = "dash-healthy"
NAN_STEP = 37
FLUSH_EVERY = 10
PROMETHEUS_TIMEOUT_S = 60.0
# Per-job queries that are empty for a healthy job by their nature: no alert fires.
EMPTY_WHEN_HEALTHY = {f'gradwatch_alerts_firing{{training_job="{HEALTHY_JOB}"}}'}
# Grafana's variables as Prometheus sees them after Grafana interpolates them.
GRAFANA_VARIABLES = {"$job": JOB, "$__rate_interval": "1m"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(expr, legendFormat) of every target plus the job variable's query."""
    found = [
        (t["expr"], t.get("legendFormat", "")) for p in panels(dashboard) for t in p["targets"]
    ]
    found += [
        (v["definition"], "") for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    return found


def test_dashboard_model_is_what_grafana_expects(dashboard: dict[str, Any]) -> None:
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "annotations", "time"):
        assert key in dashboard, key
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert len(dashboard["uid"]) <= 40  # Grafana's limit on dashboard uids
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and all(
            isinstance(v, int) for v in grid.values()
        )
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine
    for panel in panels(dashboard):
        assert panel["datasource"] == PROMETHEUS, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == PROMETHEUS for t in panel["targets"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # The variable keeps its name (links and annotation tags use $job); its values are
    # the training jobs, in their own label (`job` is Prometheus' scrape job).
    assert variables["job"]["definition"] == "label_values(gradwatch_job_step, training_job)"
    # Grafana's own dashboard model (grafana-foundation-sdk, generated from its schema)
    # decodes it and keeps what matters.
    decoded = json.loads(json.dumps(Dashboard.from_json(dashboard), cls=JSONEncoder))
    assert [(p["id"], p["type"], p["gridPos"]) for p in decoded["panels"]] == [
        (p["id"], p["type"], p["gridPos"]) for p in dashboard["panels"]
    ]
    assert [t["expr"] for p in decoded["panels"] for t in p.get("targets", [])] == [
        t["expr"] for p in panels(dashboard) for t in p["targets"]
    ]


def test_alert_annotations_come_from_the_gradwatch_tags(dashboard: dict[str, Any]) -> None:
    queries = [a for a in dashboard["annotations"]["list"] if a.get("name") == "gradwatch alerts"]
    (query,) = queries
    assert query["datasource"] == GRAFANA_BUILTIN and query["enable"]
    assert query["target"]["type"] == "tags"
    assert query["target"]["tags"] == ["gradwatch", "job:$job"]
    assert query["target"]["matchAny"] is False
    kinds = {p["type"] for p in panels(dashboard)}
    assert {"timeseries", "heatmap", "stat"} <= kinds
    log_scaled = [
        p["title"]
        for p in panels(dashboard)
        if p["fieldConfig"]["defaults"].get("custom", {}).get("scaleDistribution", {}).get("type")
        == "log"
    ]
    assert "Total gradient norm (pre-clip)" in log_scaled


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeGrafana]]:
    """A collector that received a real training run with a NaN at NAN_STEP."""
    torch = pytest.importorskip("torch")
    import gradwatch

    with FakeGrafana(token="dash-token") as grafana:
        config = CollectorConfig(
            listen="tcp://127.0.0.1:*",
            metrics_addr="127.0.0.1:0",
            per_layer_metrics=True,
            grafana_url=grafana.url,
            grafana_token="dash-token",
            grafana_dashboard_uid=json.loads(DASHBOARD.read_text())["uid"],
        )
        server = Server(config, registry=CollectorRegistry())
        server.start()
        try:
            torch.manual_seed(0)
            # A healthy job (its last step has finite norms, so every per-job series
            # exists) and the job with the NaN, whose alert becomes an annotation.
            # The healthy job also runs AMP's GradScaler, evals and activation statistics,
            # so the loss-scale, validation and activation panels have series too.
            for job, nan_step in ((HEALTHY_JOB, None), (JOB, NAN_STEP)):
                model = torch.nn.Sequential(
                    torch.nn.Linear(8, 32),
                    torch.nn.Tanh(),
                    torch.nn.Linear(32, 32),
                    torch.nn.ReLU(),
                    torch.nn.Linear(32, 1),
                )
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                scaler = torch.amp.GradScaler("cpu") if nan_step is None else None
                with gradwatch.watch(
                    model,
                    optimizer,
                    job=job,
                    endpoint=server.bound_endpoint,
                    flush_every=FLUSH_EVERY,
                    stats_every=5,
                    scaler=scaler,
                ) as mon:
                    for step in range(1, NAN_STEP + 2 * FLUSH_EVERY):
                        x = torch.randn(16, 8)
                        if step == nan_step:
                            x[0, 0] = float("nan")
                        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                        if scaler is not None:
                            scaler.scale(loss).backward()
                            scaler.step(optimizer)
                            scaler.update()
                        else:
                            loss.backward()
                            optimizer.step()
                        mon.log(loss=loss)
                        optimizer.zero_grad()
                        if step % 10 == 0:
                            with torch.no_grad():
                                mon.log_eval(
                                    loss=torch.nn.functional.mse_loss(
                                        model(x), x.sum(1, keepdim=True)
                                    )
                                )
            assert grafana.wait_for(
                lambda g: any("category:numerical" in a["tags"] for a in g.annotations.values()),
                30.0,
            ), "no annotation for the numerical alert reached Grafana"
            yield str(server.metrics_url), grafana
        finally:
            assert server.stop(10), "the collector did not stop within its deadline"


def scrape(url: str) -> dict[str, set[str]]:
    """Metric name -> label names of its samples; counters also under ``<name>_total``."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        keys = [family.name] + ([f"{family.name}_total"] if family.type == "counter" else [])
        for key in keys:
            names.setdefault(key, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_dashboard_metric_is_exported_by_a_live_collector(
    dashboard: dict[str, Any], live: tuple[str, FakeGrafana]
) -> None:
    metrics_url, _ = live
    exported = scrape(metrics_url)
    for expr, legend in expressions(dashboard):
        used = METRIC.findall(expr)
        assert used, f"no gradwatch metric in {expr!r}"
        for name in used:
            assert name in exported, f"{name} (in {expr!r}) is not in the collector's scrape"
        labelled = [exported[n] for n in used if exported[n]]
        for label in LEGEND_LABEL.findall(legend):
            assert any(label in labels for labels in labelled) or not labelled, (
                f"legend label {label!r} of {expr!r} is not a label of {used}"
            )
    # The job really reported: its per-job and per-layer series are there.
    for name in (
        "gradwatch_job_loss",
        "gradwatch_job_grad_norm",
        "gradwatch_layer_grad_norm",
        "gradwatch_job_first_last_grad_ratio",
        "gradwatch_alerts_firing",
        "gradwatch_job_eval_loss",
        "gradwatch_job_loss_scale",
        "gradwatch_activation_saturated_fraction",
        "gradwatch_activation_dead_fraction",
        "gradwatch_rank_last_seen_timestamp_seconds",
    ):
        assert "training_job" in exported[name], f"{name} has no series for the job"
    assert not any("job" in labels for labels in exported.values()), (
        "a collector series has a `job` label: it would clash with the scrape job's"
    )


def test_the_numerical_alert_is_an_annotation_the_dashboard_shows(
    live: tuple[str, FakeGrafana],
) -> None:
    _, grafana = live
    (annotation,) = [a for a in grafana.annotations.values() if "category:numerical" in a["tags"]]
    assert {"gradwatch", f"job:{JOB}", "severity:critical"} <= set(annotation["tags"])
    assert annotation["dashboardUID"] == "gradwatch-job"
    assert annotation["text"] and annotation["time"] > 1_600_000_000_000  # epoch ms


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_query(base: str, expr: str) -> dict[str, Any]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return dict(json.load(response))
    except urllib.error.HTTPError as exc:  # 400/422: the expression is invalid
        with exc:
            return dict(json.load(exc))


def test_a_real_prometheus_evaluates_every_dashboard_query(
    dashboard: dict[str, Any], live: tuple[str, FakeGrafana], tmp_path: Path
) -> None:
    """Prometheus scrapes the live collector; every panel query parses and the job's answer."""
    prometheus = require_binary("prometheus")
    metrics_url, _ = live
    target = urllib.parse.urlsplit(metrics_url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "500ms", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "gradwatch-collector", "static_configs": [{"targets": [target]}]}
                ],
            }
        )
    )
    base = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={base.removeprefix('http://')}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wanted = f'count_over_time(gradwatch_job_step{{training_job="{JOB}"}}[1m]) >= 3'
        deadline = time.monotonic() + PROMETHEUS_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                f"prometheus exited: {proc.stderr.read() if proc.stderr else ''}"
            )
            try:
                if prometheus_query(base, wanted).get("data", {}).get("result"):
                    break
            except OSError:
                pass  # not listening yet
            except ValueError:
                pass  # listening, not ready: a 503 with a plain-text body (CI, 1 run in 5)
            assert time.monotonic() < deadline, "prometheus did not scrape the collector in time"
            time.sleep(0.2)  # polling another process's HTTP API; nothing to block on
        answered = set()
        for expr, _ in expressions(dashboard):
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            # label_values(metric, label) is Grafana's; this is what it asks Prometheus.
            expr = re.sub(r"^label_values\((\w+), (\w+)\)$", r"count by (\2) (\1)", expr)
            answer = prometheus_query(base, expr)
            assert answer["status"] == "success", f"{expr!r}: {answer.get('error')}"
            if answer["data"]["result"]:
                answered.add(expr)
        for needed in (
            "gradwatch_job_loss",
            "gradwatch_job_grad_norm",
            "gradwatch_layer_grad_norm",
            "deriv(gradwatch_job_step",
            "gradwatch_ingest_messages_total",
            "gradwatch_alerts_firing",
        ):
            assert any(needed in expr for expr in answered), f"no data for {needed}"
        # A healthy job fills every per-job panel: its counters and gauges exist at zero
        # (lost batches, dropped steps, assembly incomplete/inexact/late, absent ranks),
        # so no panel is empty and rate() sees the first increment.
        empty = []
        for expr, _ in expressions(dashboard):
            if "$job" not in expr or expr.startswith("label_values("):
                continue
            expr = expr.replace("$job", HEALTHY_JOB).replace("$__rate_interval", "1m")
            if expr in EMPTY_WHEN_HEALTHY:
                continue
            answer = prometheus_query(base, expr)
            assert answer["status"] == "success", f"{expr!r}: {answer.get('error')}"
            if not answer["data"]["result"]:
                empty.append(expr)
        assert not empty, f"per-job queries with no data for a healthy job: {empty}"
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
