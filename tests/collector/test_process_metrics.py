"""collector/process_metrics.py: process_* served from a background read, swapped in and out."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gradwatch.collector.process_metrics import ProcessMetrics, serve_off_thread


class Slow(Collector):
    """A collector whose reads block until released, counting them."""

    def __init__(self) -> None:
        self.reads = 0
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # a read is waiting at the closed gate

    def collect(self) -> Iterable[Metric]:
        if not self.gate.is_set():
            self.blocked.set()
        self.gate.wait(10)
        self.reads += 1
        yield GaugeMetricFamily("process_thing", "a test value", value=self.reads)


def value(families: Iterable[Metric]) -> float:
    return next(iter(families)).samples[0].value


def test_a_scrape_is_served_the_last_background_read_without_waiting_for_a_new_one() -> None:
    inner = Slow()
    metrics = ProcessMetrics(inner, refresh_seconds=0.01)
    try:
        first = value(metrics.collect())  # no reading yet: read inline
        assert first == 1
        assert metrics.read.wait(5)  # the thread started by that scrape read once more
        inner.gate.clear()  # from now on every read blocks
        assert inner.blocked.wait(5)  # the background read is stuck
        reads = inner.reads
        served = value(metrics.collect())  # answers from the last reading, reads nothing
        assert served >= 2 and inner.reads == reads
        metrics.read.clear()
        inner.gate.set()
        assert metrics.read.wait(5)
        assert value(metrics.collect()) > served  # and it moves on
    finally:
        inner.gate.set()
        metrics.close()


def test_the_default_process_collector_is_swapped_in_and_put_back() -> None:
    registry = CollectorRegistry()
    registry.register(prometheus_client.PROCESS_COLLECTOR)
    restore = serve_off_thread(registry)
    try:
        text = generate_latest(registry).decode()
        assert "process_cpu_seconds_total" in text  # the same families as before
        assert prometheus_client.PROCESS_COLLECTOR not in registry._collector_to_names
    finally:
        restore()
    assert prometheus_client.PROCESS_COLLECTOR in registry._collector_to_names
    assert "process_cpu_seconds_total" in generate_latest(registry).decode()


def test_a_registry_without_it_is_left_alone() -> None:
    registry = CollectorRegistry()
    serve_off_thread(registry)()
    assert not registry._collector_to_names
