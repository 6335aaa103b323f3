"""``gradwatch restart-hook`` over real HTTP: signatures, replays, allow-list, budget."""

from __future__ import annotations

import base64
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradwatch.collector.config import ConfigError
from gradwatch.collector.restart_hook import HookConfig, RestartHook, load_hook_config
from gradwatch.collector.signing import signature_headers
from gradwatch.collector.sinks import alert_payload
from tests.actions.helpers import firing

RAW = b"s" * 32
SECRET = "whsec_" + base64.b64encode(RAW).decode()
WAIT_S = 20.0
# The command records its environment: alert fields must arrive there, not in argv.
RECORD = (
    "import json, os, sys; open(sys.argv[1], 'a').write(json.dumps("
    "{k: v for k, v in os.environ.items() if k.startswith('GRADWATCH_ALERT_')}) + '\\n')"
)


@pytest.fixture
def hook(tmp_path: Path) -> Iterator[tuple[RestartHook, Path]]:
    out = tmp_path / "runs.jsonl"
    config = HookConfig(
        listen="127.0.0.1:0",
        secret=SECRET,
        command=[sys.executable, "-c", RECORD, str(out)],
        allow_categories=["numerical"],
        allow_rules=["LossSpike"],
        cooldown_s=0.0,
        budget=2,
        timeout_s=WAIT_S,
    )
    server = RestartHook(config)
    server.start()
    yield server, out
    server.stop()


def post(hook: RestartHook, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{hook.port}/",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def signed(
    step: int = 250,
    rule: str = "NaNLoss",
    category: str = "numerical",
    state: str = "firing",
    at: float | None = None,
    secret: bytes = RAW,
) -> tuple[bytes, dict[str, str]]:
    alert = firing(step=step, rule=rule, category=category).alert
    body = json.dumps({**alert_payload(alert), "state": state}).encode()
    return body, signature_headers(
        secret, f"{alert.id}:{state}", body, now=time.time() if at is None else at
    )


def test_valid_alert_runs_the_command_once(hook: tuple[RestartHook, Path]) -> None:
    server, out = hook
    body, headers = signed()
    status, answer = post(server, body, headers)
    assert status == 202 and answer["accepted"] is True
    assert server.wait_idle(WAIT_S)
    (env,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert env["GRADWATCH_ALERT_RULE"] == "NaNLoss" and env["GRADWATCH_ALERT_STEP"] == "250"
    assert json.loads(env["GRADWATCH_ALERT_JSON"])["job"] == "run-1"
    assert [run.returncode for run in server.runs] == [0]
    # The same delivery again (a retry or an attacker's replay) is refused.
    status, answer = post(server, body, headers)
    assert status == 409 and "already received" in answer["error"]
    assert len(out.read_text().splitlines()) == 1


@pytest.mark.parametrize(
    ("make", "status", "text"),
    [
        (lambda: signed(secret=b"w" * 32), 401, "signature"),
        (lambda: signed(at=time.time() - 3600), 401, "signature"),  # stale
        (lambda: (signed()[0], {}), 401, "signature"),  # unsigned
        (lambda: signed(rule="Slow", category="stalled"), 422, "not allow-listed"),
        (lambda: signed(state="resolved"), 422, "only firing"),
    ],
)
def test_refusals(hook: tuple[RestartHook, Path], make: Any, status: int, text: str) -> None:
    server, out = hook
    body, headers = make()
    got, answer = post(server, body, headers)
    assert got == status and text in answer["error"]
    assert server.runs == [] and not out.exists()


def test_tampered_body_is_refused(hook: tuple[RestartHook, Path]) -> None:
    server, out = hook
    body, headers = signed()
    forged = body.replace(b'"step": 250', b'"step": 1')
    assert forged != body
    assert post(server, forged, headers)[0] == 401 and not out.exists()


def test_budget_refuses_with_409(hook: tuple[RestartHook, Path]) -> None:
    server, out = hook
    for step in (10, 20):
        assert post(server, *signed(step=step, rule="LossSpike", category="loss_spike"))[0] == 202
        assert server.wait_idle(WAIT_S)
    status, answer = post(server, *signed(step=30))
    assert status == 409 and "budget" in answer["error"]
    assert len(out.read_text().splitlines()) == 2


def test_config_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="allow-list at least one"):
        load_hook_config(None, {"command": ["true"], "secret_file": tmp_path / "s"})
    with pytest.raises(ConfigError, match="command"):
        load_hook_config(None, {"allow_rules": ["X"]})
    path = tmp_path / "hook.yaml"
    path.write_text("command: [echo, hi]\nallow-rules: [X]\nlisten: 127.0.0.1:1\n")
    monkeypatch.setenv("GRADWATCH_HOOK_SECRET", SECRET)
    monkeypatch.setenv("GRADWATCH_HOOK_LISTEN", "127.0.0.1:2")
    config = load_hook_config(path, {"timeout_s": 5.0})
    assert (config.listen, config.command, config.timeout_s) == ("127.0.0.1:2", ["echo", "hi"], 5.0)
    assert config.key() == RAW and SECRET not in repr(config)
