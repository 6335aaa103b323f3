"""End to end on loopback: training loop + agent → collector subprocess → webhook.

A NaN enters the data at a known step. The collector must raise a `numerical`
alert that begins at that step using only the data shipped in the two flush
intervals after it (the loop stops there and keeps its monitor open, so no
later data exists), and /metrics must show the step and the firing alert.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gradwatch  # noqa: E402  # after importorskip
from gradwatch.collector.receiver import WebhookReceiver  # noqa: E402  # after importorskip

FLUSH_EVERY = 10
NAN_STEP = 37
READY_TIMEOUT_S = 60.0


@pytest.fixture()
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as rx:
        yield rx


@pytest.fixture()
def collector(tmp_path: Path, receiver: WebhookReceiver) -> Iterator[dict[str, Any]]:
    ready_file = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradwatch",
            "collector",
            "--listen",
            "tcp://127.0.0.1:*",
            "--metrics-addr",
            "127.0.0.1:0",
            "--webhook",
            receiver.url,
            "--ready-file",
            str(ready_file),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not ready_file.exists():
            assert proc.poll() is None, f"collector exited early:\n{proc.stderr.read()}"
            assert time.monotonic() < deadline, "collector not ready in time"
            time.sleep(0.02)  # waiting on another process's file; no event to block on
        yield json.loads(ready_file.read_text())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, f"collector did not shut down cleanly:\n{err}"


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _scrape_until(url: str, wanted: str, timeout: float) -> str:
    """Scrape until ``wanted`` appears: the last batch may still be in flight when
    the alert (raised from an earlier batch) arrives."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(url)
        if wanted in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)  # polling another process's HTTP endpoint; nothing to block on


def test_nan_at_a_known_step_alerts_within_two_flush_intervals(
    collector: dict[str, Any], receiver: WebhookReceiver
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model, optimizer, job="e2e", endpoint=collector["listen"], flush_every=FLUSH_EVERY
    )
    last_step = NAN_STEP + 2 * FLUSH_EVERY - (NAN_STEP % FLUSH_EVERY)
    try:
        for step in range(1, last_step + 1):
            x = torch.randn(16, 8)
            if step == NAN_STEP:
                x[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            optimizer.step()
            mon.log(loss=loss)
            optimizer.zero_grad()
        assert mon.step == last_step

        def numerical(bodies: list[dict[str, Any]]) -> bool:
            return any(b["category"] == "numerical" and b["state"] == "firing" for b in bodies)

        bodies = receiver.wait_for(numerical, timeout=20.0)
        (alert,) = [b for b in bodies if b["category"] == "numerical" and b["state"] == "firing"]
        assert alert["job"] == "e2e"
        assert alert["step"] == NAN_STEP
        assert alert["severity"] == "critical"
        for field in ("rule", "summary", "evidence", "diagnosis", "id"):
            assert alert[field], field

        wanted = f'gradwatch_job_step{{training_job="e2e"}} {float(last_step)}'
        text = _scrape_until(collector["metrics_url"], wanted, timeout=20.0)
        assert wanted in text
        firing = [
            line
            for line in text.splitlines()
            if line.startswith("gradwatch_alerts_firing{") and 'category="numerical"' in line
        ]
        assert firing and firing[0].endswith(" 1.0"), text
    finally:
        mon.close()


def _train(model: Any, job: str, endpoint: str, steps: int, inputs: Any) -> None:
    """A plain classification loop with the agent on the activation-statistics cadence."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model,
        optimizer,
        job=job,
        endpoint=endpoint,
        flush_every=FLUSH_EVERY,
        stats_every=STATS_EVERY,
    )
    # Until its socket connects the agent drops what it sends (by design: training never
    # waits); the first heartbeat through means connected. On a busy machine that can
    # take longer than the first cadence steps, whose statistics the test counts on.
    deadline = time.monotonic() + 10.0
    while mon.stats.heartbeats_sent == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition with a deadline
    try:
        for _ in range(steps):
            x = inputs()
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            loss.backward()
            optimizer.step()
            mon.log(loss=loss)
            optimizer.zero_grad()
    finally:
        mon.close()


STATS_EVERY = 5


def test_saturation_and_dead_unit_alerts_come_from_the_agents_activation_hooks(
    collector: dict[str, Any], receiver: WebhookReceiver
) -> None:
    torch.manual_seed(0)
    nn = torch.nn
    tanh = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))
    relu = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    with torch.no_grad():
        tanh[0].weight.mul_(30.0)  # an init far too large: tanh pinned at +-1
        relu[0].bias.fill_(-20.0)  # biases that switch every ReLU off
    _train(tanh, "e2e-tanh", collector["listen"], 40, lambda: torch.randn(32, 8))
    _train(relu, "e2e-relu", collector["listen"], 40, lambda: torch.randn(32, 8))

    def both(bodies: list[dict[str, Any]]) -> bool:
        firing = {(b["job"], b["category"]) for b in bodies if b["state"] == "firing"}
        return {("e2e-tanh", "saturation"), ("e2e-relu", "dead_units")} <= firing

    bodies = receiver.wait_for(both, timeout=30.0)
    by_job = {
        b["job"]: b
        for b in bodies
        if b["state"] == "firing" and b["category"] in ("saturation", "dead_units")
    }
    saturated, dead = by_job["e2e-tanh"], by_job["e2e-relu"]
    # The evidence names the hooked module and a share measured on the device.
    assert saturated["rule"] == "ActivationsSaturated" and "'1'" in saturated["summary"]
    assert dead["rule"] == "DeadReLUs" and "'1'" in dead["summary"]
    assert saturated["step"] <= 2 * STATS_EVERY and dead["step"] <= 2 * STATS_EVERY
