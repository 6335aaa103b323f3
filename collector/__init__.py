"""gradwatch.collector: the sidecar that receives agents' batches and acts on them.

Pure configuration (``CollectorConfig``, ``load_config``), a ``Server`` that owns
sockets, threads and shutdown, alert sinks behind a durable outbox
(``OutboxSink`` with a webhook, Slack or PagerDuty channel; ``AlertmanagerSink``) and a loopback
``WebhookReceiver`` for tests and demos. Never imports torch.

The names below are imported on first use (PEP 562), not with the package:
``python -m gradwatch.collector`` on a base install (no ``[collector]`` extra)
then reaches ``__main__``, which names the extra to install, instead of ending
in an ImportError here; and ``gradwatch rules check`` does not load the server.

Example::

    from gradwatch.collector import CollectorConfig, Server

    server = Server(CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"))
    server.start()
    print(server.bound_endpoint, server.metrics_port)
    server.stop()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradwatch.collector.alertmanager import AlertmanagerSink
    from gradwatch.collector.config import (
        CollectorConfig,
        CollectorError,
        ConfigError,
        load_config,
    )
    from gradwatch.collector.outbox import OutboxSink
    from gradwatch.collector.outbox_store import Outbox
    from gradwatch.collector.receiver import WebhookReceiver
    from gradwatch.collector.server import Server
    from gradwatch.collector.webhook import WebhookChannel

# Each public name and the module that defines it.
_HOMES = {
    "AlertmanagerSink": "alertmanager",
    "CollectorConfig": "config",
    "CollectorError": "config",
    "ConfigError": "config",
    "Outbox": "outbox_store",
    "OutboxSink": "outbox",
    "Server": "server",
    "WebhookChannel": "webhook",
    "WebhookReceiver": "receiver",
    "load_config": "config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = [
    "AlertmanagerSink",
    "CollectorConfig",
    "CollectorError",
    "ConfigError",
    "Outbox",
    "OutboxSink",
    "Server",
    "WebhookChannel",
    "WebhookReceiver",
    "load_config",
]
