"""Helpers for the fault tests: a real collector process on a fixed port, scraping, training.

``CollectorProcess`` runs ``python -m gradwatch collector`` on an endpoint chosen
up front, so that a second process started after a ``kill -9`` listens where
the agent already points; it is always killed at teardown. ``scrape`` reads
``/metrics`` into ``{(name, labels): value}``.

Example::

    port = free_port()
    with CollectorProcess(tmp_path, "a", port, ["--data-dir", str(tmp_path / "d")]) as c:
        value(scrape(c.metrics_url), "gradwatch_job_step", training_job="run")
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import gradwatch

READY_TIMEOUT_S = 60.0
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    """A loopback TCP port nothing listens on now (ZeroMQ binds with SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class CollectorProcess:
    """``gradwatch collector`` as a child process; a context manager that always kills it."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        port: int,
        args: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.ready_file = tmp_path / f"{name}.ready.json"
        self.ready_file.unlink(missing_ok=True)
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._argv = [
            sys.executable,
            "-m",
            "gradwatch",
            "collector",
            "--listen",
            self.endpoint,
            "--metrics-addr",
            "127.0.0.1:0",
            "--ready-file",
            str(self.ready_file),
            *args,
        ]
        self._env = {**os.environ, "GRADWATCH_WEBHOOK_SECRET": SECRET, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = ""
        self.ready: dict[str, Any] = {}

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen(self._argv, stderr=subprocess.PIPE, text=True, env=self._env)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"collector exited early:\n{self.finish()}")
            assert time.monotonic() < deadline, "collector not ready in time"
            time.sleep(0.02)  # waiting on another process's file; no event to block on
        self.ready = json.loads(self.ready_file.read_text())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish()

    @property
    def metrics_url(self) -> str:
        return str(self.ready["metrics_url"])

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=15)

    def finish(self) -> str:
        """Kill the process if it still runs; its stderr (kept in ``self.stderr``)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            _, err = self.proc.communicate(timeout=15)
            self.stderr += err or ""
            self.proc = None
        return self.stderr

    def terminate(self) -> int:
        """SIGTERM, then the exit code of a graceful stop (stderr kept)."""
        assert self.proc is not None
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=15)
        self.stderr += err or ""
        code = self.proc.returncode
        self.proc = None
        return code


def scrape(url: str) -> Samples:
    """Every sample on ``url`` (a ``/metrics`` page) keyed by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode("utf-8")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_metric(url: str, name: str, ok: Any, timeout: float = 20.0, **labels: str) -> float:
    """Scrape until ``ok(value)`` holds for the sample; return it, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = value(scrape(url), name, **labels)
        if got is not None and ok(got):
            return got
        assert time.monotonic() < deadline, f"{name}{labels} is {got} after {timeout}s"
        time.sleep(0.05)  # polling another process's /metrics; nothing to block on


class Loop:
    """A real (tiny) training loop with the agent attached; ``step()`` runs one step."""

    def __init__(self, job: str, endpoint: str, depth: int = 2, **options: Any) -> None:
        torch.manual_seed(0)
        # Each parameter is a column of every step row: depth sets the bytes sent per step.
        hidden = [m for _ in range(depth - 2) for m in (nn.Linear(16, 16), nn.ReLU())]
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), *hidden, nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x = torch.randn(16, 8)
        self.mon = gradwatch.watch(self.model, self.opt, job=job, endpoint=endpoint, **options)
        self.log_seconds: list[float] = []

    def step(self, nan_loss: bool = False) -> None:
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.opt.step()
        # The alert comes from what is reported; the weights stay healthy for what follows.
        reported = torch.full_like(loss, float("nan")) if nan_loss else loss
        start = time.perf_counter()
        self.mon.log(loss=reported)
        self.log_seconds.append(time.perf_counter() - start)
        self.opt.zero_grad()

    def run_until(self, done: Any, timeout: float = 20.0, every: int = 5) -> int:
        """Train until ``done()`` (checked every ``every`` steps); the steps it took."""
        deadline = time.monotonic() + timeout
        steps = 0
        while True:
            for _ in range(every):
                self.step()
            steps += every
            if done():
                return steps
            assert time.monotonic() < deadline, f"condition not met after {steps} steps"
