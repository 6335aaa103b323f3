"""Config: defaults, file < env < flags precedence, errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradwatch.collector.config import CollectorConfig, ConfigError, load_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.upper().startswith("GRADWATCH_")]:
        monkeypatch.delenv(key)


def test_defaults() -> None:
    config = CollectorConfig()
    assert config.listen == "tcp://127.0.0.1:5555"
    assert config.metrics_host_port == ("127.0.0.1", 9400)
    assert config.webhooks == [] and config.rules is None
    assert (config.history_steps, config.max_message_bytes) == (2048, 16 * 1024 * 1024)
    assert (config.per_layer_metrics, config.max_layer_series) == (False, 256)
    assert (config.job_ttl_seconds, config.shutdown_timeout, config.log_level) == (600, 5, "INFO")


def test_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(
        "listen: tcp://0.0.0.0:6000\nhistory-steps: 10\nmax_layer_series: 5\nlog_level: debug\n"
    )
    monkeypatch.setenv("GRADWATCH_HISTORY_STEPS", "20")
    monkeypatch.setenv("GRADWATCH_MAX_LAYER_SERIES", "30")
    config = load_config(path, {"max_layer_series": 40, "listen": None})
    assert config.listen == "tcp://0.0.0.0:6000"  # file (flag left unset)
    assert config.history_steps == 20  # env beats file
    assert config.max_layer_series == 40  # flag beats env
    assert config.log_level == "DEBUG"


@pytest.mark.parametrize(
    "value",
    ["https://a.example/x, http://b.example/y", '["https://a.example/x", "http://b.example/y"]'],
)
def test_webhooks_from_env_as_commas_or_json(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GRADWATCH_WEBHOOKS", value)
    assert load_config().webhooks == ["https://a.example/x", "http://b.example/y"]


def test_errors_name_every_key_and_hide_webhook_secrets() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            {
                "history_steps": 0,
                "metrics_addr": "nope",
                "webhooks": ["ftp://host/s3cret"],
                "bogus": 1,
            },
        )
    message = str(info.value)
    for key in ("history_steps", "metrics_addr", "webhooks", "bogus: unknown key"):
        assert key in message
    assert "s3cret" not in message
    assert "GRADWATCH_<KEY>" in message


def test_unreadable_or_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
