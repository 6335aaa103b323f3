"""A live collector in-process and a tiny training loop watched by the real agent.

``train`` returns what the loop itself measured at each step (loss, total
gradient norm, learning rate) so tests can compare it with what Prometheus or
Alertmanager end up holding.

Example::

    with running_collector() as server:
        sent = train(server, job="it", steps=20)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import gradwatch
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server

FLUSH_EVERY = 5
LEARNING_RATE = 0.05
# Frequent heartbeats make the agent's connection visible quickly (see train).
HEARTBEAT_S = 0.2
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Sent:
    """What the training loop measured at one step."""

    step: int
    loss: float
    grad_norm: float
    lr: float


@contextmanager
def running_collector(**config: Any) -> Iterator[Server]:
    """A started collector on free loopback ports with its own metrics registry."""
    settings = {"listen": "tcp://127.0.0.1:*", "metrics_addr": "127.0.0.1:0", **config}
    server = Server(CollectorConfig(**settings), registry=CollectorRegistry())
    server.start()
    try:
        yield server
    finally:
        assert server.stop(10), "the collector did not stop within its deadline"


def train(collector: Server, job: str, steps: int, nan_step: int | None = None) -> list[Sent]:
    """Train a small MLP for ``steps`` steps under ``gradwatch.watch``; close the monitor.

    Training starts once the collector has heard from the agent: the agent's
    socket drops what it sends before its connection is up (by design, it
    never queues for an absent collector), so an early batch could vanish.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    sent = []
    heard = collector.messages_handled
    # early_stats=False: no cadence statistics in 20 steps, so the batches the
    # collector counts are exactly the step batches (steps // flush_every).
    with gradwatch.watch(
        model,
        optimizer,
        job=job,
        endpoint=collector.bound_endpoint,
        flush_every=FLUSH_EVERY,
        heartbeat_every=HEARTBEAT_S,
        early_stats=False,
    ) as mon:
        assert collector.wait_for_messages(heard + 1, CONNECT_TIMEOUT_S), (
            f"the collector heard nothing from the agent within {CONNECT_TIMEOUT_S}s"
        )
        for step in range(1, steps + 1):
            x = torch.randn(16, 4)
            if step == nan_step:
                x[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            # The test's own measurement, synchronising freely (the agent never does).
            norms = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
            sent.append(
                Sent(
                    step,
                    loss.item(),
                    math.sqrt(sum(n * n for n in norms)),
                    optimizer.param_groups[0]["lr"],
                )
            )
            optimizer.step()
            mon.log(loss=loss)
            optimizer.zero_grad()
    return sent
