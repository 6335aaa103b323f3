"""The harness every scenario runs in: :class:`Scenario`, :func:`run_scenario`, its score.

Each :class:`Scenario` trains a tiny model on CPU (seeded, seconds at most) with
the agent attached; the agent ships over ZeroMQ loopback to an in-process
collector ``Server`` (fresh ``CollectorRegistry``, default rules) whose only
sink captures alert transitions in memory. :func:`run_scenario` returns what
fired and scores it against the scenario's expectation: the expected category
fired or not, steps from the fault's onset to the alert's step, and "other
alerts" (for a fault: alerts of another category that began before the
expected one; for a healthy control: every alert, i.e. false alarms).

Kept apart from the scenario definitions so that they all import it and it imports none
of them. ``scenario_lib`` re-exports it; used by ``tests/scenarios/test_scenarios.py`` and
``benchmarks/fault_suite.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch import nn

import gradwatch
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.collector.sinks import SinkStats

DRAIN_TIMEOUT_S = 10.0
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


# --------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Fired:
    rule: str
    category: str
    step: int
    severity: str = "warning"


class CaptureSink:
    """A ``Sink`` that keeps every firing transition in memory."""

    name = "capture"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.alerts: list[Any] = []  # the firing Alert records, diagnosis included

    def start(self) -> None:
        pass

    def notify(self, transition: Any) -> None:
        if transition.current == "firing":
            a = transition.alert
            with self._lock:
                self.alerts.append(a)

    @property
    def fired(self) -> list[Fired]:
        with self._lock:
            return [
                Fired(a.rule, str(a.category), int(a.step), str(a.severity)) for a in self.alerts
            ]

    def close(self, timeout: float) -> None:
        pass

    def alive(self) -> bool:
        return False  # no thread of its own; stop() reads this as "closed"

    def stats(self) -> SinkStats:
        return SinkStats()


class Ctx:
    """What a scenario's ``run`` gets: ``watch`` bound to the collector, and a clock to move."""

    def __init__(self, server: Server, job: str, clock: _Clock) -> None:
        self.server = server
        self.job = job
        self._clock = clock
        self.monitors: list[Any] = []

    def watch(self, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> Any:
        kw.setdefault("flush_every", 10)
        kw.setdefault("stats_every", 10)
        mon = gradwatch.watch(model, opt, job=self.job, endpoint=self.server.bound_endpoint, **kw)
        self.monitors.append(mon)
        return mon

    def advance_clock(self, seconds: float) -> None:
        self._clock.offset += seconds

    def drain(self, mon: Any) -> None:
        """Wait until the collector has handled every step this monitor logged so far.

        Call it at a flush boundary (steps a multiple of ``flush_every``): rows still
        in the agent's device buffer are not shipped until the next flush.
        """
        _wait_drained(self.server, [mon])


class _Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def _sent(mon: Any) -> int:
    s = mon.stats
    return s.batches_sent + s.heartbeats_sent + s.events_sent + s.stats_sent


def _shipped(mon: Any) -> bool:
    """Every logged step has left the agent (sent or dropped): none waits in its queue."""
    s = mon.stats
    return s.steps_sent + s.steps_dropped >= s.steps_logged


def _wait_drained(server: Server, monitors: Sequence[Any]) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        # The shipper polls its queue (agent/workqueue.py): a batch logged just now may
        # not be sent yet, and counting only what was sent would return before it is.
        if not all(_shipped(m) for m in monitors):
            time.sleep(0.01)  # bounded poll of the agent's own counters, not a settle wait
            continue
        want = sum(_sent(m) for m in monitors)
        if server.wait_for_messages(want, timeout=0.2) and sum(_sent(m) for m in monitors) == want:
            return


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """``category`` None: a healthy control. ``also``: other categories that count as a catch.

    ``allow``: for a control, the highest severity it may raise (None: nothing at all;
    "info": a deliberate choice worth a note, e.g. a frozen backbone). ``needs``: a known
    gap (strict xfail). ``pending``: waits for a feature being built (non-strict xfail).
    ``slow``: too slow for CI; run by ``benchmarks/fault_suite.py`` only.
    """

    name: str
    category: str | None
    onset: int
    run: Callable[[Ctx], None]
    also: tuple[str, ...] = ()
    needs: str | None = None  # why the current system cannot catch it (xfail), if so
    requires: str | None = None  # a module the detection depends on (absent: xfail)
    allow: str | None = None
    pending: str | None = None
    slow: bool = False

    @property
    def accepted(self) -> tuple[str, ...]:
        return ((self.category,) if self.category else ()) + self.also


@dataclass
class Result:
    scenario: Scenario
    fired: list[Fired]
    seconds: float
    detected: bool = False
    latency: int | None = None
    other: list[Fired] = field(default_factory=list)
    alerts: list[Any] = field(default_factory=list)

    @property
    def false_alarm(self) -> bool:
        return self.scenario.category is None and bool(self.other)

    def to_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "name": s.name,
            "category": s.category,
            "onset": s.onset,
            "detected": self.detected,
            "latency": self.latency,
            "fired": [f.__dict__ for f in self.fired],
            "other": [f.__dict__ for f in self.other],
            "known_undetectable": s.needs,
            "pending": s.pending,
            "seconds": round(self.seconds, 2),
        }


def score(s: Scenario, fired: list[Fired], seconds: float) -> Result:
    r = Result(s, sorted(fired, key=lambda f: f.step), seconds)
    if s.category is None:
        allowed = SEVERITY_RANK[s.allow] if s.allow else -1
        r.other = [f for f in r.fired if SEVERITY_RANK.get(f.severity, 2) > allowed]
        return r
    hits = [f for f in r.fired if f.category in s.accepted]
    if hits:
        first = min(f.step for f in hits)
        r.detected = True
        r.latency = first - s.onset
        r.other = [f for f in r.fired if f.category not in s.accepted and f.step < first]
    else:
        r.other = [f for f in r.fired if f.category not in s.accepted]
    return r


def run_scenario(s: Scenario) -> Result:
    clock = _Clock()
    sink = CaptureSink()
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"),
        registry=CollectorRegistry(),
        clock=clock,
        sinks=[sink],
    )
    server.start()
    ctx = Ctx(server, s.name, clock)
    started = time.monotonic()
    threads = torch.get_num_threads()
    # One intra-op thread: tiny models gain nothing from more, and OpenMP workers spinning
    # beside the agent's and the collector's threads on a small, busy machine cost 10x.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        s.run(ctx)
        for mon in ctx.monitors:
            mon.close()
        _wait_drained(server, ctx.monitors)
    finally:
        for mon in ctx.monitors:
            mon.close()
        server.stop(timeout=5.0)
        torch.set_num_threads(threads)
    result = score(s, list(sink.fired), time.monotonic() - started)
    result.alerts = list(sink.alerts)
    return result
