"""The agent's side of commands: authentication, refusal counts, the loop's view, exit+resume."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import gradwatch
from gradwatch.agent import ROLLBACK_EXIT_CODE, Rollback, resume_plan
from gradwatch.agent.commands import CommandRefused, command_settings, verify_command
from gradwatch.wire.commands import encode_command
from tests.actions.helpers import KEY, T0

WAIT_S = 10.0


def command(
    job: str = "run-1", issued_at: float = T0, nonce: str = "n1", **extra: Any
) -> dict[str, Any]:
    return {
        "v": 1,
        "job": job,
        "action": "rollback",
        "checkpoint": "ckpt/200.pt",
        "step": 200,
        "skip_batches": 300,
        "alert_id": "abc",
        "rule": "NaNLoss",
        "issued_at": issued_at,
        "nonce": nonce,
        **extra,
    }


def test_verify_accepts_a_signed_fresh_command_once() -> None:
    seen: dict[str, float] = {}
    frames = encode_command(command(), KEY)
    got = verify_command(frames, KEY, "run-1", now=T0 + 5, seen=seen)
    assert got == Rollback("ckpt/200.pt", 200, 300, "abc", "NaNLoss", T0)
    with pytest.raises(CommandRefused) as replay:
        verify_command(frames, KEY, "run-1", now=T0 + 6, seen=seen)
    assert replay.value.reason == "replayed"


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        (encode_command(command(), KEY)[:2], "unsigned"),
        (encode_command(command(), KEY)[:2] + [b""], "unsigned"),
        (encode_command(command(), b"w" * 32), "bad_signature"),
        (encode_command(command(issued_at=T0 - 61), KEY), "stale"),
        (encode_command(command(issued_at=T0 + 61), KEY), "stale"),
        (encode_command(command(action="format_disk"), KEY), "malformed"),
        (encode_command({"job": "run-1", "nonce": "x"}, KEY), "malformed"),
    ],
)
def test_verify_refuses(frames: list[bytes], reason: str) -> None:
    with pytest.raises(CommandRefused) as refused:
        verify_command(frames, KEY, "run-1", now=T0, seen={})
    assert refused.value.reason == reason


def test_tampered_body_fails_the_signature() -> None:
    topic, body, signature = encode_command(command(), KEY)
    forged = body.replace(b"ckpt/200.pt", b"ckpt/999.pt")
    with pytest.raises(CommandRefused, match="bad_signature"):
        verify_command([topic, forged, signature], KEY, "run-1", now=T0, seen={})


def test_another_jobs_command_is_ignored() -> None:
    # SUB topics are prefixes: "run-1" also receives "run-10"'s commands.
    frames = encode_command(command(job="run-10"), KEY)
    assert verify_command(frames, KEY, "run-1", now=T0, seen={}) is None


def test_command_settings(tmp_path: Path) -> None:
    assert command_settings(None, None, env={}) == (None, None)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    env = {
        "GRADWATCH_COMMAND_ENDPOINT": "tcp://h:5556",
        "GRADWATCH_COMMAND_KEY_FILE": str(key_file),
    }
    assert command_settings(None, None, env=env) == ("tcp://h:5556", KEY)
    with pytest.raises(ValueError, match="no command key"):
        command_settings("tcp://h:5556", None, env={})
    with pytest.raises(ValueError, match="at least 16"):
        command_settings("tcp://h:5556", "short", env={})


# ---------------------------------------------------------------- real sockets


@pytest.fixture
def xpub() -> Iterator[tuple[zmq.Socket[Any], str]]:
    """The collector's side: an XPUB socket, which reports subscriptions."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


def subscribed(sock: zmq.Socket[Any], job: str) -> None:
    """Wait (bounded) for the agent's subscription: PUB drops what is sent before it."""
    assert sock.poll(int(WAIT_S * 1000)), "the agent never subscribed to commands"
    assert sock.recv() == b"\x01" + job.encode()


@pytest.fixture
def ckpt_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint root holding ckpt/200.pt, the working directory (the path is relative)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "200.pt").write_bytes(b"step 200 weights")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRADWATCH_CHECKPOINT_ROOT", str(tmp_path))
    return tmp_path


def saved(mon: Any, step: int, path: str) -> None:
    """Report a save and wait (bounded) until the shipper has taken it: in a real run the
    collector only learns of a checkpoint from that send, so it never names one earlier."""
    before = mon.stats.events_sent + mon.stats.events_dropped
    mon.checkpoint_saved(step, path)
    deadline = time.monotonic() + WAIT_S
    while mon.stats.events_sent + mon.stats.events_dropped == before:
        assert time.monotonic() < deadline, "the shipper never took the checkpoint event"
        time.sleep(0.01)


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(mon: Any, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    mon.log(loss=loss)
    opt.zero_grad()


def test_agent_takes_only_authentic_commands(
    xpub: tuple[zmq.Socket[Any], str], ckpt_root: Path
) -> None:
    sock, endpoint = xpub
    model, opt = tiny()
    with gradwatch.watch(
        model,
        opt,
        job="run-1",
        endpoint="tcp://127.0.0.1:1",
        command_endpoint=endpoint,
        command_key=KEY,
    ) as mon:
        subscribed(sock, "run-1")
        saved(mon, 200, "ckpt/200.pt")
        now = time.time()
        bad = [
            encode_command(command(issued_at=now, nonce="a"), KEY)[:2],  # unsigned
            encode_command(command(issued_at=now, nonce="b"), b"w" * 32),  # wrong key
            encode_command(command(issued_at=now - 120, nonce="c"), KEY),
        ]  # stale
        good = encode_command(command(issued_at=now, nonce="d"), KEY)
        for frames in [*bad, good, good]:  # + a replay
            sock.send_multipart(frames)
        assert mon.wait_for_command(WAIT_S)
        train_step(mon, model, opt)
        cmd = mon.pending_rollback()
        assert cmd == Rollback("ckpt/200.pt", 200, 300, "abc", "NaNLoss", now)
        assert mon.pending_rollback() is None  # taking it clears it
        # Commands are handled in order: once a later one is accepted, the replay was refused.
        sock.send_multipart(encode_command(command(issued_at=now, nonce="e"), KEY))
        assert mon.wait_for_command(WAIT_S) and mon.pending_rollback() is not None
        assert (mon.stats.commands_accepted, mon.stats.commands_refused) == (2, 4)
        mon.rollback_done(200)
        train_step(mon, model, opt)
        assert mon.step == 201 and mon.stats.disabled is None


def test_exit_mode_writes_the_plan_and_exits_75(
    xpub: tuple[zmq.Socket[Any], str], tmp_path: Path, ckpt_root: Path
) -> None:
    sock, endpoint = xpub
    resume = tmp_path / "resume.json"
    model, opt = tiny()
    mon = gradwatch.watch(
        model,
        opt,
        job="run-1",
        endpoint="tcp://127.0.0.1:1",
        command_endpoint=endpoint,
        command_key=KEY,
        on_rollback="exit",
        resume_file=str(resume),
    )
    subscribed(sock, "run-1")
    saved(mon, 200, "ckpt/200.pt")
    train_step(mon, model, opt)
    sock.send_multipart(encode_command(command(issued_at=time.time()), KEY))
    assert mon.wait_for_command(WAIT_S)
    with pytest.raises(SystemExit) as exited:
        train_step(mon, model, opt)  # the next step boundary
    assert exited.value.code == ROLLBACK_EXIT_CODE == 75
    assert mon.stats.disabled is None and json.loads(resume.read_text())["step"] == 200

    # The restarted process: the plan says what to load and how much to skip.
    plan = resume_plan(resume)
    assert plan is not None and (plan.checkpoint, plan.step, plan.skip_batches) == (
        "ckpt/200.pt",
        200,
        300,
    )
    mon2 = gradwatch.watch(
        model, opt, job="run-1", endpoint="tcp://127.0.0.1:1", resume_file=str(resume)
    )
    mon2.rollback_done(plan.step)  # removes the plan: the next restart starts afresh
    mon2.close()
    assert not resume.exists() and resume_plan(resume) is None


def test_resume_plan_errors_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="delete it"):
        resume_plan(bad)
    monkeypatch.setenv("GRADWATCH_RESUME_FILE", str(tmp_path / "env.json"))
    (tmp_path / "env.json").write_text(
        json.dumps({"checkpoint": "c.pt", "step": 5, "skip_batches": 2, "alert_id": "x"})
    )
    assert resume_plan() == Rollback("c.pt", 5, 2, "x")


def test_a_broken_env_setup_switches_commands_off_not_training(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GRADWATCH_COMMAND_ENDPOINT", "tcp://127.0.0.1:1")
    monkeypatch.delenv("GRADWATCH_COMMAND_KEY", raising=False)
    model, opt = tiny()
    with gradwatch.watch(model, opt, job="run-1", endpoint="tcp://127.0.0.1:1") as mon:
        train_step(mon, model, opt)
        assert mon.config.command_endpoint is None and mon.pending_rollback() is None
    assert "rollback commands are off" in caplog.text
    with pytest.raises(ValueError, match="no command key"):
        gradwatch.watch(model, opt, job="run-1", command_endpoint="tcp://127.0.0.1:1")
