"""The seam between alert transitions and the places they are sent.

A sink receives every transition the rules engine returns and decides what to
send (``firing`` and ``resolved``). ``notify`` never blocks the ingest thread:
sinks queue and deliver from their own thread. The collector's sinks store
every notification in the durable outbox first (``gradwatch.collector.outbox``)
and format it for a generic signed webhook, Slack, PagerDuty or Alertmanager.

Example::

    from gradwatch.collector.sinks import alert_payload, mask_url

    mask_url("https://hooks.example.com/T000/B000/secret")   # 'https://hooks.example.com/…'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from pydantic import SecretStr

from gradwatch.collector.config import ConfigError

PAYLOAD_VERSION = 1
PAYLOAD_KIND = "gradwatch.alert"
NOTIFY_STATES = frozenset({"firing", "resolved"})


@dataclass(frozen=True, slots=True)
class SinkStats:
    """Counters of one sink, read at scrape time.

    ``delivered``, ``failed`` and ``dropped`` count notifications by final
    outcome; ``retries`` counts extra attempts; ``queued`` is the backlog now.
    """

    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    retries: int = 0
    queued: int = 0


class Sink(Protocol):
    """Where alert transitions go. Implementations must not block in ``notify``."""

    name: str

    def start(self) -> None: ...

    def notify(self, transition: Any) -> None: ...

    def close(self, timeout: float) -> None: ...

    def alive(self) -> bool: ...

    def stats(self) -> SinkStats: ...


def alert_payload(alert: Any) -> dict[str, Any]:
    """The JSON body every generic sink sends: ``Alert.to_dict()`` plus envelope keys."""
    return {"version": PAYLOAD_VERSION, "kind": PAYLOAD_KIND, **alert.to_dict()}


def idempotency_key(alert: Any) -> str:
    """Same alert, same state, same key: receivers drop retried duplicates."""
    return f"{alert.id}:{alert.state}"


def mask_url(url: str) -> str:
    """``scheme://host[:port]/…``: URLs often carry tokens, logs must not."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}/…"


def read_secret(value: SecretStr | None, path: Path | None, key: str) -> str | None:
    """The secret set as ``key`` (environment or config) or in the file ``<key>_file``.

    Raises ``ConfigError`` when both are set or the file cannot be read; the
    secret itself never appears in a message.
    """
    if value is not None and path is not None:
        raise ConfigError(f"both {key} and {key}_file are set; keep one of them")
    if value is not None:
        return value.get_secret_value().strip() or None
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {key}_file {path}: {exc.strerror or exc}; check the "
            "path and that the collector may read it"
        ) from exc
    if not text:
        raise ConfigError(f"{key}_file {path} is empty; put the secret in it or unset it")
    return text
