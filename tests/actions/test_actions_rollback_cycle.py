"""The whole rollback cycle on CPU, all real: agent, sockets, collector, rules, command.

A small model trains and saves a checkpoint every 10 steps; from step 30 the
loss is NaN (an injected fault). The collector's rule with ``actions: [notify,
rollback]`` fires, the collector names the checkpoint saved before the onset
(step 20, not the poisoned 30 it also knows of) and sends a signed command; the
loop takes it at a step boundary, reloads, skips batches, drops the fault and
trains on, healthy.
"""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import gradwatch
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.collector.sinks import SinkStats
from tests.actions.helpers import KEY

WAIT_S = 15.0
JOB = "cycle"
EVERY = 10  # checkpoint cadence, in steps
FAULT_STEP = 30  # the first step whose loss is NaN
SKIP = 5
RULES = """
groups:
  - name: rollback
    rules:
      - alert: NaNRollback
        detector: nonfinite
        for: 3            # fires at step 32; the incident began at 30
        severity: critical
        category: numerical
        actions: [notify, rollback]
"""


class Recorder:
    """A sink that keeps what it is handed (the alerts every real sink would send)."""

    name = "recorder"

    def __init__(self) -> None:
        self.alerts: list[Any] = []
        self.open = False

    def start(self) -> None:
        self.open = True

    def notify(self, transition: Any) -> None:
        self.alerts.append(transition.alert)

    def close(self, timeout: float) -> None:
        self.open = False

    def alive(self) -> bool:
        return self.open

    def stats(self) -> SinkStats:
        return SinkStats()


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of a fixed, learnable regression stream."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(32, 8, generator=g)
    return x, x @ torch.linspace(-1.0, 1.0, 8).unsqueeze(1)


def save(
    path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, next_batch: int
) -> None:
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "next_batch": next_batch,
        },
        path,
    )


def test_fault_rollback_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_CHECKPOINT_ROOT", str(tmp_path))  # where the loop saves
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        rules=rules,
        command_listen="tcp://127.0.0.1:*",
        command_key=KEY.decode(),
        rollback_skip_batches=SKIP,
        data_dir=tmp_path / "state",
    )
    sink = Recorder()
    server = Server(config, registry=CollectorRegistry(), sinks=[sink])
    server.start()
    try:
        result = train(server, tmp_path)
        # Everything the agent sent after the rollback was taken, as its new incarnation.
        mon = result[-1]
        c = mon.stats
        # Every message the agent sent, its cadence samples included: without them the
        # wait could end before the last batch was handled (a fresh-clone CI run saw 57).
        sent = c.batches_sent + c.heartbeats_sent + c.events_sent + c.stats_sent
        assert server.wait_for_messages(sent, WAIT_S)
        assert sum(server.ingest.stats().rejected.values()) == 0
        # The job has shipped steps (waited for above), so it exists.
        rank = server.state.job(JOB).ranks[0]  # type: ignore[union-attr]
        # The rank has shipped steps, so latest is set. The agent never blocks the loop: a
        # batch it cannot ship in time is dropped and counted, and the collector hears the
        # count (a fresh-clone CI run on 2 busy cores dropped the last 5 steps at close:
        # latest 55). Every step arrived or was counted, as the new incarnation.
        assert rank.incarnation == mon.incarnation
        assert server.ingest.stats().agent_dropped.get(JOB, 0) == c.steps_dropped
        assert rank.latest.step in {60, 60 - c.steps_dropped}  # type: ignore[union-attr]
        with urllib.request.urlopen(server.metrics_url, timeout=WAIT_S) as response:
            metrics = response.read().decode().splitlines()
    finally:
        assert server.stop(), "the collector did not stop cleanly"
    cmd, resumed_at, losses, accepted, _ = result
    assert (cmd.step, cmd.checkpoint) == (20, str(tmp_path / "ckpt-20.pt"))
    assert resumed_at == {"step": 20, "next_batch": 20 + SKIP}
    assert accepted == 1
    assert all(math.isfinite(x) for x in losses) and len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, (first, last)  # still learning after the resume
    # The alert itself was notified too, naming the same checkpoint for any other receiver.
    fired = [a for a in sink.alerts if a.state == "firing"]
    assert fired and fired[0].step == FAULT_STEP
    assert fired[0].last_good_checkpoint == str(tmp_path / "ckpt-20.pt")
    assert "gradwatch_rollbacks_sent_total 1.0" in metrics
    assert 'gradwatch_rollback_budget_remaining{training_job="cycle"} 2.0' in metrics
    stats = server.actions.stats() if server.actions is not None else None
    assert stats is not None and stats.sent == 1 and stats.refused == {}


def train(server: Server, tmp_path: Path) -> tuple[Any, dict[str, int], list[float], int, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cmd: Any = None
    resumed_at: dict[str, int] = {}
    losses_after: list[float] = []
    with gradwatch.watch(
        model,
        opt,
        job=JOB,
        endpoint=server.bound_endpoint,
        flush_every=5,
        stats_every=0,
        command_endpoint=server.command_endpoint,
        command_key=KEY,
    ) as mon:
        assert server.wait_for_listener(JOB, WAIT_S), "the agent never subscribed"
        step, next_batch, fault = 0, 0, False
        while len(losses_after) < 40:
            fault = fault or (cmd is None and step + 1 == FAULT_STEP)
            x, y = batch(next_batch)
            next_batch += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            if fault:
                loss = loss * float("nan")  # the injected fault
            loss.backward()
            opt.step()
            mon.log(loss=loss)
            opt.zero_grad()
            step += 1
            if cmd is not None:
                losses_after.append(loss.item())
            if step % EVERY == 0:
                path = tmp_path / f"ckpt-{step}.pt"
                save(path, model, opt, step, next_batch)
                mon.checkpoint_saved(step, path)
            if fault and step == FAULT_STEP + 2 * EVERY:
                # Far past the onset (poisoned checkpoints 30 and 40 saved): wait, bounded.
                assert mon.wait_for_command(WAIT_S), "no rollback command arrived"
            taken = mon.pending_rollback()
            if taken is not None:
                cmd = taken
                assert {c.step for c in server.actions.checkpoints.of(JOB)} >= {10, 20, 30}
                state = torch.load(taken.checkpoint)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                step = state["step"]
                next_batch = state["next_batch"] + taken.skip_batches
                resumed_at = {"step": step, "next_batch": next_batch}
                fault = False  # the loop's own fix; PaLM's skip alone may be enough in practice
                before = mon.incarnation
                mon.rollback_done(step)
                assert mon.incarnation != before  # rewound steps are a restart, not a stall
        accepted = mon.stats.commands_accepted
    return cmd, resumed_at, losses_after, accepted, mon
