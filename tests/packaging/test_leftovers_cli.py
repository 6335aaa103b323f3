"""Two first-hour CLI findings of issue 16 that the base-install test does not reach.

``python -m gradwatch.collector`` must behave as ``gradwatch collector``: on a
base install (no ``[collector]`` extra) one line naming the extra and exit 2,
never an ImportError traceback. ``gradwatch restart-hook --help`` must list
every setting with its ``GRADWATCH_HOOK_*`` variable and default, and the
variables it names must be the ones the hook reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch.cli import COMMAND_EXTRAS, EXTRA_MODULES, install_hint
from gradwatch.collector.config import ConfigError
from gradwatch.collector.restart_hook import HookConfig, hook_main, load_hook_config
from tests.packaging.venvs import ROOT, Venv, distributions_of

COLLECTOR_HINT = install_hint(COMMAND_EXTRAS["collector"])

# Runs `python -m gradwatch.collector ARGS` with the [collector] extra's modules absent, as on
# `pip install gradwatch`: importing one fails and importlib.util.find_spec finds none.
WITHOUT_EXTRA = f"""
import runpy, sys
for name in {EXTRA_MODULES["collector"]!r} + ("pydantic_core",):
    sys.modules[name] = None
sys.argv = ["gradwatch.collector", *sys.argv[1:]]
runpy.run_module("gradwatch.collector", run_name="__main__", alter_sys=True)
"""


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # gradwatch from this checkout, whatever the test interpreter has installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


# ------------------------------------------------------------ python -m gradwatch.collector


def test_python_m_collector_is_the_collector_command(tmp_path: Path) -> None:
    shown = _python("-m", "gradwatch.collector", "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: gradwatch collector")
    assert "GRADWATCH_MAX_MEMORY_BYTES" in shown.stdout
    bad = _python("-m", "gradwatch.collector", "--listen", "not-an-endpoint", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.startswith("gradwatch collector: invalid collector configuration")
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("args", [["--help"], ["--listen", "tcp://127.0.0.1:*"]])
def test_python_m_collector_without_the_extra_names_it(tmp_path: Path, args: list[str]) -> None:
    result = _python("-c", WITHOUT_EXTRA, *args, cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("gradwatch collector: needs the collector extra (")
    assert result.stderr.endswith(f"): {COLLECTOR_HINT}\n")
    assert result.stderr.count("\n") == 1


@pytest.mark.slow
def test_python_m_collector_from_a_base_install_of_the_wheel(wheel: Path, tmp_path: Path) -> None:
    venv = Venv.create(tmp_path / "venv", wheel)
    venv.link(distributions_of([]))
    for args in (["--help"], ["--listen", "tcp://127.0.0.1:*"]):
        result = venv.run("python", "-m", "gradwatch.collector", *args, cwd=tmp_path)
        assert "Traceback" not in result.stderr, result.stderr
        assert result.returncode == 2
        assert result.stderr.endswith(f"): {COLLECTOR_HINT}\n")
        assert result.stderr.count("\n") == 1
    # The same line as the `gradwatch collector` script gives.
    script = venv.run("gradwatch", "collector", "--help", cwd=tmp_path)
    assert script.stderr == result.stderr


# ------------------------------------------------------------ gradwatch restart-hook --help


def _hook_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        hook_main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_restart_hook_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _hook_help(capsys).splitlines()
    for name in HookConfig.model_fields:
        head = f"  {name}  GRADWATCH_HOOK_{name.upper()}  "
        found = [i for i, line in enumerate(lines) if line.startswith(head)]
        assert len(found) == 1, f"restart-hook --help lists {name} {len(found)} times"
        assert "(default: " in lines[found[0]], lines[found[0]]
        description = lines[found[0] + 1]
        assert description.startswith("      ") and description.strip(), f"{name}: no description"
    # Flags and defaults as a user reads them.
    for expected in (
        "  listen  GRADWATCH_HOOK_LISTEN  --listen  (default: 127.0.0.1:9402)",
        "  secret  GRADWATCH_HOOK_SECRET  (default: none)",
        "  timeout_s  GRADWATCH_HOOK_TIMEOUT_S  --timeout  (default: 600.0)",
        "  allow_categories  GRADWATCH_HOOK_ALLOW_CATEGORIES  --allow-category  (default: empty)",
        "  budget_window_s  GRADWATCH_HOOK_BUDGET_WINDOW_S  (default: 21600.0)",
    ):
        assert expected in lines


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("listen", "127.0.0.1:1", "127.0.0.1:1"),
        ("tolerance_s", "7", 7.0),
        ("allow_categories", "numerical, loss_spike", ["numerical", "loss_spike"]),
        ("allow_rules", '["LossSpike"]', ["LossSpike"]),
        ("command", '["scontrol", "requeue", "7"]', ["scontrol", "requeue", "7"]),
    ],
)
def test_the_variables_help_names_are_read(
    name: str,
    text: str,
    value: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    variable = f"GRADWATCH_HOOK_{name.upper()}"
    assert f"  {name}  {variable}  " in _hook_help(capsys)
    secret = tmp_path / "secret"
    secret.write_text("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n")
    monkeypatch.setenv(variable, text)
    flags = {"command": ["true"], "allow_rules": ["X"], "secret_file": secret}
    config = load_hook_config(None, {k: v for k, v in flags.items() if k != name})
    assert getattr(config, name) == value


def test_a_command_variable_that_is_not_json_is_one_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRADWATCH_HOOK_COMMAND", "scontrol requeue 7")
    with pytest.raises(ConfigError, match=r"GRADWATCH_HOOK_<KEY> .* to a JSON list"):
        load_hook_config(None, {"allow_rules": ["X"]})
