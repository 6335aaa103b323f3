"""gradwatch's Grafana client against a local Grafana API that enforces the documented contract."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.grafana import (
    GrafanaAnnotationSink,
    GrafanaError,
    build_grafana_sinks,
    push_dashboard,
)
from gradwatch.collector.grafana_cli import grafana_main
from gradwatch.rules.alert import Alert, Transition
from tests.grafana.fake_grafana import FakeGrafana

DASHBOARD = Path(__file__).resolve().parents[2] / "collector/dashboards/gradwatch.json"
T0 = 1_700_000_000.0


@pytest.fixture()
def grafana() -> Iterator[FakeGrafana]:
    with FakeGrafana(token="s3cret") as fake:
        yield fake


def alert(state: str = "firing", resolved_at: float | None = None) -> Alert:
    return Alert(
        rule="NonFiniteGradients",
        category="numerical",
        severity="critical",
        job="run-7",
        state=state,
        step=37,
        summary="gradient of 'fc.weight' is NaN",
        started_at=T0,
        diagnosis={"verdict": "numerical", "summary": "NaN in the data"},
        resolved_at=resolved_at,
    )


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_push_dashboard_creates_then_replaces(grafana: FakeGrafana) -> None:
    first = push_dashboard(grafana.url, "s3cret", DASHBOARD)
    assert first["status"] == "success" and first["uid"] == "gradwatch-job"
    assert first["url"].startswith("/d/gradwatch-job/") and first["version"] == 1
    second = push_dashboard(grafana.url, "s3cret", DASHBOARD, folder_uid="ml")
    assert (second["id"], second["version"]) == (first["id"], 2)
    stored = grafana.dashboards["gradwatch-job"]
    assert stored["folderUid"] == "ml"
    assert stored["dashboard"]["title"] == json.loads(DASHBOARD.read_text())["title"]


def test_push_without_overwrite_reports_the_version_mismatch(grafana: FakeGrafana) -> None:
    push_dashboard(grafana.url, "s3cret", DASHBOARD)
    push_dashboard(grafana.url, "s3cret", DASHBOARD)  # Grafana now holds version 2
    with pytest.raises(GrafanaError, match="412.*drop --no-overwrite"):
        push_dashboard(grafana.url, "s3cret", DASHBOARD, overwrite=False)


def test_wrong_token_is_a_clear_error(grafana: FakeGrafana) -> None:
    with pytest.raises(GrafanaError, match="401 Unauthorized.*--token-file") as info:
        push_dashboard(grafana.url, "tok-b4d", DASHBOARD)
    assert "tok-b4d" not in str(info.value)  # never echo a token
    assert grafana.dashboards == {}


def test_unreachable_grafana_is_a_clear_error() -> None:
    with pytest.raises(GrafanaError, match="cannot reach Grafana"):
        push_dashboard(f"http://127.0.0.1:{closed_port()}", "t", DASHBOARD, timeout=2.0)


def test_cli_push(grafana: FakeGrafana, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert (
        grafana_main(
            [
                "push",
                "--url",
                grafana.url,
                "--token-file",
                str(token),
                "--dashboard",
                str(DASHBOARD),
            ]
        )
        == 0
    )
    assert "uid gradwatch-job, version 1" in capsys.readouterr().out
    token.write_text("nope")
    assert (
        grafana_main(
            [
                "push",
                "--url",
                grafana.url,
                "--token-file",
                str(token),
                "--dashboard",
                str(DASHBOARD),
            ]
        )
        == 1
    )
    assert "401" in capsys.readouterr().err
    assert (
        grafana_main(["push", "--url", grafana.url, "--token-file", str(tmp_path / "missing")]) == 2
    )


def test_annotation_for_a_firing_alert_becomes_a_region_at_resolve(grafana: FakeGrafana) -> None:
    sink = GrafanaAnnotationSink(grafana.url, "s3cret", dashboard_uid="gradwatch-job")
    sink.start()
    try:
        sink.notify(Transition(alert(), "pending", "firing"))
        assert grafana.wait_for(lambda g: len(g.annotations) == 1)
        (posted,) = grafana.annotations.values()
        assert posted["time"] == int(T0 * 1000) and posted["timeEnd"] is None
        assert posted["tags"] == [
            "gradwatch",
            "job:run-7",
            "rule:NonFiniteGradients",
            "category:numerical",
            "severity:critical",
        ]
        assert "gradient of 'fc.weight' is NaN" in posted["text"]
        assert "diagnosis: numerical - NaN in the data" in posted["text"]
        assert posted["dashboardUID"] == "gradwatch-job"

        sink.notify(Transition(alert("resolved", T0 + 90.0), "firing", "resolved"))
        assert grafana.wait_for(lambda g: posted["timeEnd"] is not None)
        assert posted["timeEnd"] == int((T0 + 90.0) * 1000)
        assert posted["tags"][0] == "gradwatch"  # the PATCH left the tags alone
        assert ("PATCH", f"/api/annotations/{posted['id']}") in grafana.requests
    finally:
        sink.close(5.0)
    assert sink.stats().delivered == 2 and sink.stats().failed == 0
    assert not sink.alive()


def test_wrong_token_counts_one_failure_and_is_not_retried(grafana: FakeGrafana) -> None:
    sink = GrafanaAnnotationSink(grafana.url, "wrong", retry_delays=(30.0,))
    sink.start()
    sink.notify(Transition(alert(), "pending", "firing"))
    # A retry would count one and then wait 30 s; giving up counts a failure at once.
    stats = sink.wait_for(lambda s: s.failed + s.retries > 0, 10.0)
    sink.close(5.0)
    assert (stats.failed, stats.retries, stats.queued) == (1, 0, 0)
    assert grafana.annotations == {} and grafana.requests == [("POST", "/api/annotations")]


def test_a_grafana_that_is_down_never_blocks_notify() -> None:
    sink = GrafanaAnnotationSink(
        f"http://127.0.0.1:{closed_port()}", "t", timeout=1.0, queue_size=16, retry_delays=(0.05,)
    )
    sink.start()
    began = time.monotonic()
    for _ in range(500):
        sink.notify(Transition(alert(), "pending", "firing"))
    notify_s = time.monotonic() - began
    began = time.monotonic()
    sink.close(3.0)
    close_s = time.monotonic() - began
    stats = sink.stats()
    assert notify_s < 0.5, f"500 notify calls took {notify_s:.2f}s"
    assert close_s < 4.0 and not sink.alive()
    # The queue stayed bounded: what did not fit was dropped and counted.
    assert stats.delivered == 0 and stats.dropped >= 400
    assert stats.failed >= 1


def test_config_builds_the_sink_only_when_configured(tmp_path: Path) -> None:
    assert build_grafana_sinks(CollectorConfig()) == []
    token = tmp_path / "token"
    token.write_text("abc\n")
    (sink,) = build_grafana_sinks(
        CollectorConfig(grafana_url="http://127.0.0.1:3000", grafana_token_file=token)
    )
    assert sink.name == "grafana"
    sink.close(0.1)
    with pytest.raises(GrafanaError, match="no token"):
        build_grafana_sinks(CollectorConfig(grafana_url="http://127.0.0.1:3000"))


def test_token_from_the_environment_stays_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_GRAFANA_TOKEN", "env-secret")
    config = CollectorConfig(grafana_url="http://grafana:3000")
    assert config.grafana_token is not None
    assert config.grafana_token.get_secret_value() == "env-secret"
    assert "env-secret" not in repr(config)
