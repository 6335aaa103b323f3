"""The ``gradwatch`` command line: version, missing extras, closed pipes, settings, JSON logs."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from gradwatch import cli
from gradwatch.collector.cli import collector_parser
from gradwatch.collector.config import CollectorConfig
from gradwatch.logs import JsonFormatter, configure_logging

ROOT = Path(__file__).resolve().parents[1]


def run_gradwatch(
    *args: str,
    env: dict[str, str] | None = None,
    stdout: Any = subprocess.PIPE,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradwatch", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def write_trace(path: Path, steps: int) -> Path:
    """A trace whose loss turns NaN halfway: replay has an alert to print."""
    lines = ['{"type":"header","version":1,"job":"j","layers":[]}']
    lines += [
        json.dumps(
            {
                "type": "step",
                "step": s,
                "rank": 0,
                "time": float(s),
                "loss": 1.0 if s < steps // 2 else "nan",
            }
        )
        for s in range(1, steps + 1)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------ version


def test_version_flag_and_command_print_the_installed_version() -> None:
    expected = f"gradwatch {version('gradwatch')}"
    for flag in ("--version", "-V", "version"):
        result = run_gradwatch(flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected


# ------------------------------------------------------------------ missing extras


def test_a_command_whose_extra_is_missing_says_which_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("yaml", "torch") else real(name, *a),
    )
    assert cli.main(["replay", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == (
        "gradwatch replay: needs the collector extra (yaml not installed): "
        "pip install 'gradwatch[collector]'\n"
    )
    assert cli.main(["demo"]) == 2
    assert "pip install 'gradwatch[agent,collector]'" in capsys.readouterr().err
    assert cli.main(["version"]) == 0  # the base install's own commands still run


def test_an_import_error_of_an_optional_module_at_run_time_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def needs_matplotlib(argv: object) -> int:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setitem(cli.COMMANDS, "version", needs_matplotlib)
    assert cli.main(["version"]) == 2
    assert "pip install 'gradwatch[preflight]'" in capsys.readouterr().err

    def needs_a_typo(argv: object) -> int:
        raise ModuleNotFoundError("No module named 'nosuchmod'", name="nosuchmod")

    monkeypatch.setitem(cli.COMMANDS, "version", needs_a_typo)
    with pytest.raises(ModuleNotFoundError):  # a bug, not a missing extra: the traceback stays
        cli.main(["version"])


# ------------------------------------------------------------------ closed pipes


@pytest.mark.parametrize(
    ("args", "statuses"),
    [
        (["replay", "TRACE", "--json"], {cli.EXIT_BROKEN_PIPE}),
        (["replay", "TRACE"], {cli.EXIT_BROKEN_PIPE}),
        # argparse swallows the OSError of its own help write, so --help may still exit 0.
        (["collector", "--help"], {0, cli.EXIT_BROKEN_PIPE}),
    ],
)
def test_output_into_a_closed_pipe_ends_quietly(
    tmp_path: Path, args: list[str], statuses: set[int]
) -> None:
    """``gradwatch replay ... | head``: the reader is gone before anything is written."""
    trace = write_trace(tmp_path / "t.jsonl", 50)
    read, write = os.pipe()
    os.close(read)  # closed before the command starts: every write gets EPIPE, no race
    try:
        result = run_gradwatch(*[str(trace) if a == "TRACE" else a for a in args], stdout=write)
    finally:
        os.close(write)
    assert result.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"
    assert result.returncode in statuses


# ------------------------------------------------------------------ collector --help


def test_collector_help_lists_every_setting_with_its_environment_variable() -> None:
    text = collector_parser().format_help()
    missing = [
        name
        for name in CollectorConfig.model_fields
        if f"  {name}  GRADWATCH_{name.upper()}" not in text
    ]
    assert not missing, f"collector --help does not list {missing}"
    assert "  log_format  GRADWATCH_LOG_FORMAT  --log-format" in text
    assert (
        "  metrics_addr  GRADWATCH_METRICS_ADDR  --metrics-addr  (default: 127.0.0.1:9400)" in text
    )


# ------------------------------------------------------------------ JSON logs


def test_json_formatter_writes_one_strict_object_per_record() -> None:
    logger = logging.getLogger("gradwatch.test")
    record = logger.makeRecord(
        "gradwatch.test",
        logging.WARNING,
        __file__,
        1,
        "lost %d batches",
        (3,),
        None,
        extra={"job": "run-42", "ratio": float("nan")},
    )
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    body = json.loads(line)
    assert body["level"] == "WARNING" and body["logger"] == "gradwatch.test"
    assert (
        body["message"] == "lost 3 batches" and body["job"] == "run-42" and body["ratio"] == "nan"
    )
    assert body["time"].endswith("Z") and "ValueError: boom" in body["exc_info"]


def test_configure_logging_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown log format"):
        configure_logging("INFO", "xml")  # type: ignore[arg-type]  # the wrong value is the test


@pytest.mark.parametrize(
    ("before", "after", "env"),
    [
        ([], ["--log-format", "json"], {}),
        (["--log-format=json"], [], {}),
        ([], [], {"GRADWATCH_LOG_FORMAT": "json"}),
    ],
    ids=["flag", "global-flag", "environment"],
)
def test_collector_logs_json_lines(
    tmp_path: Path, before: list[str], after: list[str], env: dict[str, str]
) -> None:
    ready = tmp_path / "ready.json"
    argv = ["collector", "--listen", "tcp://127.0.0.1:*", "--metrics-addr", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradwatch", *before, *argv, "--ready-file", str(ready), *after],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for a file the collector writes once ready, bounded
        assert ready.exists(), "the collector did not get ready in 60 s"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = err.splitlines()
    assert lines, "the collector logged nothing"
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)


def test_a_bad_log_format_in_the_environment_exits_2() -> None:
    argv = ["collector", "--listen", "tcp://127.0.0.1:*", "--metrics-addr", "127.0.0.1:0"]
    result = run_gradwatch(*argv, env={"GRADWATCH_LOG_FORMAT": "xml"})
    assert result.returncode == 2
    assert "log_format: Input should be 'text' or 'json'" in result.stderr


def test_global_log_format_applies_to_one_shot_commands() -> None:
    """A warning logged inside any command comes out as one JSON line."""
    code = (
        "import logging, sys\n"
        "from gradwatch import cli\n"
        "def warn(argv):\n"
        "    logging.getLogger('gradwatch.replay').warning('skipped %d lines', 3)\n"
        "    return 0\n"
        "cli.COMMANDS['version'] = warn\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    run = [sys.executable, "-c", code]
    result = subprocess.run(
        [*run, "--log-format", "json", "version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stderr)
    assert body["message"] == "skipped 3 lines" and body["logger"] == "gradwatch.replay"
    bad = subprocess.run(
        [*run, "--log-format", "xml", "version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "--log-format takes text or json" in bad.stderr
