"""Scrapes of large jobs are served a snapshot, so they never wait for the ingest thread.

From ``snapshot_ranks`` ranks on, ``GradwatchCollector.collect`` returns the
families a refresher thread rendered at most ``refresh_seconds`` (plus one
render) ago instead of rendering on the scrape's thread (issue 17: at 16,384
ranks a scrape rendered during a flush burst took 0.3-1.6 s). Smaller
collectors render on every scrape, exactly as before.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from gradwatch.collector.exposition import GradwatchCollector
from gradwatch.collector.ingest import Ingest
from gradwatch.collector.state import StateStore
from gradwatch.rules.step import Step

WAIT_S = 10.0


def _scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def _store(ranks: int, step: int) -> StateStore:
    store = StateStore(clock=lambda: 100.0)
    _report(store, ranks, step)
    return store


def _report(store: StateStore, ranks: int, step: int) -> None:
    for r in range(ranks):
        store.observe_step(Step(job="j", step=step, time=0.0, rank=r, loss=1.0, world=ranks))


def test_small_collectors_render_every_scrape() -> None:
    store = _store(ranks=3, step=1)
    collector = GradwatchCollector(store, Ingest().stats, snapshot_ranks=4)
    registry = CollectorRegistry()
    registry.register(collector)
    assert 'gradwatch_job_step{training_job="j"} 1.0' in _scrape(registry)
    _report(store, ranks=3, step=2)
    assert 'gradwatch_job_step{training_job="j"} 2.0' in _scrape(registry)
    assert not collector.rendered.is_set()  # no refresher for a small collector


def test_large_collectors_serve_a_snapshot_without_waiting_for_the_state() -> None:
    store = _store(ranks=4, step=1)
    collector = GradwatchCollector(store, Ingest().stats, snapshot_ranks=4, refresh_seconds=0.05)
    registry = CollectorRegistry()
    registry.register(collector)
    assert 'gradwatch_job_step{training_job="j"} 1.0' in _scrape(registry)  # rendered now
    # The next scrape starts the refresher; wait for one snapshot it rendered.
    _scrape(registry)
    assert collector.rendered.wait(WAIT_S)

    # The ingest thread busy with the state (its lock held): a scrape still answers.
    got: list[str] = []
    with store._lock:  # what observe_step holds while a burst runs
        scrape = threading.Thread(target=lambda: got.append(_scrape(registry)))
        scrape.start()
        scrape.join(WAIT_S)
        assert not scrape.is_alive(), "the scrape waited for the state's lock"
    assert 'gradwatch_job_step{training_job="j"} 1.0' in got[0]

    # A change shows once a render that began after it is done (the second from now).
    _report(store, ranks=4, step=2)
    for _ in range(2):
        collector.rendered.clear()
        assert collector.rendered.wait(WAIT_S)
    assert 'gradwatch_job_step{training_job="j"} 2.0' in _scrape(registry)

    # Stopping the collector stops the refresher at once; a later scrape renders itself.
    collector.close()
    assert collector._refresher is None or not collector._refresher.is_alive()
    _report(store, ranks=4, step=3)
    assert 'gradwatch_job_step{training_job="j"} 3.0' in _scrape(registry)
