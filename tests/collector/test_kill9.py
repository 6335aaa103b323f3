"""kill -9 loses no alert: a collector dies with an alert pending, its successor delivers it.

The real collector runs as a subprocess (``python -m gradwatch collector
--data-dir D``). The webhook receiver answers 503, an agent-shaped batch with a
NaN makes an alert pending, the collector is SIGKILLed after its first failed
attempt; a second collector on the same data dir, with the receiver back up,
delivers it with the same ``webhook-id`` and a valid signature.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.signing import decode_secret, verify
from gradwatch.wire import Batch, Schema, encode

READY_TIMEOUT_S = 60.0
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@contextmanager
def collector(
    tmp_path: Path, name: str, url: str, data_dir: Path
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    ready_file = tmp_path / f"{name}.ready.json"
    env = {**os.environ, "GRADWATCH_WEBHOOK_SECRET": SECRET}
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
            url,
            "--data-dir",
            str(data_dir),
            "--ready-file",
            str(ready_file),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            # Popen was started with stderr=PIPE.
            assert proc.poll() is None, f"collector exited early:\n{proc.stderr.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "collector not ready in time"
            time.sleep(0.02)  # waiting on another process's file; no event to block on
        yield proc, json.loads(ready_file.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=15)


def nan_batch() -> list[bytes]:
    rows = np.array([[1.0, 0.1, 1.0], [1.0, 0.1, float("nan")]], "<f4").tobytes()
    return encode(
        Batch(
            "kill9",
            0,
            1,
            1,
            0,
            "inc-a",
            0,
            (1, 2),
            (1.0, 2.0),
            rows,
            Schema(1, ("loss", "lr/0"), ("fc.weight",)),
        )
    )


def send(endpoint: str, frames: list[bytes]) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(endpoint)
        push.send_multipart(frames)
    finally:
        push.close(linger=2000)  # the frames must leave before the socket goes
        ctx.term()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_an_alert_pending_at_kill_9_is_delivered_after_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "state"
    with WebhookReceiver() as receiver:
        receiver.fail_with(503)
        with collector(tmp_path, "first", receiver.url, data_dir) as (proc, ready):
            send(ready["listen"], nan_batch())
            (failed,) = receiver.wait_for_attempts(1, timeout=30)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=15)
        assert failed.status == 503 and receiver.bodies == []
        receiver.fail_with(None)
        with collector(tmp_path, "second", receiver.url, data_dir) as (proc, _):
            (body,) = receiver.wait_for(lambda got: len(got) == 1, timeout=30)
            proc.terminate()
            _, err = proc.communicate(timeout=15)
            assert proc.returncode == 0, f"collector did not stop cleanly:\n{err}"
    delivered = receiver.requests[0]
    assert delivered.headers["webhook-id"] == failed.headers["webhook-id"]
    assert delivered.headers["webhook-id"] == f"{body['id']}:firing"
    assert (body["rule"], body["job"], body["step"]) == ("NonFiniteGradients", "kill9", 2)
    key = decode_secret(SECRET)
    raw = next(a.raw for a in receiver.attempts if a.status == 200)
    assert verify(key, delivered.headers, raw, now=time.time()) == delivered.headers["webhook-id"]
