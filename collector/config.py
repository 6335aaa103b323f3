"""Collector configuration: one pure, validated settings object.

Precedence, lowest first: built-in defaults < YAML config file < ``GRADWATCH_*``
environment variables < command-line flags. Building a ``CollectorConfig`` reads
the environment and nothing else; ``load_config`` is the one place that opens a
file, and every problem it finds comes back as one ``ConfigError`` that names the
key and says what to do. Single values (lists from the environment, ``HOST:PORT``,
URLs) are read by ``settings_common``, as for the restart hook; ``split_host_port``
is still importable from here.

Example::

    from pathlib import Path
    from gradwatch.collector.config import load_config

    config = load_config(Path("collector.yaml"), {"listen": "tcp://0.0.0.0:5555"})
    print(config.metrics_addr)
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from gradwatch.collector.config_file import describe_errors, read_config_file
from gradwatch.collector.routing import RoutePolicy
from gradwatch.collector.settings_common import is_http_url, split_host_port, split_list

MiB = 1024 * 1024
# Upper bound of durations: larger ones overflow thread and socket waits (OverflowError).
YEAR = 365 * 24 * 3600.0


def _installed_version() -> str:
    # Read from the distribution, not ``gradwatch.__version__``: the root
    # package references the agent (torch), which the collector must not import.
    try:
        return version("gradwatch")
    except PackageNotFoundError:
        return "unknown"


VERSION = _installed_version()

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
SinkKind = Literal["webhook", "slack", "pagerduty", "alertmanager"]  # the routable alert sinks


class CollectorError(Exception):
    """Base of every error the collector raises on purpose."""


class ConfigError(CollectorError, ValueError):
    """The configuration (file, environment or flags) is invalid; the message says how."""


class CollectorConfig(BaseSettings):
    """Everything a collector needs to run. Pure data: no sockets, no files."""

    # allow_inf_nan=False: an infinite timeout or window overflows thread and socket waits.
    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_",
        extra="forbid",
        frozen=True,
        case_sensitive=False,
        allow_inf_nan=False,
    )

    listen: str = Field(
        default="tcp://127.0.0.1:5555",
        description="ZeroMQ endpoint the PULL socket binds; port '*' picks a free one.",
    )
    metrics_addr: str = Field(
        default="127.0.0.1:9400", description="HOST:PORT of /metrics, /healthz and /readyz."
    )
    webhooks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Generic JSON webhook URLs that receive alerts."
    )
    rules: Path | None = Field(
        default=None, description="Rule file (YAML); None uses the packaged default pack."
    )
    max_message_bytes: int = Field(
        default=16 * MiB,
        ge=1024,
        le=1024 * MiB,
        description="Largest accepted message; larger ones are counted as oversized "
        "(ZeroMQ MAXMSGSIZE is 4x this, so they reach the count).",
    )
    receive_hwm: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="ZeroMQ receive high-water mark, in messages (ZeroMQ takes an int32; "
        "each queued message may be max_message_bytes, so keep it small).",
    )
    # Hard bounds on hostile but well-formed input (collector/limits.py, SECURITY.md).
    max_jobs: int = Field(
        default=256,
        ge=1,
        le=1_000_000,
        description="Jobs tracked at once; messages of further jobs are refused and counted.",
    )
    max_jobs_per_key: int = Field(
        default=64,
        ge=1,
        le=1_000_000,
        description="Jobs one CurveZMQ key may have tracked at once.",
    )
    max_ranks_per_job: int = Field(
        default=16_384, ge=1, le=1 << 20, description="Ranks tracked per job."
    )
    max_layers_per_schema: int = Field(
        default=16_384,
        ge=1,
        le=1 << 20,
        description="Layers (parameter tensors) one schema may name.",
    )
    max_rows_per_batch: int = Field(
        default=256,
        ge=1,
        le=65_536,
        description="Steps one batch may carry (the agent's flush_every); bounds the work "
        "per message.",
    )
    max_memory_bytes: int = Field(
        default=1536 * MiB,
        ge=64 * MiB,
        le=1 << 44,
        description="Resident memory above which no new job or rank is admitted; keep the "
        "container limit ~25% above it.",
    )
    ingest_share: float = Field(
        default=0.8,
        gt=0,
        le=1.0,
        description="Share of the ingest thread's time that senders split evenly (a sender "
        "is a job, or a CurveZMQ key); one over its share is refused until it "
        "slows down.",
    )
    ingest_burst_seconds: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="Ingest time a sender may use at once before its share applies.",
    )
    max_checkpoints_per_job: int = Field(
        default=100,
        ge=1,
        le=1_000_000,
        description="Checkpoint entries kept per job (the newest steps).",
    )
    max_checkpoint_rows: int = Field(
        default=100_000,
        ge=1,
        le=100_000_000,
        description="Checkpoint entries kept in all; the oldest go first.",
    )
    checkpoint_max_age_seconds: float = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        le=10 * YEAR,
        description="Checkpoint entries older than this are pruned.",
    )
    http_max_connections: int = Field(
        default=64,
        ge=1,
        le=65_536,
        description="Open connections to /metrics, /healthz and /readyz; more are refused "
        "and counted.",
    )
    http_read_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="A client that sends nothing for this long is disconnected.",
    )
    history_steps: int = Field(
        default=2048,
        ge=1,
        description="Ignored since the collector stopped keeping per-rank step history "
        "(memory at scale); still accepted so existing config files load.",
    )
    assembly_deadline_seconds: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How long a multi-rank job's step waits for late ranks before it is "
        "judged without them (those ranks are then not waited for until they "
        "catch up).",
    )
    per_layer_metrics: bool = Field(
        default=False, description="Expose gradwatch_layer_grad_norm{job,layer} series."
    )
    max_layer_series: int = Field(
        default=256, ge=1, description="Cap on per-layer series per job (top-K by norm)."
    )
    max_block_series: int = Field(
        default=512,
        ge=1,
        description="Cap on per-block grad-norm series per job (non-finite first, then largest).",
    )
    max_rank_series: int = Field(
        default=64,
        ge=1,
        description="Cap on per-rank last-seen series per job (the ranks silent longest).",
    )
    max_series_per_family: int = Field(
        default=20_000,
        ge=1,
        le=10_000_000,
        description="Cap on the per-block, per-layer, per-rank and per-module series of all "
        "jobs together, per family: with many jobs each job's cap shrinks to its "
        "share, so /metrics stays small and fast.",
    )
    job_ttl_seconds: float = Field(
        default=600.0,
        gt=0,
        le=YEAR,
        description="Forget a job's state and series after this much silence.",
    )
    finished_grace_seconds: float = Field(
        default=60.0,
        ge=0,
        le=YEAR,
        description="Forget a job this long after every rank's agent closed (its final "
        "values stay long enough for Prometheus to scrape them).",
    )
    shutdown_timeout: float = Field(
        default=5.0, gt=0, le=3600, description="Seconds a graceful stop may take before giving up."
    )
    webhook_timeout: float = Field(
        default=5.0, gt=0, le=3600, description="Seconds per webhook HTTP request."
    )
    webhook_queue_size: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="In-memory queue of the Grafana annotation sink (annotations are not "
        "pages: best effort); alert sinks are bounded by outbox_max_pending instead.",
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="Standard Webhooks secret (whsec_<base64>) signing every "
        "generic webhook request; None sends them unsigned.",
    )
    webhook_secret_file: Path | None = Field(
        default=None, description="File holding the webhook secret (a mounted secret)."
    )
    slack_webhook_url: SecretStr | None = Field(
        default=None, description="Slack incoming webhook URL (its path is a secret)."
    )
    slack_webhook_url_file: Path | None = Field(
        default=None, description="File holding the Slack incoming webhook URL."
    )
    pagerduty_routing_key: SecretStr | None = Field(
        default=None, description="PagerDuty Events API v2 integration (routing) key."
    )
    pagerduty_routing_key_file: Path | None = Field(
        default=None, description="File holding the PagerDuty routing key."
    )
    pagerduty_url: str = Field(
        default="https://events.pagerduty.com/v2/enqueue",
        description="PagerDuty Events API v2 endpoint (change it only for tests or proxies).",
    )
    alertmanager_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Alertmanager base URLs (http://host:9093); alerts are POSTed to "
        "/api/v2/alerts and re-posted while firing.",
    )
    alertmanager_resend_seconds: float = Field(
        default=60.0, gt=0, le=YEAR, description="Re-post firing alerts to Alertmanager this often."
    )
    routes: dict[SinkKind, RoutePolicy] = Field(
        default_factory=dict,
        description="Per sink kind: min_severity, categories, exclude_categories, "
        "rate_per_minute (e.g. {pagerduty: {min_severity: critical}}).",
    )
    outbox_max_age_seconds: float = Field(
        default=24 * 3600.0,
        gt=0,
        le=YEAR,
        description="Keep retrying an undelivered alert this long, then give up (counted).",
    )
    outbox_max_pending: int = Field(
        default=10_000,
        ge=1,
        le=10_000_000,
        description="Undelivered notifications kept per sink; past it the least important "
        "of the job holding the most is dropped (collector/outbox.py).",
    )
    ready_file: Path | None = Field(
        default=None,
        description="Once ready, write {listen, metrics_url, pid} as JSON here (random ports "
        "made discoverable for supervisors and tests); removed on stop.",
    )
    record_dir: Path | None = Field(
        default=None,
        description="Record every job as a JSON Lines trace <dir>/<job>.jsonl for `gradwatch "
        "replay`; a write error switches recording off (logged once), never the collector.",
    )
    data_dir: Path | None = Field(
        default=None,
        description="Directory for the collector's durable state (alert outbox, checkpoints, "
        "restart budget), one SQLite file per concern; None keeps them in memory only.",
    )
    command_listen: str = Field(
        default="tcp://127.0.0.1:5556",
        description="ZeroMQ endpoint of the PUB socket that sends signed rollback commands to "
        "agents (topic = job); used only when a command key is set.",
    )
    command_key: SecretStr | None = Field(
        default=None,
        description="Shared HMAC-SHA256 key (>= 16 bytes) signing rollback commands; agents need "
        "the same key. None (and no command_key_file) switches rollback actions off.",
    )
    command_key_file: Path | None = Field(
        default=None, description="File holding the command key (a mounted secret)."
    )
    rollback_skip_batches: int = Field(
        default=200,
        ge=0,
        description="Batches a rolled-back job skips after resuming (PaLM: a few hundred).",
    )
    rollback_margin_steps: int = Field(
        default=0,
        ge=0,
        description="Roll back to a checkpoint at least this many steps before the onset.",
    )
    rollback_budget: int = Field(
        default=3, ge=0, description="Rollbacks allowed per job per rollback_budget_window_s."
    )
    rollback_budget_window_s: float = Field(
        default=6 * 3600.0, gt=0, le=YEAR, description="Window of the rollback budget, in seconds."
    )
    rollback_cooldown_s: float = Field(
        default=600.0, ge=0, le=YEAR, description="Least time between two rollbacks of one job."
    )
    log_level: LogLevel = "INFO"
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines as text, or one JSON object per line for "
        "cluster log collectors (Loki, Fluent Bit).",
    )
    grafana_url: str | None = Field(
        default=None,
        description="Grafana base URL (http(s)://host:port); alerts become annotations there.",
    )
    grafana_token: SecretStr | None = Field(
        default=None, description="Grafana service-account token (Editor role)."
    )
    grafana_token_file: Path | None = Field(
        default=None, description="File holding the Grafana token (a mounted secret)."
    )
    grafana_dashboard_uid: str | None = Field(
        default=None,
        description="Attach annotations to this dashboard; None makes organization "
        "annotations that any dashboard shows through a tag filter.",
    )
    # Authenticated channels (SECURITY.md).
    profile: Literal["dev", "production"] = Field(
        default="dev",
        description="'production' refuses to start without CURVE keys, without a command key "
        "when a rule rolls back, with unsigned webhooks, or with /metrics on a non-loopback "
        "address without basic auth and TLS.",
    )
    curve_secret_key_file: Path | None = Field(
        default=None,
        description="The collector's CurveZMQ NAME.key_secret (mode 0600, `gradwatch keys "
        "generate`): ingest and command sockets then accept only allow-listed agents.",
    )
    curve_allow_file: Path | None = Field(
        default=None,
        description="YAML allow-list: agent public key -> job glob patterns it may report "
        "(`gradwatch keys allow`); re-read when it changes.",
    )
    metrics_tls_cert_file: Path | None = Field(
        default=None, description="PEM certificate (chain) for HTTPS on metrics_addr."
    )
    metrics_tls_key_file: Path | None = Field(
        default=None, description="PEM private key of metrics_tls_cert_file."
    )
    metrics_basic_auth_user: str | None = Field(
        default=None, description="Basic-auth user /metrics requires (/healthz, /readyz open)."
    )
    metrics_basic_auth_password: SecretStr | None = Field(
        default=None, description="Basic-auth password of metrics_basic_auth_user."
    )
    metrics_basic_auth_password_file: Path | None = Field(
        default=None, description="File holding the basic-auth password (a mounted secret)."
    )

    @field_validator("webhooks", "alertmanager_urls", mode="before")
    @classmethod
    def _split_webhooks(cls, value: Any) -> Any:
        return split_list(value)  # the environment carries one string: JSON list or commas

    @field_validator("webhooks", "alertmanager_urls")
    @classmethod
    def _check_webhooks(cls, value: list[str]) -> list[str]:
        if not all(is_http_url(url) for url in value):
            raise ValueError("each webhook must be an http:// or https:// URL with a host")
        return value

    @field_validator("grafana_url")
    @classmethod
    def _check_grafana_url(cls, value: str | None) -> str | None:
        if value is not None and not is_http_url(value):
            raise ValueError(
                "must be an http:// or https:// URL with a host, e.g. http://grafana:3000"
            )
        return value

    @field_validator("listen", "command_listen")
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

    @model_validator(mode="after")
    def _check_pairs(self) -> CollectorConfig:
        # Half a pair is a typo, never a choice: refuse it instead of running open.
        pairs = (
            ("curve_secret_key_file", "curve_allow_file"),
            ("metrics_tls_cert_file", "metrics_tls_key_file"),
        )
        for first, second in pairs:
            if (getattr(self, first) is None) != (getattr(self, second) is None):
                raise ValueError(f"{first} and {second} go together: set both or neither")
        password = (
            self.metrics_basic_auth_password is not None
            or self.metrics_basic_auth_password_file is not None
        )
        if (self.metrics_basic_auth_user is not None) == password:
            return self
        raise ValueError(
            "metrics_basic_auth_user needs metrics_basic_auth_password or "
            "metrics_basic_auth_password_file (and the other way round)"
        )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower_format(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @property
    def metrics_host_port(self) -> tuple[str, int]:
        """``metrics_addr`` split into a host and an int port."""
        return split_host_port(self.metrics_addr)


def load_config(
    path: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> CollectorConfig:
    """Build the config from a YAML file, the environment and flag ``overrides``.

    Raises ``ConfigError`` listing every invalid key and what to do about it.
    """
    try:
        file_values = read_config_file(path) if path is not None else {}
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    try:
        # Fields set by the environment (and only those) must beat the file;
        # pydantic-settings ranks init arguments above the environment, so the
        # environment's values are read first and passed back in above the file's.
        from_env = CollectorConfig()
        env_values = from_env.model_dump(include=from_env.model_fields_set)
        return CollectorConfig(**{**file_values, **env_values, **flags})
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, path, CollectorConfig.model_fields)) from exc
    except SettingsError as exc:  # a GRADWATCH_* value that is not the JSON it must be
        raise ConfigError(
            f"invalid collector configuration: {exc}: {exc.__cause__ or 'bad value'}; set "
            "that GRADWATCH_<KEY> environment variable to a JSON object or unset it"
        ) from exc
    except RecursionError as exc:  # pydantic-settings' JSON decoding of GRADWATCH_ROUTES
        raise ConfigError(
            "invalid collector configuration: a GRADWATCH_* value (routes, a JSON object) is "
            "nested too deeply to read; give it the documented shape"
        ) from exc
