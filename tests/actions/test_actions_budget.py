"""Rollback decisions: signed commands, the restart budget and cooldown, refusals."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from gradwatch.collector.actions import ACTIONS_FILE, Actions, ActionSettings, action_settings
from gradwatch.collector.config import CollectorConfig, ConfigError
from tests.actions.helpers import KEY, Clock, firing

RULES = {"NaNLoss": ("notify", "rollback"), "Slow": ("notify",)}
HOUR = 3600.0


def make(
    clock: Clock, sent: list[list[bytes]], path: Path | None = None, key: bytes | None = KEY
) -> Actions:
    settings = ActionSettings(
        key=key, skip_batches=300, max_rollbacks=3, window_s=6 * HOUR, cooldown_s=600.0, path=path
    )
    actions = Actions(settings, RULES, send=sent.append, clock=clock)
    for step in (100, 200, 300):
        actions.checkpoints.add("run-1", step, f"ckpt/{step}.pt", time=0.0)
    return actions


def test_firing_rollback_rule_sends_a_signed_command() -> None:
    clock, sent = Clock(), []
    actions = make(clock, sent)
    command = actions.on_transition(firing(step=250))
    assert command is not None
    assert (command["checkpoint"], command["step"], command["skip_batches"]) == (
        "ckpt/200.pt",
        200,
        300,
    )
    (frames,) = sent
    topic, body, signature = frames
    assert topic == b"run-1"
    assert json.loads(body) == command
    assert signature == b"v1=" + hmac.new(KEY, body, hashlib.sha256).hexdigest().encode()
    assert command["issued_at"] == clock.now and len(command["nonce"]) == 32
    # Only a fresh firing transition of a rollback rule acts.
    assert actions.on_transition(firing(rule="Slow", step=260)) is None
    again = firing(step=270)
    assert actions.on_transition(type(again)(again.alert, "firing", "firing")) is None
    assert actions.on_transition(type(again)(again.alert, "firing", "resolved")) is None
    assert len(sent) == 1 and actions.stats().sent == 1
    actions.close()


def test_budget_and_cooldown_count_restarts_across_a_collector_restart(tmp_path: Path) -> None:
    clock, sent = Clock(), []
    path = tmp_path / ACTIONS_FILE
    actions = make(clock, sent, path)
    assert actions.on_transition(firing(step=250)) is not None  # 1st
    clock.now += 60
    assert actions.on_transition(firing(step=260)) is None  # within cooldown
    assert actions.stats().refused == {"cooldown": 1}
    assert actions.on_transition(firing(step=250)) is None  # same incident id: never twice
    clock.now += 601
    assert actions.on_transition(firing(step=270)) is not None  # 2nd
    actions.close()

    # The collector restarts: the budget comes back from the SQLite file.
    actions = make(clock, sent, path)
    assert actions.budget.used("run-1", clock.now) == 2
    clock.now += 30
    assert actions.on_transition(firing(step=280)) is None  # cooldown survived
    clock.now += 601
    assert actions.on_transition(firing(step=290)) is not None  # 3rd
    clock.now += 601
    assert actions.on_transition(firing(step=295)) is None  # budget: 3 per 6 h
    assert actions.stats().refused == {"cooldown": 1, "budget": 1}
    assert actions.budget.used("other-job", clock.now) == 0
    clock.now += 6 * HOUR  # the window moves on
    assert actions.on_transition(firing(step=299)) is not None
    assert len(sent) == 4
    actions.close()


def test_without_a_key_rollback_is_off_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    clock, sent = Clock(), []
    with caplog.at_level(logging.WARNING):
        actions = make(clock, sent, key=None)
    assert "rollback is switched OFF" in caplog.text and "NaNLoss" in caplog.text
    assert actions.on_transition(firing(step=250)) is None
    assert sent == [] and actions.stats() == type(actions.stats())(0, {"disabled": 1}, False)
    actions.close()


def test_no_checkpoint_before_onset_is_refused_and_counted() -> None:
    clock, sent = Clock(), []
    actions = make(clock, sent)
    assert actions.on_transition(firing(step=100)) is None  # only saves at/after the onset
    assert actions.on_transition(firing(job="unknown", step=10_000)) is None
    assert sent == [] and actions.stats().refused == {"no_checkpoint": 2}
    actions.close()


def test_settings_from_config(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("0123456789abcdef0123\n")
    settings = action_settings(
        CollectorConfig(command_key_file=key_file, data_dir=tmp_path, rollback_skip_batches=7)
    )
    assert settings.key == b"0123456789abcdef0123" and settings.skip_batches == 7
    assert settings.path == tmp_path / ACTIONS_FILE and "0123" not in repr(settings)
    assert action_settings(CollectorConfig()).key is None
    with pytest.raises(ConfigError, match="at least 16"):
        action_settings(CollectorConfig(command_key="short"))
    with pytest.raises(ConfigError, match="cannot read command_key_file"):
        action_settings(CollectorConfig(command_key_file=tmp_path / "missing"))


def test_alerts_get_their_last_good_checkpoint() -> None:
    clock, sent = Clock(), []
    actions = make(clock, sent)
    annotated = actions.annotate(firing(rule="Slow", step=250))
    assert annotated.alert.last_good_checkpoint == "ckpt/200.pt"
    assert annotated.alert.id == firing(rule="Slow", step=250).alert.id
    assert actions.annotate(firing(step=50)).alert.last_good_checkpoint is None
    # Damage that came before the incident could be seen (ProgressLostToAWeightWrite: the
    # weights written at step 150, the loss back up by 250): the checkpoint of step 200
    # holds the damaged weights, so the one named is from before the onset.
    written = firing(rule="Slow", step=250)
    evidence = MappingProxyType({"onset_step": 150})
    written = replace(written, alert=replace(written.alert, evidence=evidence))
    assert actions.annotate(written).alert.last_good_checkpoint == "ckpt/100.pt"
    actions.close()


def test_metrics_text() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gradwatch.collector.actions_metrics import ActionsMetrics

    clock, sent = Clock(), []
    actions = make(clock, sent)
    registry = CollectorRegistry()
    registry.register(ActionsMetrics(actions))
    actions.on_transition(firing(step=250))
    actions.on_transition(firing(step=260))  # cooldown
    text = generate_latest(registry).decode()
    for line in (
        "gradwatch_rollbacks_sent_total 1.0",
        'gradwatch_rollbacks_refused_total{reason="cooldown"} 1.0',
        "gradwatch_rollback_enabled 1.0",
        'gradwatch_rollback_budget_remaining{training_job="run-1"} 2.0',
    ):
        assert line in text.splitlines(), text
    actions.close()
