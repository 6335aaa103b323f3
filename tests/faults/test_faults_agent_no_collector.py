"""A collector that is down, or frozen, for a whole run never slows the training loop.

``tests/agent/test_agent_robustness.py`` already checks Python-level memory and
the drop count with nothing listening; here the loop is timed step by step
(``mon.log`` never waits), the process RSS is bounded, ``mon.close()`` returns
within its timeout, and the same holds for the nastier case of a collector
that accepted the connection and then stopped reading: ZeroMQ's high-water
mark and the socket buffers fill, then the agent drops instead of queueing,
and once the peer reads again it gets exactly what the agent counted as sent.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import zmq

from gradwatch.wire import Batch, decode
from gradwatch.wire.columns import STATS_SCHEMA_ID
from tests.faults.support import Loop, free_port

STEPS = 1500
# "Never blocks": one mon.log is tens of microseconds; a generous bound for a loaded CI box.
MAX_LOG_S = 0.1
MAX_RSS_GROWTH = 16 * 2**20


def train(loop: Loop, steps: int) -> None:
    for _ in range(steps):
        loop.step()


def closing_time(loop: Loop) -> float:
    start = time.monotonic()
    loop.mon.close()
    return time.monotonic() - start


def test_no_collector_for_a_whole_run_costs_the_loop_nothing() -> None:
    loop = Loop("down", f"tcp://127.0.0.1:{free_port()}", flush_every=5, stats_every=0)
    try:
        train(loop, 200)  # one-time allocations (buffers, ZeroMQ) are made by now
        process = psutil.Process()
        rss = process.memory_info().rss
        loop.log_seconds.clear()
        train(loop, STEPS)
        growth = process.memory_info().rss - rss
        assert max(loop.log_seconds) < MAX_LOG_S
        assert growth < MAX_RSS_GROWTH, f"RSS grew {growth / 2**20:.1f} MiB"
        assert loop.mon._work.qsize() <= loop.mon._work.maxsize
        assert loop.mon._buffer.host_buffers_made == loop.mon.config.pool_size
        assert closing_time(loop) <= loop.mon.config.close_timeout + 0.5
    finally:
        loop.mon.close()
    stats = loop.mon.stats
    assert stats.steps_logged == 200 + STEPS
    assert (stats.steps_sent, stats.steps_dropped) == (0, stats.steps_logged)


def test_a_wedged_collector_fills_the_pipe_then_the_agent_drops_and_counts() -> None:
    """A peer that accepted the connection and reads nothing (an ingest thread stuck)."""
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.linger = 0
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    loop = Loop("wedged", f"tcp://127.0.0.1:{port}", flush_every=2, stats_every=0)
    try:
        # ZeroMQ's pipes and the kernel's socket buffers (about 1 MB here) take
        # thousands of steps before the first send would block and is dropped.
        loop.run_until(lambda: loop.mon.stats.steps_dropped >= 100, timeout=40, every=50)
        train(loop, 100)
        assert max(loop.log_seconds) < MAX_LOG_S
        stats = loop.mon.stats
        in_flight = stats.steps_logged - stats.steps_sent - stats.steps_dropped
        assert 0 <= in_flight <= 2 * (loop.mon.config.pool_size + 1)
        # Unwedged: everything the agent counted as sent arrives, nothing more.
        received = receive_steps(pull, stats.steps_sent)
        assert closing_time(loop) <= loop.mon.config.close_timeout + 0.5
        received += receive_steps(pull, loop.mon.stats.steps_sent - len(received))
    finally:
        loop.mon.close()
        pull.close(linger=0)
        ctx.term()
    stats = loop.mon.stats
    assert len(received) == stats.steps_sent == stats.steps_logged - stats.steps_dropped
    assert len(set(received)) == len(received)


def receive_steps(pull: zmq.Socket[Any], count: int, timeout_ms: int = 20_000) -> list[int]:
    """Read batches until ``count`` step rows came; their step numbers."""
    steps: list[int] = []
    while len(steps) < count:
        assert pull.poll(timeout_ms), f"{len(steps)} of {count} steps arrived"
        message = decode(pull.recv_multipart())
        if isinstance(message, Batch) and message.schema_id != STATS_SCHEMA_ID:
            steps.extend(message.steps)
    return steps
