"""A real in-process collector that records what it receives, and reads it back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.wire.trace import TraceEval, TraceEvent, TraceReader, TraceStep

DRAIN_TIMEOUT_S = 20.0


@dataclass
class Received:
    """What the collector recorded for one job."""

    layers: tuple[str, ...]
    steps: list[TraceStep]
    evals: list[TraceEval]
    events: list[TraceEvent]


class RecordingCollector:
    """A started ``Server`` recording to ``directory``; :meth:`received` stops it and reads."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.server = Server(
            CollectorConfig(
                listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", record_dir=directory
            ),
            registry=CollectorRegistry(),
        )
        self.server.start()
        self.endpoint = self.server.bound_endpoint

    def received(self, job: str, monitor: Any) -> Received:
        """Wait until every message ``monitor`` (closed) sent has arrived, then read the trace."""
        s = monitor.stats
        assert s.disabled is None, s.disabled
        assert s.steps_dropped == 0 and s.events_dropped == 0, s
        sent = s.batches_sent + s.heartbeats_sent + s.events_sent + s.stats_sent
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not self.server.wait_for_messages(sent, timeout=0.2):
            assert time.monotonic() < deadline, f"the collector got fewer than {sent} messages"
        assert self.server.stop(timeout=10.0)
        reader = TraceReader((self.directory / f"{job}.jsonl").read_text().splitlines())
        records = list(reader)
        return Received(
            layers=reader.header.layers,
            steps=[r for r in records if isinstance(r, TraceStep)],
            evals=[r for r in records if isinstance(r, TraceEval)],
            events=[r for r in records if isinstance(r, TraceEvent)],
        )
