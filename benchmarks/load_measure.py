"""What ``collector_load.py`` measures with: the collector and the alerts it sends.

The webhook receiver that times each alert's arrival, the collector subprocess
(started on loopback, stopped at exit), its CPU, RSS and ``/metrics`` sampled
while the senders run, the plan of NaN probes whose alerts give the latency,
and which ranks of a 3D layout send per-layer norms (what offered load counts).
Split from the script, which runs the configurations and prints.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradwatch import demo
from gradwatch.collector.exposition import JOB_LABEL
from gradwatch.collector.receiver import WebhookReceiver

READY_TIMEOUT_S = 30.0
SCRAPE_EVERY_S = 2.0
SAMPLE_EVERY_S = 0.5
CLK_TCK = os.sysconf("SC_CLK_TCK")
ASSEMBLY_DEADLINE_S = 5.0  # CollectorConfig.assembly_deadline_seconds default
FLAP_MAX = 3  # RoutePolicy.flap_max: firings per job, rule and rank before it holds back


# ---------------------------------------------------------------- webhook receiver


class TimedReceiver(WebhookReceiver):
    """The test receiver, plus arrival times of alerts keyed by (job, category, step, state).

    ``step`` in the payload is the step where the incident began, so a probe's
    alert is the one whose step is the probe step.
    """

    def __init__(self) -> None:
        self.arrivals: dict[tuple[str, str, int, str], tuple[float, Any]] = {}
        self.firing_rules: dict[str, dict[str, int]] = {}  # job -> rule -> firings
        super().__init__()

    def _record(self, path: str, headers: Any, raw: bytes) -> int:
        now = time.time()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("step"), int):
            key = (
                str(body.get("job")),
                str(body.get("category")),
                body["step"],
                str(body.get("state")),
            )
            with self._cond:
                if key not in self.arrivals:
                    self.arrivals[key] = (now, body.get("rank"))
                    if key[3] == "firing":
                        rules = self.firing_rules.setdefault(key[0], {})
                        rule = str(body.get("rule"))
                        rules[rule] = rules.get(rule, 0) + 1
        return super()._record(path, headers, raw)

    def arrival(
        self, job: str, category: str, step: int, state: str = "firing"
    ) -> tuple[float, Any] | None:
        """(arrival time, the alert's rank), or None if it has not arrived."""
        with self._cond:
            return self.arrivals.get((job, category, step, state))

    def rules_fired(self, job: str) -> dict[str, int]:
        with self._cond:
            return dict(self.firing_rules.get(job, {}))


# ---------------------------------------------------------------- collector process


def start_collector(
    tmp: Path, webhook_url: str, deadline: float = ASSEMBLY_DEADLINE_S
) -> tuple[subprocess.Popen[bytes], dict[str, Any], Path]:
    """The demo's collector (gradwatch/demo.py) with this run's webhook and assembly
    deadline; its log in ``tmp``."""
    log = tmp / "collector.log"
    settings = {"GRADWATCH_ASSEMBLY_DEADLINE_SECONDS": str(deadline)}
    proc, info = demo.start_collector(
        tmp, ["--webhook", webhook_url], log, READY_TIMEOUT_S, env=settings
    )
    return proc, info, log


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        demo.stop_collector(proc)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def mem_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0])
    return out


def scrape(url: str) -> tuple[float, dict[str, float]]:
    """(seconds the GET took, {sample name with labels: value})."""
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    took = time.perf_counter() - started
    samples = {}
    for line in text.splitlines():
        if line.startswith("gradwatch_") and " " in line:
            name, value = line.rsplit(" ", 1)
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return took, samples


def total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k == prefix or k.startswith(prefix + "{"))


def of_job(samples: dict[str, float], name: str, job: str) -> float:
    return samples.get(f'{name}{{{JOB_LABEL}="{job}"}}', math.nan)


class Monitor(threading.Thread):
    """Samples the collector's RSS every 0.5 s; every 2 s times a scrape and reads job gauges."""

    def __init__(self, pid: int, url: str, job: str) -> None:
        super().__init__(name="load-monitor", daemon=True)
        self.pid, self.url, self.job = pid, url, job
        self.stop_event = threading.Event()
        self.scrapes: list[float] = []
        self.scrape_at: list[float] = []  # unix time each scrape began
        self.scrape_errors = 0
        self.peak_rss_kib = 0
        self.rss_trace: list[tuple[float, int]] = []  # (unix time, VmRSS KiB)
        self.lags: list[tuple[float, float]] = []  # (unix time, gradwatch_job_ingest_lag_seconds)
        self.max_absent = 0.0  # gradwatch_job_absent_ranks

    def run(self) -> None:
        next_scrape = time.monotonic() + SCRAPE_EVERY_S / 2
        while not self.stop_event.wait(SAMPLE_EVERY_S):
            try:
                rss = mem_kib(self.pid).get("VmRSS", 0)
                self.peak_rss_kib = max(self.peak_rss_kib, rss)
                self.rss_trace.append((time.time(), rss))
            except OSError:
                return
            if time.monotonic() >= next_scrape:
                next_scrape = time.monotonic() + SCRAPE_EVERY_S
                began = time.time()
                try:
                    took, samples = scrape(self.url)
                except OSError:
                    self.scrape_errors += 1
                    continue
                self.scrapes.append(took)
                self.scrape_at.append(began)
                self.observe(samples)

    def observe(self, samples: dict[str, float]) -> None:
        lag = of_job(samples, "gradwatch_job_ingest_lag_seconds", self.job)
        if not math.isnan(lag):
            self.lags.append((time.time(), lag))
        absent = of_job(samples, "gradwatch_job_absent_ranks", self.job)
        if not math.isnan(absent):
            self.max_absent = max(self.max_absent, absent)


# ---------------------------------------------------------------- probes


def steps_sent(duration: float, rate: float, flush_every: int) -> int:
    """Steps each rank ships: flushes happen while their last step's time is within the run."""
    return int((duration * rate + 1) // flush_every) * flush_every


def probe_plan(
    ranks: int, steps: int, rate: float, n: int, warmup_s: float, flush_every: int
) -> list[tuple[int, int]]:
    """``n`` (step, rank) NaN probes, spread over the run after ``warmup_s``, on spread ranks.

    The first probe is a flush's first row, which waits longest for its batch
    (the worst case the target allows for); the others are evenly spaced, so
    they fall at varied positions within a flush. At least one clean step
    separates two probes, which ends the first incident. Ranks are distinct
    where there are enough, so the routes' flapping guard never holds an
    alert back.

    Example::

        probe_plan(ranks=1024, steps=60, rate=1.0, n=8, warmup_s=20.0, flush_every=10)
        # [(20, 64), (24, 192), (29, 320), (34, 448), (39, 576), (43, 704), ...]
    """
    if n <= 0:
        return []
    first = math.ceil(warmup_s * rate / flush_every) * flush_every
    last = steps - 2  # a clean step after the last probe resolves it within the run
    gap = (last - first) / n
    if gap < 2:
        raise ValueError(
            f"{n} probes do not fit in steps {first}..{last} with a clean step "
            "between them; lengthen --duration or lower --probes"
        )
    if n > FLAP_MAX * ranks:
        raise ValueError(
            f"{n} probes on {ranks} ranks would trip the flapping guard "
            f"({FLAP_MAX} firings per rank); lower --probes"
        )
    return [(first + int(gap * i), ((2 * i + 1) * ranks // (2 * n)) % ranks) for i in range(n)]


@dataclass(frozen=True, slots=True)
class Probe:
    step: int
    rank: int
    t_agent: float  # the row's times entry: when the simulated agent logged the step
    t_send: float  # when the batch carrying it was handed to the rank's socket


# ---------------------------------------------------------------- 3D layout


def places(layout: str | None, ranks: list[int]) -> list[tuple[int, bool]] | None:
    """Per rank: (pipeline stage, sends per-layer norms), as the agent decides it."""
    if layout is None:
        return None
    from gradwatch.agent.topology import parse_layout, reports_layers  # imports torch

    parsed = parse_layout(layout)
    return [(parsed.stage(r), reports_layers(parsed, r)) for r in ranks]
