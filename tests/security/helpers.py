"""Shared pieces of the security tests: key pairs, a CURVE collector, a tiny training loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import gradwatch
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.keys import KeyPair, allow_key, generate_keypair
from gradwatch.collector.server import Server

WAIT_S = 10.0


@dataclass(frozen=True)
class Keys:
    collector: KeyPair
    trainer: KeyPair  # allowed for run-* only
    stranger: KeyPair  # in no allow-list
    allow_file: Path


def make_keys(tmp_path: Path) -> Keys:
    directory = tmp_path / "keys"
    collector, trainer, stranger = (
        generate_keypair(name, directory) for name in ("collector", "trainer", "stranger")
    )
    allow_file = tmp_path / "allow.yaml"
    allow_key(allow_file, trainer.public_key, ["run-*"], name="trainer")
    return Keys(collector, trainer, stranger, allow_file)


def curve_config(keys: Keys, **extra: Any) -> CollectorConfig:
    return CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        command_listen="tcp://127.0.0.1:*",
        curve_secret_key_file=keys.collector.secret_file,
        curve_allow_file=keys.allow_file,
        **extra,
    )


@contextmanager
def running(config: CollectorConfig) -> Iterator[Server]:
    server = Server(config, registry=CollectorRegistry(), sinks=[])
    server.start()
    try:
        yield server
    finally:
        assert server.stop(), "the collector did not stop cleanly"


def use_agent_keys(
    monkeypatch: pytest.MonkeyPatch, server_key: Path | None, pair: KeyPair | None
) -> None:
    """Point the next ``watch()`` at these keys (the documented environment variables)."""
    for name, value in (
        ("GRADWATCH_CURVE_SERVER_KEY_FILE", server_key),
        ("GRADWATCH_AGENT_CURVE_SECRET_KEY_FILE", None if pair is None else pair.secret_file),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def agent(
    server: Server, model: torch.nn.Module, opt: torch.optim.Optimizer, job: str, **kwargs: Any
) -> gradwatch.Monitor:
    """A real agent of ``job`` reporting to ``server``, with quick heartbeats."""
    options: dict[str, Any] = {"flush_every": 1, "heartbeat_every": 0.05, "stats_every": 0}
    return gradwatch.watch(
        model, opt, job=job, endpoint=server.bound_endpoint, **{**options, **kwargs}
    )


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (for state other threads set)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train_steps(
    mon: gradwatch.Monitor,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    nan_from: int | None = None,
) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        if nan_from is not None and mon.step + 1 >= nan_from:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()


def refused(server: Server, reason: str) -> int:
    return server.auth_counters.counts()[reason]
