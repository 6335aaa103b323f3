"""Collector configuration: one pure, validated settings object.

Precedence, lowest first: built-in defaults < YAML config file < ``GRADWATCH_*``
environment variables < command-line flags. Building a ``CollectorConfig`` reads
the environment and nothing else; ``load_config`` is the one place that opens a
file, and every problem it finds comes back as one ``ConfigError`` that names the
key and says what to do.

Example::

    from pathlib import Path
    from gradwatch.collector.config import load_config

    config = load_config(Path("collector.yaml"), {"listen": "tcp://0.0.0.0:5555"})
    print(config.metrics_addr)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1024 * 1024


def _installed_version() -> str:
    # Read from the distribution, not ``gradwatch.__version__``: the root
    # package references the agent (torch), which the collector must not import.
    try:
        return version("gradwatch")
    except PackageNotFoundError:
        return "unknown"


VERSION = _installed_version()

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class CollectorError(Exception):
    """Base of every error the collector raises on purpose."""


class ConfigError(CollectorError, ValueError):
    """The configuration (file, environment or flags) is invalid; the message says how."""


class CollectorConfig(BaseSettings):
    """Everything a collector needs to run. Pure data: no sockets, no files."""

    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_", extra="forbid", frozen=True, case_sensitive=False)

    listen: str = Field(
        default="tcp://127.0.0.1:5555",
        description="ZeroMQ endpoint the PULL socket binds; port '*' picks a free one.")
    metrics_addr: str = Field(
        default="127.0.0.1:9400", description="HOST:PORT of /metrics, /healthz and /readyz.")
    webhooks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Generic JSON webhook URLs that receive alerts.")
    rules: Path | None = Field(
        default=None, description="Rule file (YAML); None uses the packaged default pack.")
    max_message_bytes: int = Field(
        default=16 * MiB, ge=1024,
        description="Largest accepted message; also ZeroMQ MAXMSGSIZE.")
    receive_hwm: int = Field(
        default=1000, ge=1, description="ZeroMQ receive high-water mark, in messages.")
    history_steps: int = Field(
        default=2048, ge=1, description="Steps of history kept per rank (ring buffer).")
    per_layer_metrics: bool = Field(
        default=False, description="Expose gradwatch_layer_grad_norm{job,layer} series.")
    max_layer_series: int = Field(
        default=256, ge=1, description="Cap on per-layer series per job (top-K by norm).")
    job_ttl_seconds: float = Field(
        default=600.0, gt=0,
        description="Forget a job's state and series after this much silence.")
    shutdown_timeout: float = Field(
        default=5.0, gt=0, description="Seconds a graceful stop may take before giving up.")
    webhook_timeout: float = Field(
        default=5.0, gt=0, description="Seconds per webhook HTTP request.")
    webhook_queue_size: int = Field(
        default=1024, ge=1,
        description="Pending notifications per webhook before the oldest is dropped.")
    ready_file: Path | None = Field(
        default=None,
        description="Once ready, write {listen, metrics_url, pid} as JSON here (random ports "
        "made discoverable for supervisors and tests); removed on stop.")
    record_dir: Path | None = Field(
        default=None,
        description="Record every job as a JSON Lines trace <dir>/<job>.jsonl for `gradwatch "
        "replay`; a write error switches recording off (logged once), never the collector.")
    data_dir: Path | None = Field(
        default=None,
        description="Directory for the collector's durable state (alert outbox, checkpoints, "
        "restart budget), one SQLite file per concern; None keeps them in memory only.")
    log_level: LogLevel = "INFO"

    @field_validator("webhooks", mode="before")
    @classmethod
    def _split_webhooks(cls, value: Any) -> Any:
        # The environment carries one string: accept a JSON list or commas.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("webhooks")
    @classmethod
    def _check_webhooks(cls, value: list[str]) -> list[str]:
        for url in value:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("each webhook must be an http:// or https:// URL with a host")
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        if not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("must be a ZeroMQ endpoint such as tcp://127.0.0.1:5555")
        return value

    @field_validator("metrics_addr")
    @classmethod
    def _check_metrics_addr(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @property
    def metrics_host_port(self) -> tuple[str, int]:
        """``metrics_addr`` split into a host and an int port."""
        return split_host_port(self.metrics_addr)


def split_host_port(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:9400"`` -> ``("127.0.0.1", 9400)``; ``"[::1]:0"`` and ``":9400"`` too."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT with a port from 0 to 65535, e.g. 127.0.0.1:9400")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def load_config(path: Path | None = None,
                overrides: Mapping[str, Any] | None = None) -> CollectorConfig:
    """Build the config from a YAML file, the environment and flag ``overrides``.

    Raises ``ConfigError`` listing every invalid key and what to do about it.
    """
    file_values = _read_file(path) if path is not None else {}
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    try:
        # Fields set by the environment (and only those) must beat the file;
        # pydantic-settings ranks init arguments above the environment, so the
        # environment's values are read first and passed back in above the file's.
        from_env = CollectorConfig()
        env_values = from_env.model_dump(include=from_env.model_fields_set)
        return CollectorConfig(**{**file_values, **env_values, **flags})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from exc


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror or exc}; "
            "check the --config path or leave it out to use defaults") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of keys to values, "
            f"not a {type(data).__name__}")
    # Accept the flag spelling (metrics-addr) as well as the field name.
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def _describe(exc: ValidationError, path: Path | None) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(config)"
        if error["type"] == "extra_forbidden":
            known = ", ".join(sorted(CollectorConfig.model_fields))
            lines.append(f"  {key}: unknown key; valid keys are {known}")
            continue
        message = error["msg"].removeprefix("Value error, ")
        # Webhook URLs may embed tokens: never echo them back.
        got = "" if key.startswith("webhooks") else f" (got {error.get('input')!r:.80})"
        lines.append(f"  {key}: {message}{got}")
    where = f"the config file {path}, " if path is not None else ""
    return ("invalid collector configuration:\n" + "\n".join(lines) +
            f"\nFix these keys in {where}the GRADWATCH_<KEY> environment variables "
            "or the command-line flags.")
