"""What a ``Server`` is built from: its rules engine, its sinks, its store counters.

Pure assembly from a :class:`CollectorConfig`, apart from the server's sockets
and threads so that it can be read, tested and reused on its own: a test that
checks what a configuration delivers builds the sinks without starting a server.

Example::

    from gradwatch.collector.config import CollectorConfig
    from gradwatch.collector.wiring import build_sinks

    sinks = build_sinks(CollectorConfig(webhooks=["http://127.0.0.1:9/hook"]))
    print([sink.name for sink in sinks])   # ['webhook-0']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, Metric

from gradwatch.collector.actions import Actions
from gradwatch.collector.alertmanager import AlertmanagerSink
from gradwatch.collector.config import CollectorConfig, ConfigError, SinkKind
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.outbox_store import Outbox
from gradwatch.collector.pagerduty import PagerDutyChannel
from gradwatch.collector.recorder import TraceRecorder
from gradwatch.collector.routing import Router
from gradwatch.collector.signing import SignatureError, decode_secret
from gradwatch.collector.sinks import Sink, read_secret
from gradwatch.collector.slack import SlackChannel
from gradwatch.collector.webhook import WebhookChannel
from gradwatch.rules import Engine, Step, load_default_rules, load_rules
from gradwatch.rules.agent_health import AgentNotice
from gradwatch.rules.step import Eval, Liveness, Stats


class RulesEngine(Protocol):
    """What the server needs of ``gradwatch.rules.Engine`` (test doubles implement this)."""

    def observe(self, step: Step) -> Sequence[Any]: ...

    def observe_stats(self, stats: Stats) -> Sequence[Any]: ...

    def observe_eval(self, ev: Eval) -> Sequence[Any]: ...

    def observe_notice(self, notice: AgentNotice) -> Sequence[Any]: ...

    def tick(self, liveness: Sequence[Liveness]) -> Sequence[Any]: ...

    def firing(self) -> Sequence[Any]: ...

    def forget(self, job: str) -> Sequence[Any] | None: ...

    def data_changed(self, job: str, step: int) -> None: ...

    def weights_written(self, job: str, rank: int, step: int) -> None: ...


def build_engine(config: CollectorConfig, clock: Callable[[], float]) -> Engine:
    """The engine for ``config.rules`` (or the default pack); raises ``RuleFileError``."""
    specs = load_rules(config.rules) if config.rules is not None else load_default_rules()
    return Engine(specs, clock=clock)


def build_sinks(config: CollectorConfig) -> list[Sink]:
    """Every configured sink; alert sinks each hold a connection to the durable outbox."""

    def outbox() -> Outbox:
        return Outbox.open(config.data_dir, max_pending=config.outbox_max_pending)

    def options(kind: SinkKind, name: str) -> dict[str, Any]:
        return {
            "router": Router(config.routes.get(kind), name=name),
            "max_age": config.outbox_max_age_seconds,
        }

    # Every secret is read (and may fail) before any outbox is opened.
    secret = read_secret(config.webhook_secret, config.webhook_secret_file, "webhook_secret")
    try:
        key = decode_secret(secret) if secret is not None else None
    except SignatureError as exc:
        raise ConfigError(f"webhook_secret: {exc}") from exc
    slack = read_secret(
        config.slack_webhook_url, config.slack_webhook_url_file, "slack_webhook_url"
    )
    routing_key = read_secret(
        config.pagerduty_routing_key, config.pagerduty_routing_key_file, "pagerduty_routing_key"
    )
    timeout = config.webhook_timeout
    sinks: list[Sink] = [
        OutboxSink(
            f"webhook-{i}",
            WebhookChannel(url, secret=key, timeout=timeout),
            outbox(),
            **options("webhook", f"webhook-{i}"),
        )
        for i, url in enumerate(config.webhooks)
    ]
    if slack is not None:
        sinks.append(
            OutboxSink(
                "slack", SlackChannel(slack, timeout=timeout), outbox(), **options("slack", "slack")
            )
        )
    if routing_key is not None:
        channel = PagerDutyChannel(routing_key, url=config.pagerduty_url, timeout=timeout)
        sinks.append(
            OutboxSink("pagerduty", channel, outbox(), **options("pagerduty", "pagerduty"))
        )
    sinks += [
        AlertmanagerSink(
            url,
            name=f"alertmanager-{i}",
            outbox=outbox(),
            timeout=timeout,
            resend_interval=config.alertmanager_resend_seconds,
            **options("alertmanager", f"alertmanager-{i}"),
        )
        for i, url in enumerate(config.alertmanager_urls)
    ]
    if config.grafana_url is not None:
        # Imported only when configured: grafana-client pulls in its HTTP stack.
        from gradwatch.collector.grafana import build_grafana_sinks

        sinks.extend(build_grafana_sinks(config))
    return sinks


class StoreErrorMetrics:
    """``gradwatch_store_errors_total{store}``: failed writes to the on-disk stores.

    ``outbox`` (alerts; they continue in memory), ``actions`` (checkpoints and
    restart budget) and ``trace`` (``--record``; recording switches off). Read
    from the stores at scrape time; each store logs its first failure once.
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        actions: Callable[[], Actions | None],
        recorder: TraceRecorder | None,
    ) -> None:
        self._sinks = sinks
        self._actions = actions  # a getter: the actions are built when the server starts
        self._recorder = recorder

    def collect(self) -> Iterable[Metric]:
        actions = self._actions()
        counts = {
            "outbox": sum(
                getattr(getattr(sink, "outbox", None), "errors", 0) for sink in self._sinks
            ),
            "actions": actions.store_errors if actions is not None else 0,
            "trace": self._recorder.errors if self._recorder is not None else 0,
        }
        family = CounterMetricFamily(
            "gradwatch_store_errors",
            "Failed writes to the collector's files (disk full, "
            "read-only); the log says what to fix.",
            labels=["store"],
        )
        for store, count in sorted(counts.items()):
            family.add_metric([store], count)
        return [family]
