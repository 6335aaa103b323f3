"""gradwatch.collector: the sidecar that receives agents' batches and acts on them.

Pure configuration (``CollectorConfig``, ``load_config``), a ``Server`` that owns
sockets, threads and shutdown, alert sinks behind a durable outbox
(``OutboxSink`` with a webhook, Slack or PagerDuty channel; ``AlertmanagerSink``) and a loopback
``WebhookReceiver`` for tests and demos. Never imports torch.

Example::

    from gradwatch.collector import CollectorConfig, Server

    server = Server(CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"))
    server.start()
    print(server.bound_endpoint, server.metrics_port)
    server.stop()
"""

from gradwatch.collector.alertmanager import AlertmanagerSink
from gradwatch.collector.config import CollectorConfig, CollectorError, ConfigError, load_config
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.outbox_store import Outbox
from gradwatch.collector.receiver import WebhookReceiver
from gradwatch.collector.server import Server
from gradwatch.collector.webhook import WebhookChannel

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
