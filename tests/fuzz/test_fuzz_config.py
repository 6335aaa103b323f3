"""Hostile configuration: ConfigError with a clear message or a valid config, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gradwatch.collector.cli import collector_main
from gradwatch.collector.config import CollectorConfig, ConfigError, load_config
from tests.fuzz.hostile import json_values, laughs, nested

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = sorted(CollectorConfig.model_fields)
SECRET_FIELDS = [
    f
    for f in FIELDS
    if f.startswith(
        (
            "webhook",
            "slack",
            "pagerduty_routing_key",
            "alertmanager_urls",
            "grafana_token",
            "command_key",
            "metrics_basic_auth_password",
        )
    )
]
env_values = st.one_of(
    st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30),
    st.sampled_from(
        [
            "",
            " ",
            "nan",
            "inf",
            "-inf",
            "-1",
            "0",
            "1e999",
            "1" * 5000,
            "true",
            "null",
            "[",
            "{",
            "[1,2",
            '{"slack": {"min_severity": "x"}}',
            '{"nope": 1}',
            nested(50_000),
            nested(50_000, '{"a":', "}"),
            "tcp://",
            "127.0.0.1:99999",
            "http://",
            "file:///etc/passwd",
            "a:²",
            "\ufeff",
            "DEBUG\n",
        ]
    ),
)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Exactly these GRADWATCH_* variables for the duration (the rest of os.environ kept)."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")}
    with mock.patch.dict(os.environ, {**clean, **values}, clear=True):
        yield


def check(
    path: Path | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> CollectorConfig | ConfigError:
    start = time.monotonic()
    with environment(env or {}):
        try:
            result: CollectorConfig | ConfigError = load_config(path, overrides)
        except ConfigError as exc:
            result = exc
            text = str(exc)
            assert text and "Traceback" not in text
            assert len(text) < 20_000, "an error message must stay readable"
    assert time.monotonic() - start < 5.0
    return result


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), env_values, min_size=1, max_size=3))
def test_random_environment_values(values: dict[str, str]) -> None:
    result = check(env={f"GRADWATCH_{key.upper()}": value for key, value in values.items()})
    if isinstance(result, ConfigError):
        text = str(result)
        assert any(key in text for key in values), text  # names what to fix
        for key, value in values.items():
            shared = sum(v == value for v in values.values()) > 1  # may be echoed for another key
            if key in SECRET_FIELDS and len(value) >= 8 and not shared:
                assert value not in text, f"{key}'s secret value was echoed"


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(FIELDS + ["nope", "metrics-addr", "LISTEN"]),
        json_values,
        min_size=1,
        max_size=4,
    )
)
def test_random_config_file_mappings(
    tmp_path_factory: pytest.TempPathFactory, values: dict[str, Any]
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "collector.yaml"
    try:
        path.write_text(
            yaml.safe_dump(values, allow_unicode=True), encoding="utf-8", errors="surrogatepass"
        )
    except yaml.YAMLError:
        assume(False)
    result = check(path)
    if isinstance(result, ConfigError):
        assert str(path) in str(result) or "collector configuration" in str(result)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_random_config_file_bytes(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "collector.yaml"
    path.write_bytes(content)
    check(path)


BOMB = laughs()


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00garbage",
        BOMB.encode() + b"listen: *l9\n",
        BOMB.encode() + b"routes: *l9\n",
        b"listen: " + nested(5_000).encode(),
        b"max_message_bytes: 1" + b"0" * 5000,
        b"data_dir: 2024-13-45",
        b"listen: !!python/object:os.system x",
        b"- a\n- b\n",
        b"? [a]\n: b\n",
    ],
    ids=["binary", "bomb", "bomb-routes", "deep", "digits", "date", "tag", "list", "unhashable"],
)
def test_pathological_config_files(tmp_path: Path, content: bytes) -> None:
    # Regression: binary and deep files raised UnicodeDecodeError and RecursionError; a
    # bomb took 50 s to repr for the error message.
    path = tmp_path / "collector.yaml"
    path.write_bytes(content)
    assert isinstance(check(path), ConfigError)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("GRADWATCH_ROUTES", "{bad"),
        ("GRADWATCH_ROUTES", nested(50_000)),
        ("GRADWATCH_WEBHOOKS", nested(50_000)),
        ("GRADWATCH_METRICS_ADDR", "a:²"),
    ],
)
def test_environment_values_that_used_to_crash(key: str, value: str) -> None:
    # Regression: SettingsError and RecursionError escaped load_config; '²' passed isdigit().
    error = check(env={key: value})
    assert isinstance(error, ConfigError)
    assert key.removeprefix("GRADWATCH_").lower() in str(error)


@pytest.mark.parametrize(
    ("env", "argv", "key"),
    [
        ({"GRADWATCH_MAX_MESSAGE_BYTES": "lots"}, [], "max_message_bytes"),
        ({"GRADWATCH_ROUTES": "{bad"}, [], "routes"),
        ({}, ["--metrics-addr", "nowhere"], "metrics_addr"),
        ({}, ["--listen", "\x1b[31mred"], "listen"),
    ],
)
def test_collector_cli_with_a_bad_value_exits_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], env: dict[str, str], argv: list[str], key: str
) -> None:
    with environment(env):
        assert collector_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradwatch collector: invalid collector configuration")
    assert key in err and "Traceback" not in err


def test_collector_cli_entry_point_in_a_real_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")}
    result = subprocess.run(
        [sys.executable, "-m", "gradwatch", "collector"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**env, "GRADWATCH_RECEIVE_HWM": "-5"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    first, *rest = result.stderr.splitlines()
    assert first == "gradwatch collector: invalid collector configuration:"
    assert rest[0].strip().startswith("receive_hwm: Input should be greater than or equal to 1")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("shutdown_timeout", "inf"),
        ("shutdown_timeout", "1e300"),
        ("webhook_timeout", "nan"),
        ("job_ttl_seconds", "inf"),
        ("alertmanager_resend_seconds", "Infinity"),
    ],
)
def test_infinite_or_huge_timeouts_are_config_errors(key: str, value: str) -> None:
    # Regression: shutdown_timeout=inf was accepted, then Server.stop() raised OverflowError
    # from Thread.join(inf): a traceback at every shutdown.
    error = check(env={f"GRADWATCH_{key.upper()}": value})
    assert isinstance(error, ConfigError) and key in str(error)
