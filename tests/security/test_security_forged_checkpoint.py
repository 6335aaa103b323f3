"""Finding 1 of issue 15: a forged checkpoint report must never become a rollback the job obeys.

Reproduced as the attacker did it: the dev profile (no CURVE), rollback on, a real
agent training and saving real checkpoints; an unauthenticated sender on the
ingest socket reports a checkpoint ``attacker-controlled.pt`` for the job (newer
than the real one, so the collector picks it), tries to overwrite the real
entry, then a NaN burst fires the rollback rule. The collector signs a rollback
to the forged path (it cannot know better: SECURITY.md); the agent refuses it
because it never saved that file, logs why, and the refusal is visible at the
collector (a log line and ``gradwatch_rollbacks_refused_by_agent_total``).
"""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq

from gradwatch.collector.config import CollectorConfig
from gradwatch.wire import Event, encode_event
from tests.actions.helpers import KEY
from tests.security.helpers import (
    WAIT_S,
    agent,
    model_and_optimizer,
    running,
    train_steps,
    wait_until,
)

JOB = "run-victim"
RULES = """
groups:
  - name: recovery
    rules:
      - alert: NaNRollback
        detector: nonfinite
        for: 3
        severity: critical
        category: numerical
        actions: [notify, rollback]
"""


def forge(push: zmq.Socket[Any], step: int, path: str) -> None:
    """What the attacker sent: a well-formed checkpoint event for someone else's job."""
    push.send_multipart(
        encode_event(
            Event(
                job=JOB,
                rank=0,
                incarnation="forged",
                time=0.0,
                kind="checkpoint",
                step=step,
                fields={"path": path},
            )
        )
    )


def test_a_forged_checkpoint_is_refused_by_the_agent_and_the_collector_hears_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    monkeypatch.setenv("GRADWATCH_CHECKPOINT_ROOT", str(root))
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    attacker_file = tmp_path / "attacker-controlled.pt"
    attacker_file.write_bytes(b"a pickle that runs code when loaded")
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        command_listen="tcp://127.0.0.1:*",
        rules=rules,
        command_key=KEY.decode(),
        data_dir=tmp_path / "state",
    )
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    caplog.set_level(logging.WARNING, logger="gradwatch")
    try:
        with running(config) as server:
            push.connect(server.bound_endpoint)
            model, opt = model_and_optimizer()
            with agent(
                server, model, opt, JOB, command_endpoint=server.command_endpoint, command_key=KEY
            ) as mon:
                assert server.wait_for_listener(JOB, WAIT_S), "the agent never subscribed"
                train_steps(mon, model, opt, 2)
                real = root / "2.pt"
                real.write_bytes(b"the job's own weights at step 2")
                mon.checkpoint_saved(2, real)
                assert wait_until(
                    lambda: [c.path for c in server.actions.checkpoints.of(JOB)] == [str(real)]
                    # The server runs with actions enabled, so server.actions is set.
                )  # type: ignore[union-attr]
                # The attacker: overwrite the real entry, then add a newer one.
                forge(push, 2, str(attacker_file))
                forge(push, 3, str(attacker_file))
                # The server runs with actions enabled, so server.actions is set.
                assert wait_until(lambda: len(server.actions.checkpoints.of(JOB)) == 2)  # type: ignore[union-attr]
                # The server runs with actions enabled, so server.actions is set.
                assert server.actions.stats().checkpoints_refused == 1  # type: ignore[union-attr]
                # The server runs with actions enabled, so server.actions is set.
                assert server.actions.checkpoints.of(JOB)[0].path == str(real)  # type: ignore[union-attr]

                # A NaN burst from step 5 on, until the rule fires and a signed rollback goes
                # out (the agent may drop a step when its shipper lags: it never blocks the loop).
                def nan_step() -> bool:
                    train_steps(mon, model, opt, 1, nan_from=5)
                    # The server runs with actions enabled, so server.actions is set.
                    return server.actions.stats().sent == 1  # type: ignore[union-attr]

                # The server runs with actions enabled, so server.actions is set.
                assert wait_until(nan_step), (  # type: ignore[union-attr]
                    # The server runs with actions enabled, so server.actions is set.
                    f"the collector never sent the rollback: {server.actions.stats()}, "  # type: ignore[union-attr]
                    f"admission {server.admission.refused()}, steps sent {mon.stats.steps_sent}"
                )
                assert wait_until(lambda: mon.stats.commands_refused == 1), (
                    "the agent did not refuse the forged rollback"
                )
                assert mon.pending_rollback() is None  # the loop never sees it
                assert wait_until(
                    lambda: (
                        # The server runs with actions enabled, so server.actions is set.
                        server.actions.stats().agent_refused  # type: ignore[union-attr]
                        == {"unvouched": 1}
                    )
                ), "the refusal never reached the collector"
            with urllib.request.urlopen(server.metrics_url, timeout=WAIT_S) as response:
                metrics = response.read().decode()
    finally:
        push.close(linger=0)
        ctx.term()
    assert 'gradwatch_rollbacks_refused_by_agent_total{reason="unvouched"} 1.0' in metrics
    assert "gradwatch_checkpoint_overwrites_refused_total 1.0" in metrics
    messages = [r.getMessage() for r in caplog.records]
    agent_side = [m for m in messages if "REFUSED a signed rollback" in m]
    assert agent_side and str(attacker_file) in agent_side[0] and "unvouched" in agent_side[0]
    assert any("REFUSED the rollback" in m and JOB in m for m in messages)  # the collector's
    assert any("refused a second report of the checkpoint" in m for m in messages)
