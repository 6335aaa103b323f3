"""Collector load benchmark: N ranks x L layers at a step rate, on loopback.

For each configuration of a small ladder it starts a REAL collector
subprocess (``python -m gradwatch collector`` on ``127.0.0.1``, random ports,
a loopback webhook receiver), then a few sender processes (``loadgen.py``)
that simulate the ranks of one job exactly as agents send them: one PUSH
socket per rank with the shipper's options, lockstep steps at ``--step-rate``
steps/s per rank, a batch of ``--flush-every`` rows per flush (the agent's
default 10), heartbeats every 2 s. It measures:

* offered vs sustained ingest, in layer values per second. Offered is what the
  senders sent over the run; sustained is what the collector processed
  (``gradwatch_ingest_messages_total{kind="batch"}``) divided by the time from
  the start until it had processed it all (polled after the senders stop).
  ``lost`` = batches sent but never processed + batches the senders could not
  send (EAGAIN, the agent's drop) + rejected + lost-in-transit counters;
  ``gradwatch_job_step`` must reach the last step sent.
* alert latency: at spread-out times a sender sends, on one of its rank
  sockets (so it queues behind that rank's traffic), a one-row batch of a fresh
  job (a fresh incident) with a NaN loss and NaN first layers; latency is from
  that send to the webhook receiving the ``numerical`` alert. p99 of a handful
  of probes is close to their max.
* the collector's CPU (user+sys from /proc/PID/stat, as a share of one core
  over the run and drain) and RSS (/proc/PID/status VmRSS; peak = VmHWM).
* ``/metrics`` scrape time, median and max over scrapes every 2 s under load.

It "breaks" at the first configuration with any loss, p99 alert latency over
(flush interval + 1 s), peak RSS over 1 GiB, or a median scrape over 100 ms.

    python benchmarks/collector_load.py                       # ladder, ~4-5 min
    python benchmarks/collector_load.py --quick               # ~1 min
    python benchmarks/collector_load.py --ranks 256 --layers 1000 --duration 30

Everything binds 127.0.0.1 only; every process it starts is stopped at exit.
The senders share the machine with the collector: on a small machine (2
cores) they compete for CPU, which the table's ``sender lag`` column shows.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import sender_main  # benchmarks/ is on sys.path when run as a script

from gradwatch.collector.receiver import WebhookReceiver

DEFAULT_LADDER = ((8, 100), (64, 1000), (256, 1000), (1024, 1000))
QUICK_LADDER = ((8, 100), (256, 1000))
READY_TIMEOUT_S = 30.0
GiB = 1 << 30
SCRAPE_EVERY_S = 2.0
SAMPLE_EVERY_S = 0.5
CLK_TCK = os.sysconf("SC_CLK_TCK")
HISTORY_STEPS = 2048  # CollectorConfig.history_steps default
BATCHES = 'gradwatch_ingest_messages_total{kind="batch"}'


# ---------------------------------------------------------------- webhook receiver


class TimedReceiver(WebhookReceiver):
    """The test receiver, plus the wall-clock arrival time of each firing alert per job."""

    def __init__(self) -> None:
        self.arrivals: dict[tuple[str, str], float] = {}
        super().__init__()

    def _record(self, path: str, headers: Any, raw: bytes) -> int:
        now = time.time()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("state") == "firing":
            key = (str(body.get("job")), str(body.get("category")))
            with self._cond:
                self.arrivals.setdefault(key, now)
        return super()._record(path, headers, raw)

    def arrival(self, job: str, category: str) -> float | None:
        with self._cond:
            return self.arrivals.get((job, category))


# ---------------------------------------------------------------- collector process


def start_collector(tmp: Path, webhook_url: str) -> tuple[subprocess.Popen[bytes], dict[str, Any], Path]:
    ready = tmp / "ready.json"
    log = tmp / "collector.log"
    cmd = [sys.executable, "-m", "gradwatch", "collector", "--listen", "tcp://127.0.0.1:*",
           "--metrics-addr", "127.0.0.1:0", "--webhook", webhook_url, "--ready-file", str(ready),
           "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("collector not ready in time")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    assert info["listen"].startswith("tcp://127.0.0.1:"), info
    return proc, info, log


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


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


class Monitor(threading.Thread):
    """Samples the collector's RSS every 0.5 s and times a /metrics scrape every 2 s."""

    def __init__(self, pid: int, url: str) -> None:
        super().__init__(name="load-monitor", daemon=True)
        self.pid, self.url = pid, url
        self.stop_event = threading.Event()
        self.scrapes: list[float] = []
        self.scrape_errors = 0
        self.peak_rss_kib = 0
        self.rss_trace: list[tuple[float, int]] = []  # (unix time, VmRSS KiB)
        self.growth: list[tuple[float, int]] = []     # (batches processed, VmRSS KiB) per scrape

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
                try:
                    took, samples = scrape(self.url)
                except OSError:
                    self.scrape_errors += 1
                    continue
                self.scrapes.append(took)
                self.growth.append((total(samples, BATCHES), mem_kib(self.pid).get("VmRSS", 0)))


# ---------------------------------------------------------------- one configuration


@dataclass
class Result:
    ranks: int
    layers: int
    offered_vps: float = 0.0        # nominal: ranks x layers x step rate
    sent_vps: float = 0.0           # what the senders actually sent, over the run
    sustained_vps: float = 0.0
    lost_batches: int = 0           # sent, never processed
    eagain_batches: int = 0
    rejected: int = 0
    transit_lost: int = 0
    agent_dropped: int = 0
    job_step: float = math.nan
    last_step: int = -1
    drain_s: float = math.nan       # after the last send, until all was processed
    caught_up: bool = False
    latencies: list[float] = field(default_factory=list)
    probes_missing: int = 0
    cpu_pct: float = 0.0
    cpu_s: float = 0.0
    peak_rss_mib: float = 0.0
    rss_start_mib: float = 0.0
    scrape_med_ms: float = math.nan
    scrape_max_ms: float = math.nan
    scrape_errors: int = 0
    sender_lag_s: float = 0.0
    burst_send_s: float = 0.0
    values_per_cpu_s: float = 0.0
    kib_per_step: float = math.nan  # RSS growth per rank-step processed
    log_lines: list[str] = field(default_factory=list)
    rss_trace: list[tuple[float, float]] = field(default_factory=list)  # (s since start, MiB)

    @property
    def lost(self) -> int:
        return self.lost_batches + self.eagain_batches + self.rejected + self.transit_lost

    def pct(self, q: float) -> float:
        if not self.latencies and not self.probes_missing:
            return math.nan
        values = sorted(self.latencies) + [math.inf] * self.probes_missing
        # nearest-rank percentile
        return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


def run_config(ranks: int, layers: int, args: argparse.Namespace, receiver: TimedReceiver,
               tag: str) -> Result:
    res = Result(ranks, layers)
    flush_interval = args.flush_every / args.step_rate
    job = f"load-{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="gw-load-"))
    proc = None
    senders: list[mp.Process] = []
    cmds: list[Any] = []
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    monitor: Monitor | None = None
    try:
        proc, info, _ = start_collector(tmp, receiver.url)
        pid, url = proc.pid, info["metrics_url"]
        n_senders = max(1, min(args.senders, ranks))
        shares = [list(range(ranks))[i::n_senders] for i in range(n_senders)]
        for sid, share in enumerate(shares):
            cq = ctx.Queue()
            p = ctx.Process(target=sender_main, daemon=True, args=(
                sid, info["listen"], job, ranks, share, layers, args.step_rate,
                args.flush_every, args.duration, 2.0, cq, results))
            p.start()
            senders.append(p)
            cmds.append(cq)
        ready = 0
        while ready < n_senders:
            msg = results.get(timeout=60)
            if msg[0] == "error":
                raise RuntimeError(f"sender {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "ready":
                if msg[2] != len(shares[msg[1]]):
                    raise RuntimeError(f"sender {msg[1]}: {msg[2]} of {len(shares[msg[1]])} "
                                       "sockets connected")
                ready += 1
        _, base = scrape(url)
        base_batches = total(base, 'gradwatch_ingest_messages_total{kind="batch"}')
        res.rss_start_mib = mem_kib(pid)["VmRSS"] / 1024
        t0 = time.time() + 0.5
        cpu0 = cpu_seconds(pid)
        for cq in cmds:
            cq.put(("go", t0))
        monitor = Monitor(pid, url)
        monitor.start()

        # Probes, spread over the run; each is a fresh job, i.e. a fresh incident.
        n_probes = args.probes
        span = args.duration - 2.0
        probe_at = [t0 + 1.0 + span * (i + 0.5) / n_probes for i in range(n_probes)]
        probe_jobs = [f"probe-{tag}-{i}" for i in range(n_probes)]
        sent_at: dict[str, float] = {}
        done: dict[int, dict[str, Any]] = {}

        def handle(msg: tuple[Any, ...]) -> None:
            if msg[0] == "probe":
                if msg[3]:
                    sent_at[msg[1]] = msg[2]
                else:
                    res.probes_missing += 1  # could not even be sent
            elif msg[0] == "done":
                done[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise RuntimeError(f"sender {msg[1]} failed:\n{msg[2]}")

        for i, (at, pjob) in enumerate(zip(probe_at, probe_jobs, strict=True)):
            while time.time() < at:
                try:
                    handle(results.get(timeout=max(0.001, min(0.1, at - time.time()))))
                except queue.Empty:
                    pass
            cmds[i % n_senders].put(("probe", pjob, (i * 7919) % len(shares[i % n_senders])))
        while len(done) < n_senders:
            try:
                handle(results.get(timeout=1.0))
            except queue.Empty:
                if time.time() > t0 + args.duration + 120:
                    raise RuntimeError("senders did not finish") from None
        t_end = time.time()

        # Drain: wait until every batch sent (load and probes) was processed.
        sent_batches = sum(d["batches_sent"] for d in done.values())
        expected = sent_batches + len(sent_at)
        drain_limit = max(args.drain_timeout, flush_interval + 5)
        processed, last_change, last_value = 0.0, time.time(), -1.0
        samples: dict[str, float] = {}
        while True:
            _, samples = scrape(url)
            processed = total(samples, 'gradwatch_ingest_messages_total{kind="batch"}') - base_batches
            now = time.time()
            if processed != last_value:
                last_value, last_change = processed, now
            if processed >= expected:
                res.caught_up = True
                break
            if now - t_end > drain_limit or now - last_change > 10:
                break
            time.sleep(0.25)
        t_done = last_change if not res.caught_up else time.time()
        cpu1 = cpu_seconds(pid)
        monitor.stop_event.set()
        monitor.join()
        # Probe alerts still on their way.
        wait_until = time.time() + flush_interval + 5
        while time.time() < wait_until and any(
                receiver.arrival(j, "numerical") is None for j in sent_at):
            time.sleep(0.1)
        for pjob, t_send in sent_at.items():
            arrived = receiver.arrival(pjob, "numerical")
            if arrived is None:
                res.probes_missing += 1
            else:
                res.latencies.append(arrived - t_send)

        mem = mem_kib(pid)
        values_processed = (processed - len(sent_at)) * args.flush_every * layers
        res.offered_vps = ranks * layers * args.step_rate
        res.sent_vps = sum(d["values_sent"] for d in done.values()) / args.duration
        res.sustained_vps = max(0.0, values_processed) / max(1e-9, t_done - t0)
        res.lost_batches = max(0, int(expected - processed))
        res.eagain_batches = sum(d["batches_eagain"] for d in done.values())
        res.rejected = int(total(samples, "gradwatch_ingest_rejected_total"))
        res.transit_lost = int(total(samples, "gradwatch_ingest_lost_batches_total"))
        res.agent_dropped = int(total(samples, "gradwatch_agent_dropped_steps_total"))
        res.job_step = samples.get(f'gradwatch_job_step{{job="{job}"}}', math.nan)
        res.last_step = max(d["last_step"] for d in done.values())
        res.drain_s = t_done - t_end if res.caught_up else math.inf
        res.cpu_s = cpu1 - cpu0
        res.cpu_pct = 100.0 * res.cpu_s / max(1e-9, t_done - t0)
        res.values_per_cpu_s = max(0.0, values_processed) / max(1e-9, res.cpu_s)
        res.peak_rss_mib = max(mem["VmHWM"], monitor.peak_rss_kib) / 1024
        if monitor.scrapes:
            res.scrape_med_ms = statistics.median(monitor.scrapes) * 1000
            res.scrape_max_ms = max(monitor.scrapes) * 1000
        res.scrape_errors = monitor.scrape_errors
        res.rss_trace = [(t - t0, kib / 1024) for t, kib in monitor.rss_trace]
        # RSS growth per rank-step, measured from the first scrape after the first flush
        # of every rank was processed (its one-off allocations excluded) to the end.
        first = next(((b, kib) for b, kib in monitor.growth
                      if b >= base_batches + ranks + len(sent_at)), None)
        if first is not None and processed + base_batches > first[0]:
            steps_between = (processed + base_batches - first[0]) * args.flush_every
            res.kib_per_step = (mem["VmRSS"] - first[1]) / steps_between
        res.sender_lag_s = max(d["max_flush_lag_s"] for d in done.values())
        res.burst_send_s = max(d["max_burst_send_s"] for d in done.values())
    finally:
        if monitor is not None:
            monitor.stop_event.set()
        for cq in cmds:
            try:
                cq.put(("exit",))
            except (OSError, ValueError):
                pass
        for p in senders:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        stop_process(proc)
        try:
            text = (tmp / "collector.log").read_text(errors="replace")
            res.log_lines = [line for line in text.splitlines() if line.strip()]
        except OSError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return res


# ---------------------------------------------------------------- report


def fmt_rate(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def fmt_s(v: float) -> str:
    return "miss" if math.isinf(v) else ("-" if math.isnan(v) else f"{v:.2f}")


def fmt_ms(v: float) -> str:
    return "miss" if math.isinf(v) else ("-" if math.isnan(v) else f"{v * 1000:.0f}")


def breaks(r: Result, flush_interval: float) -> list[str]:
    why = []
    if r.lost:
        why.append(f"loss ({r.lost_batches} unprocessed, {r.eagain_batches} EAGAIN, "
                   f"{r.rejected} rejected, {r.transit_lost} lost in transit)")
    if not r.pct(99) <= flush_interval + 1.0:
        why.append(f"alert p99 {fmt_s(r.pct(99))} s > flush interval + 1 = {flush_interval + 1:.0f} s")
    if r.peak_rss_mib * (1 << 20) > GiB:
        why.append(f"peak RSS {r.peak_rss_mib:.0f} MiB > 1 GiB")
    if r.scrape_med_ms > 100:
        why.append(f"median scrape {r.scrape_med_ms:.0f} ms > 100 ms")
    return why


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    flush_interval = args.flush_every / args.step_rate
    head = ("config", "offered v/s", "sent v/s", "sustained v/s", "lost", "drain s",
            "step", "alert p50 ms", "alert p99 ms", "n", "cpu %", "v/cpu-s", "RSS MiB", "KiB/step",
            "scrape med/max ms", "sender lag s")
    rows = []
    for r in results:
        rows.append((
            f"{r.ranks}x{r.layers}", fmt_rate(r.offered_vps), fmt_rate(r.sent_vps),
            fmt_rate(r.sustained_vps),
            f"{r.lost}" + (f" (+{r.eagain_batches} EAGAIN)" if r.eagain_batches else ""),
            fmt_s(r.drain_s), f"{r.job_step:.0f}/{r.last_step}", fmt_ms(r.pct(50)),
            fmt_ms(r.pct(99)), f"{len(r.latencies)}/{len(r.latencies) + r.probes_missing}",
            f"{r.cpu_pct:.0f}", fmt_rate(r.values_per_cpu_s),
            f"{r.rss_start_mib:.0f}->{r.peak_rss_mib:.0f}", f"{r.kib_per_step:.1f}",
            f"{r.scrape_med_ms:.1f}/{r.scrape_max_ms:.1f}", f"{r.sender_lag_s:.2f}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print(f"\n(values = per-layer gradient norms; {args.step_rate:g} step/s/rank, flush every "
          f"{args.flush_every} steps = {flush_interval:g} s; {args.duration:g} s per config; "
          f"{args.senders} sender processes on {os.cpu_count()} CPUs; cpu % of one core over "
          "run + drain; lost = unprocessed + EAGAIN + rejected + lost in transit; "
          "step = gradwatch_job_step / last step sent; alert latency = probe send -> webhook; "
          "p99 of n probes is nearly their max; RSS = start->peak (VmHWM); KiB/step = RSS "
          "growth per rank-step processed after the first flush)")
    broke = None
    for r in results:
        why = breaks(r, flush_interval)
        if why and broke is None:
            broke = (r, why)
    if broke is None:
        print("\nno configuration broke (loss, alert p99 > flush interval + 1 s, RSS > 1 GiB, "
              "median scrape > 100 ms)")
    else:
        r, why = broke
        print(f"\nBREAKS at {r.ranks}x{r.layers}: " + "; ".join(why))
    for r in results:
        over = [f"max scrape {r.scrape_max_ms:.0f} ms"] if r.scrape_max_ms > 100 else []
        if r.agent_dropped:
            over.append(f"collector counted {r.agent_dropped} agent-dropped steps")
        if r.kib_per_step > 0:
            steady = r.rss_start_mib + r.kib_per_step * r.ranks * HISTORY_STEPS / 1024
            over.append(f"RSS grew {r.kib_per_step:.1f} KiB per rank-step; if that held until "
                        f"the default history_steps={HISTORY_STEPS} per rank fills, about "
                        f"{steady / 1024:.1f} GiB (extrapolated from a short run, which "
                        "includes transient allocations; measure the plateau directly with "
                        "--step-rate 100 --rss-trace)")
        if r.scrape_errors:
            over.append(f"{r.scrape_errors} failed scrapes")
        warnings = [ln for ln in r.log_lines if "WARNING" in ln or "ERROR" in ln]
        if warnings:
            over.append(f"{len(warnings)} collector log warning/error lines, first: "
                        f"{warnings[0][:200]}")
        if over:
            print(f"  {r.ranks}x{r.layers}: " + "; ".join(over))
        if args.rss_trace and r.rss_trace:
            every = max(1, len(r.rss_trace) // 12)
            print(f"  {r.ranks}x{r.layers} RSS MiB over time: " + ", ".join(
                f"{t:.0f}s {m:.0f}" for t, m in r.rss_trace[::every]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 configs x 20 s (~1 min)")
    parser.add_argument("--ranks", type=int, help="one config: ranks (with --layers)")
    parser.add_argument("--layers", type=int, help="one config: layers per rank")
    parser.add_argument("--duration", type=float, help="seconds of load per config "
                        "(default 30, --quick 20)")
    parser.add_argument("--step-rate", type=float, default=1.0, help="steps/s per rank")
    parser.add_argument("--flush-every", type=int, default=10,
                        help="rows per batch, as AgentConfig.flush_every (default 10)")
    parser.add_argument("--senders", type=int, default=2, help="sender processes")
    parser.add_argument("--probes", type=int, help="NaN probes per config (default 8, quick 5)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to wait after the run for the collector to catch up")
    parser.add_argument("--rss-trace", action="store_true",
                        help="also print the collector's RSS over time per config")
    args = parser.parse_args(argv)
    if (args.ranks is None) != (args.layers is None):
        parser.error("--ranks and --layers go together")
    if args.ranks is not None:
        ladder: tuple[tuple[int, int], ...] = ((args.ranks, args.layers),)
    else:
        ladder = QUICK_LADDER if args.quick else DEFAULT_LADDER
    args.duration = args.duration or (20.0 if args.quick else 30.0)
    args.probes = args.probes or (5 if args.quick else 8)
    flush_interval = args.flush_every / args.step_rate
    if args.duration < flush_interval:
        parser.error(f"--duration must cover at least one flush ({flush_interval:g} s)")

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    results = []
    started = time.monotonic()
    with TimedReceiver() as receiver:
        for ranks, layers in ladder:
            tag = f"{ranks}x{layers}"
            print(f"== {tag}: {ranks} ranks x {layers} layers, {args.duration:g} s ...",
                  flush=True)
            r = run_config(ranks, layers, args, receiver, tag)
            results.append(r)
            print(f"   sustained {fmt_rate(r.sustained_vps)} v/s of {fmt_rate(r.offered_vps)} "
                  f"offered, lost {r.lost}, alert p50/p99 {fmt_ms(r.pct(50))}/{fmt_ms(r.pct(99))}"
                  f" ms, cpu {r.cpu_pct:.0f}%, RSS {r.peak_rss_mib:.0f} MiB, scrape med "
                  f"{r.scrape_med_ms:.1f} ms, burst send {r.burst_send_s:.2f} s", flush=True)
    print(f"\ncollector load benchmark, {time.monotonic() - started:.0f} s total\n")
    print_table(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
