"""The seam between alert transitions and the places they are sent.

A sink receives every transition the rules engine returns and decides what to
send (the webhook sends ``firing`` and ``resolved``). ``notify`` never blocks
the ingest thread: sinks queue and deliver from their own thread. The durable
outbox and the Slack / PagerDuty / Alertmanager sinks plug in here later.

Example::

    from gradwatch.collector.sinks import alert_payload, mask_url

    mask_url("https://hooks.example.com/T000/B000/secret")   # 'https://hooks.example.com/…'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

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
