"""CURVE on the ingest and command sockets, end to end: real agents, real collector."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

import pytest
import zmq
import zmq.auth

import gradwatch
from gradwatch.wire import Heartbeat, encode_heartbeat
from tests.security.helpers import (
    WAIT_S,
    agent,
    curve_config,
    make_keys,
    model_and_optimizer,
    refused,
    running,
    train_steps,
    use_agent_keys,
    wait_until,
)

ROLLBACK_RULES = """
groups:
  - name: rollback
    rules:
      - alert: NaNRollback
        detector: nonfinite
        for: 1
        severity: critical
        category: numerical
        actions: [notify, rollback]
"""
KEY = "c" * 32


def test_allowed_key_reports_and_strangers_are_refused_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path)
    with running(curve_config(keys)) as server:
        model, opt = model_and_optimizer()
        # Allowed key, allowed job: every step arrives.
        use_agent_keys(monkeypatch, keys.collector.public_file, keys.trainer)
        with agent(server, model, opt, "run-1", flush_every=5) as mon:
            assert wait_until(lambda: server.state.job("run-1") is not None), "no handshake"
            train_steps(mon, model, opt, 10)
        job = server.state.job("run-1")
        assert wait_until(
            lambda: (
                job is not None
                and job.ranks[0].latest is not None
                and job.ranks[0].latest.step == 10
            )
        )
        # No key at all (plain ZeroMQ): the handshake fails, nothing is ingested.
        use_agent_keys(monkeypatch, None, None)
        with agent(server, model, opt, "run-plain") as mon:
            assert wait_until(lambda: refused(server, "no_key") >= 1)
            train_steps(mon, model, opt, 3)
        # A CURVE key that is in no allow-list: refused by the ZAP handler.
        use_agent_keys(monkeypatch, keys.collector.public_file, keys.stranger)
        with (
            caplog.at_level(logging.ERROR, logger="gradwatch.agent"),
            agent(server, model, opt, "run-stranger") as mon,
        ):
            assert wait_until(lambda: refused(server, "unknown_key") >= 1)
            # The agent says why, once, at its next batch after the refusal reached it.
            assert wait_until(
                lambda: (
                    train_steps(mon, model, opt, 1)
                    or any(
                        "not in the collector's allow-list" in r.getMessage()
                        for r in caplog.records
                    )
                )
            )
        assert mon.stats.steps_sent == 0 and mon.stats.steps_dropped == mon.step
        assert (
            len(
                [r for r in caplog.records if "not in the collector's allow-list" in r.getMessage()]
            )
            == 1
        )
        # An allowed pair but the wrong server key (an impostor collector's): no handshake.
        use_agent_keys(monkeypatch, keys.stranger.public_file, keys.trainer)
        with agent(server, model, opt, "run-impostor"):
            assert wait_until(lambda: refused(server, "bad_handshake") >= 1)
        with urllib.request.urlopen(server.metrics_url, timeout=WAIT_S) as response:
            metrics = response.read().decode()
        assert server.state.jobs() == ["run-1"]
    for reason in ("no_key", "unknown_key"):
        line = next(
            x
            for x in metrics.splitlines()
            if x.startswith(f'gradwatch_auth_refused_total{{reason="{reason}"}}')
        )
        assert float(line.split()[-1]) >= 1.0


def test_key_allowed_for_run_star_cannot_report_another_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path)
    with running(curve_config(keys)) as server:
        model, opt = model_and_optimizer()
        use_agent_keys(monkeypatch, keys.collector.public_file, keys.trainer)
        with (
            caplog.at_level(logging.WARNING, logger="gradwatch.collector.auth"),
            agent(server, model, opt, "other") as mon,
        ):
            train_steps(mon, model, opt, 5)
            assert wait_until(lambda: refused(server, "job_not_allowed") >= 3)
        assert server.state.job("other") is None
        assert server.ingest.stats().messages == {"batch": 0, "heartbeat": 0, "event": 0}
    # Counted every time, logged once.
    logged = [r for r in caplog.records if "job 'other'" in r.getMessage()]
    assert len(logged) == 1 and "run-*" in logged[0].getMessage()


def test_revoked_key_is_refused_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_keys(tmp_path)
    with running(curve_config(keys)) as server:
        model, opt = model_and_optimizer()
        use_agent_keys(monkeypatch, keys.collector.public_file, keys.trainer)
        with agent(server, model, opt, "run-2") as mon:
            assert wait_until(lambda: server.state.job("run-2") is not None)
            keys.allow_file.write_text("version: 1\nclients: []\n")  # revoke every key
            assert wait_until(lambda: refused(server, "unknown_key") >= 1), (
                "the allow-list change was not picked up"
            )
            # `run-2` has shipped steps (waited for above), so it exists.
            before = server.state.job("run-2").ranks[0].last_step  # type: ignore[union-attr]
            train_steps(mon, model, opt, 3)
            assert wait_until(lambda: refused(server, "unknown_key") >= 4)
        # `run-2` has shipped steps, so it exists.
        assert server.state.job("run-2").ranks[0].last_step == before  # type: ignore[union-attr]


def test_commands_reach_an_allowed_agent_over_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_keys(tmp_path)
    rules = tmp_path / "rules.yaml"
    rules.write_text(ROLLBACK_RULES)
    config = curve_config(keys, rules=rules, command_key=KEY, data_dir=tmp_path / "state")
    monkeypatch.setenv("GRADWATCH_CHECKPOINT_ROOT", str(tmp_path))  # where the job saves
    (tmp_path / "ckpt-2.pt").write_bytes(b"weights of step 2")
    with running(config) as server:
        model, opt = model_and_optimizer()
        use_agent_keys(monkeypatch, keys.collector.public_file, keys.trainer)
        with agent(
            server, model, opt, "run-cmd", command_endpoint=server.command_endpoint, command_key=KEY
        ) as mon:
            assert server.wait_for_listener("run-cmd", WAIT_S), "no CURVE subscription"
            assert wait_until(lambda: server.state.job("run-cmd") is not None)
            train_steps(mon, model, opt, 2)
            mon.checkpoint_saved(2, tmp_path / "ckpt-2.pt")
            train_steps(mon, model, opt, 3, nan_from=3)
            assert mon.wait_for_command(WAIT_S), "no rollback command arrived"
            command = mon.pending_rollback()
        assert command is not None and command.step == 2
        assert sum(server.auth_counters.counts().values()) == 0


def test_bad_agent_key_file_switches_monitoring_off_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(tmp_path)
    keys.trainer.secret_file.chmod(0o644)  # a leaked-looking secret is refused, like ssh does
    model, opt = model_and_optimizer()
    use_agent_keys(monkeypatch, keys.collector.public_file, keys.trainer)
    with (
        caplog.at_level(logging.ERROR, logger="gradwatch"),
        gradwatch.watch(
            model, opt, job="run-3", endpoint="tcp://127.0.0.1:1", stats_every=0
        ) as mon,
    ):
        assert wait_until(lambda: mon.stats.disabled is not None)
        train_steps(mon, model, opt, 3)  # the loop goes on, unharmed
    assert "chmod 600" in str(mon.stats.disabled)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "CurveZMQ" in errors[0].getMessage()


def test_hostile_frames_from_an_allowed_key_are_counted_not_fatal(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    with running(curve_config(keys)) as server:
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        try:
            public, secret = zmq.auth.load_certificate(keys.trainer.secret_file)
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.collector.public_key.encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            # `load_certificate`'s secret is Optional; this key file holds one.
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)  # type: ignore[arg-type]
            sock.connect(server.bound_endpoint)
            hostile = [
                b"GW\x01\x02" + b"[" * 50_000 + b"]" * 50_000,
                b"GW\x01\x02not json",
                b"",
                b"GW\x01\x02" + b" " * (70 * 1024) + b"{}",
            ]
            for frame in hostile:
                sock.send(frame)
            sock.send(encode_heartbeat(Heartbeat("run-9", 0, 1, "inc", 0.0, 1, 0))[0])
            assert server.wait_for_messages(len(hostile) + 1, WAIT_S)
        finally:
            sock.close(linger=0)
            context.term()
        assert refused(server, "malformed") == len(hostile)
        assert server.ready and server.state.jobs() == ["run-9"]


def test_an_allowed_key_cannot_create_jobs_past_its_cap(tmp_path: Path) -> None:
    """Finding 2 of issue 15: one allowed key created 3,000 jobs; now max_jobs_per_key."""
    keys = make_keys(tmp_path)
    with running(curve_config(keys, max_jobs_per_key=5)) as server:
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        try:
            public, secret = zmq.auth.load_certificate(keys.trainer.secret_file)
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.collector.public_key.encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            # `load_certificate`'s secret is Optional; this key file holds one.
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)  # type: ignore[arg-type]
            sock.connect(server.bound_endpoint)
            for i in range(300):  # every name matches the key's run-* pattern
                sock.send(encode_heartbeat(Heartbeat(f"run-{i}", 0, 1, "inc", 0.0, 1, 0))[0])
            assert server.wait_for_messages(300, WAIT_S)
        finally:
            sock.close(linger=0)
            context.term()
        assert len(server.state.jobs()) == 5
        assert server.admission.refused()["jobs_per_key"] == 295
        # The key is named as the sender that caused it.
        assert (keys.trainer.public_key, "jobs_per_key", 295) in server.admission.offenders()
