"""Findings 6 and 7 of issue 15: config values checked against what they configure; exposure said.

(``watch()`` argument errors, the rest of finding 6, are the agent's: tests/agent.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gradwatch.collector.cli import collector_main
from gradwatch.collector.config import CollectorConfig, ConfigError, load_config
from gradwatch.collector.startup import exposed, warn_exposure


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("receive_hwm", 3_000_000_000),  # zmq's HWM is an int32: this hung the collector
        ("max_message_bytes", 1 << 40),
        ("job_ttl_seconds", 1e300),  # thread waits overflow
        ("outbox_max_pending", 10**12),
        ("max_jobs", 0),
    ],
)
def test_values_beyond_what_they_configure_are_config_errors(
    tmp_path: Path, key: str, value: float
) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(f"{key}: {value}\n")
    with pytest.raises(ConfigError, match=key):
        load_config(path)


def test_the_cli_exits_2_on_them_and_on_a_production_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text("receive_hwm: 3000000000\n")
    assert collector_main(["--config", str(path)]) == 2
    assert "receive_hwm" in capsys.readouterr().err
    monkeypatch.setenv("GRADWATCH_PROFILE", "production")
    assert collector_main(["--listen", "tcp://127.0.0.1:*", "--metrics-addr", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "profile 'production' refuses to start" in err and "curve" in err.lower()


def test_the_dev_profile_says_when_it_listens_beyond_loopback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gradwatch")
    assert warn_exposure(CollectorConfig()) == []  # the defaults: loopback only
    wide = CollectorConfig(
        listen="tcp://0.0.0.0:5555", metrics_addr="0.0.0.0:9400", command_listen="tcp://[::1]:5556"
    )
    assert exposed(wide) == ["listen=tcp://0.0.0.0:5555", "metrics_addr=0.0.0.0:9400"]
    assert warn_exposure(wide) == exposed(wide)
    (record,) = [r for r in caplog.records if "beyond loopback" in r.getMessage()]
    assert "profile: production" in record.getMessage()
    assert warn_exposure(CollectorConfig(listen="tcp://0.0.0.0:5555", profile="production")) == []
