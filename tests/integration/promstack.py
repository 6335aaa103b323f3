"""Real Prometheus and Alertmanager processes for the integration tests.

Each one runs from a config written to a temp directory, listens on a free
127.0.0.1 port, is waited for on ``/-/ready`` and is always terminated by the
context manager. Configs start from the example files in ``deploy/`` so the
tests also prove those files work against a live collector.

Example::

    with start_prometheus(tmp_path, targets=["127.0.0.1:9400"]) as prom:
        print(prom.url, query(prom.url, "up"))
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.binaries import require_binary

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
ALERTMANAGER_DIR = REPO / "deploy" / "alertmanager"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
START_ATTEMPTS = 3  # a free port can be taken between probing it and the bind
POLL_S = 0.05  # polling another process's HTTP API: there is no event to block on

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Running:
    """A started server: its base URL, process and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def api(base: str, path: str, **params: str) -> Any:
    """``data`` of a Prometheus HTTP API answer; raises if its status is not success."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    answer = json.loads(http_get(f"{base}{path}{query}"))
    if answer.get("status") != "success":
        raise AssertionError(f"Prometheus API {path} answered {answer!r:.1000}")
    return answer["data"]


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """The instant vector ``promql`` evaluates to now."""
    data = api(base, "/api/v1/query", query=promql)
    assert data["resultType"] == "vector", data
    return list(data["result"])


def wait_until(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``probe`` until it returns something other than None (or raise, saying ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not seen within {timeout}s")
        time.sleep(POLL_S)


@contextmanager
def _serve(
    binary: str, argv: Callable[[int], Sequence[str]], log: Path, name: str
) -> Iterator[Running]:
    """Start ``binary argv(port)`` and wait for ``/-/ready``; retry on a lost port race."""
    for attempt in range(1, START_ATTEMPTS + 1):
        port = free_port()
        with log.open("ab") as out:
            process = subprocess.Popen(
                [binary, *argv(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        running = Running(f"http://127.0.0.1:{port}", process, log)
        try:
            if _wait_ready(running):
                break
        except BaseException:
            _stop(process)
            raise
        _stop(process)
        if attempt == START_ATTEMPTS:
            raise AssertionError(
                f"{name} did not become ready on {running.url}; its log:\n{running.log_tail()}"
            )
    try:
        yield running
    finally:
        _stop(process)


def _wait_ready(running: Running) -> bool:
    """True once ``/-/ready`` answers; False if the process exited first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while running.process.poll() is None:
        try:
            http_get(f"{running.url}/-/ready", timeout=1.0)
            return True
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{running.url}/-/ready did not answer within "
                    f"{READY_TIMEOUT_S}s; log:\n{running.log_tail()}"
                ) from None
            time.sleep(POLL_S)
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT_S)


def prometheus_config(
    targets: Sequence[str],
    alertmanagers: Sequence[str] = (),
    interval: str = "1s",
    rule_files: Sequence[Path] | None = None,
    job_name: str = "gradwatch",
    target_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``deploy/prometheus/prometheus.yml`` pointed at ``targets``, fast, with the repo's
    rules (or ``rule_files``); the scrape job renamed ``job_name``, its targets labelled
    ``target_labels`` (as the Prometheus Operator names and labels a ServiceMonitor's)."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = (
        [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
        if rule_files is None
        else [str(path) for path in rule_files]
    )
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "gradwatch"]
    job["job_name"] = job_name
    job["static_configs"] = [{"targets": list(targets), "labels": dict(target_labels or {})}]
    if alertmanagers:
        config["alerting"]["alertmanagers"] = [
            {
                "static_configs": [
                    {"targets": [urllib.parse.urlsplit(url).netloc for url in alertmanagers]}
                ]
            }
        ]
    else:
        del config["alerting"]
    return config


def alertmanager_config(webhook_url: str) -> dict[str, Any]:
    """``deploy/alertmanager/alertmanager.yml`` delivering to ``webhook_url`` within ~1 s."""
    config = yaml.safe_load((ALERTMANAGER_DIR / "alertmanager.yml").read_text())
    timings = {"group_wait": "1s", "group_interval": "1s"}
    config["route"].update(timings)
    for route in config["route"].get("routes", ()):
        route.update(timings)
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", ()):
            hook["url"] = webhook_url
    return config


@contextmanager
def start_prometheus(
    workdir: Path,
    targets: Sequence[str],
    alertmanagers: Sequence[str] = (),
    rule_files: Sequence[Path] | None = None,
    job_name: str = "gradwatch",
    target_labels: dict[str, str] | None = None,
) -> Iterator[Running]:
    binary = require_binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            prometheus_config(
                targets,
                alertmanagers,
                rule_files=rule_files,
                job_name=job_name,
                target_labels=target_labels,
            )
        )
    )

    def argv(port: int) -> list[str]:
        return [
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]

    with _serve(binary, argv, workdir / "prometheus.log", "prometheus") as running:
        yield running


@contextmanager
def start_alertmanager(workdir: Path, webhook_url: str) -> Iterator[Running]:
    binary = require_binary("alertmanager")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "alertmanager.yml"
    config.write_text(yaml.safe_dump(alertmanager_config(webhook_url)))

    def argv(port: int) -> list[str]:
        # An empty cluster address turns gossip off: one instance, no extra port.
        return [
            f"--config.file={config}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ]

    with _serve(binary, argv, workdir / "alertmanager.log", "alertmanager") as running:
        yield running
