"""Collector load benchmark: N ranks x L layers at a step rate, on loopback.

For each configuration of a small ladder it starts a REAL collector
subprocess (``python -m gradwatch collector`` on ``127.0.0.1``, random ports,
a loopback webhook receiver), then a few sender processes (``loadgen.py``)
that simulate the ranks of one job exactly as agents send them: one PUSH
socket per rank with the shipper's options, lockstep steps at the config's
rate (steps/s per rank), a batch of ``--flush-every`` rows per flush (the
agent's default 10), ``shards`` declared in every batch (``--shards``, default
the world: FSDP-style, the collector adds every rank's squares; 1: DDP), and
heartbeats every 2 s. The collector assembles each step across all ranks and
runs the rules once per assembled step. It measures:

* offered vs sustained ingest, in layer values per second. Offered is ranks x
  layers x rate; sustained is what the collector processed
  (``gradwatch_ingest_messages_total{kind="batch"}``) divided by the time from
  the start until it had processed it all (polled after the senders stop).
  ``lost`` = batches sent but never processed + batches the senders could not
  send (EAGAIN, the agent's drop) + rejected + lost-in-transit counters;
  ``gradwatch_job_step`` must reach the last step sent.
* assembly: ``gradwatch_assembly_steps_total`` (every step sent must be
  assembled once), ``..._incomplete_steps_total``, ``..._late_reports_total``
  and ``..._inexact_steps_total`` (all 0 in a healthy run), the most
  ``gradwatch_job_absent_ranks`` seen, and the largest
  ``gradwatch_job_ingest_lag_seconds`` seen (agent logging a rank's newest
  step -> collector handling it; a flush's last row, so pure queueing).
* alert latency, "from a NaN at the agent to the webhook": at ``--probes``
  spread-out steps (none in the first 20 s, so after warm-up), one rank's row
  of that step carries a NaN loss and NaN first layers, inside the job's
  normal batches. Latency = the webhook's arrival time of the ``numerical``
  alert of that job whose ``step`` is the probe step, minus the agent-side
  time of the step (the row's ``times`` entry). It includes the batching
  delay (a row waits up to one flush interval for its batch), hence the
  target of one flush interval + 1 s; the part after the batch was sent
  (send -> webhook) is shown too. Each probe is its own incident (a clean
  assembled step in between resolves it; the resolve must arrive too) on its
  own rank (the alert's ``rank`` must name it; distinct ranks also keep the
  routes' flapping guard, 3 firings per job, rule and rank in 10 min, out of
  the measurement). p99 of a handful of probes is their max.
* the collector's CPU (user+sys from /proc/PID/stat, as a share of one core
  over the run and drain) and RSS (/proc/PID/status VmRSS; peak = VmHWM),
  and how much RSS grew over the second half of the run: about 0 once the
  collector's memory no longer depends on run length. The ladder ends with a
  *fill* config, 64 x 1,000 at 50 steps/s for 60 s: 3,000 steps per rank,
  past the 2,048-step per-rank history that used to take 1.17 GiB.
* ``/metrics`` scrape time, median and max over scrapes every 2 s under load.

It "breaks" at the first configuration with any loss, an incomplete or late
assembly, a missing probe alert, p99 alert latency over (flush interval +
1 s), peak RSS over 1 GiB, or a median scrape over 100 ms.

    python benchmarks/collector_load.py                       # ladder, ~6-7 min
    python benchmarks/collector_load.py --quick               # ~1 min
    python benchmarks/collector_load.py --ranks 2048 --layers 1000
    python benchmarks/collector_load.py --ranks 64 --layers 1000 --step-rate 50 --shards 1
    python benchmarks/collector_load.py --layout pp=4,dp=512,tp=8 --layers 1000

``--layout`` (agent/topology.py) simulates a 3D job: ranks = the layout's
world, ``--layers`` per pipeline stage, ``shards`` = TP x FSDP shards, and only
one replica per model shard sends per-layer norms (the others send their loss
and a non-finite flag); offered and sustained values count layer values sent.

Everything binds 127.0.0.1 only; every process it starts is stopped at exit.
The senders share the machine with the collector: on a small machine (2
cores) they compete for CPU, which the table's ``sender lag`` column shows
(and the 1-minute load average printed per config).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_measure import (
    ASSEMBLY_DEADLINE_S,
    Monitor,
    Probe,
    TimedReceiver,
    cpu_seconds,
    mem_kib,
    of_job,
    places,
    probe_plan,
    scrape,
    start_collector,
    steps_sent,
    stop_process,
    total,
)
from load_report import Result, fmt_n, fmt_rate, fmt_s, print_table, rss_at
from loadgen import WARMUP_PER_RANK_S, WARMUP_TIMEOUT_S, sender_main  # benchmarks/ on sys.path

# (ranks, layers, steps/s per rank); the last one fills what used to be per-rank history.
DEFAULT_LADDER = (
    (8, 100, 1.0),
    (64, 1000, 1.0),
    (256, 1000, 1.0),
    (1024, 1000, 1.0),
    (64, 1000, 50.0),
)
QUICK_LADDER = ((8, 100, 1.0), (256, 1000, 1.0))
PROBE_WARMUP_S = 20.0  # no probe before this: schemas travel, every rank reports once
BATCHES = 'gradwatch_ingest_messages_total{kind="batch"}'


# ---------------------------------------------------------------- one configuration


def run_config(
    ranks: int,
    layers: int,
    rate: float,
    args: argparse.Namespace,
    receiver: TimedReceiver,
    tag: str,
) -> Result:
    shards = args.shards or ranks
    res = Result(
        ranks, layers, rate, shards, args.duration, args.flush_every, layout=args.layout or ""
    )
    res.load_avg = os.getloadavg()[0]
    flush_interval = res.flush_interval
    warmup_s = min(PROBE_WARMUP_S, args.duration / 3)
    plan = probe_plan(
        ranks,
        steps_sent(args.duration, rate, args.flush_every),
        rate,
        args.probes,
        warmup_s,
        args.flush_every,
    )
    res.probes_planned = len(plan)
    job = f"load-{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="gw-load-"))
    proc = None
    senders: list[mp.Process] = []
    cmds: list[Any] = []
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    monitor: Monitor | None = None
    try:
        proc, info, _ = start_collector(tmp, receiver.url, args.assembly_deadline)
        pid, url = proc.pid, info["metrics_url"]
        n_senders = max(1, min(args.senders, ranks))
        shares = [list(range(ranks))[i::n_senders] for i in range(n_senders)]
        for sid, share in enumerate(shares):
            cq = ctx.Queue()
            p = ctx.Process(
                target=sender_main,
                daemon=True,
                args=(
                    sid,
                    info["listen"],
                    job,
                    ranks,
                    shards,
                    share,
                    layers,
                    rate,
                    args.flush_every,
                    args.duration,
                    args.heartbeat_every,
                    plan,
                    cq,
                    results,
                    places(args.layout, share),
                    not args.no_probe_flag,
                ),
            )
            p.start()
            senders.append(p)
            cmds.append(cq)
        ready = 0
        while ready < n_senders:
            msg = results.get(timeout=30 + max(WARMUP_TIMEOUT_S, WARMUP_PER_RANK_S * ranks))
            if msg[0] == "error":
                raise RuntimeError(f"sender {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "ready":
                if msg[2] != len(shares[msg[1]]):
                    raise RuntimeError(
                        f"sender {msg[1]}: {msg[2]} of {len(shares[msg[1]])} sockets connected"
                    )
                ready += 1
        _, base = scrape(url)
        base_batches = total(base, BATCHES)
        res.rss_start_mib = mem_kib(pid)["VmRSS"] / 1024
        t0 = time.time() + 0.5
        cpu0 = cpu_seconds(pid)
        for cq in cmds:
            cq.put(("go", t0))
        monitor = Monitor(pid, url, job)
        monitor.start()

        probes: list[Probe] = []
        done: dict[int, dict[str, Any]] = {}
        while len(done) < n_senders:
            try:
                msg = results.get(timeout=1.0)
            except queue.Empty:
                if time.time() > t0 + args.duration + 120:
                    raise RuntimeError("senders did not finish") from None
                continue
            if msg[0] == "probe":
                if msg[5]:
                    probes.append(Probe(msg[1], msg[2], msg[3], msg[4]))
                else:
                    res.probes_missing += 1  # its batch could not even be sent
            elif msg[0] == "done":
                done[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise RuntimeError(f"sender {msg[1]} failed:\n{msg[2]}")
        t_end = time.time()

        # Drain: wait until every batch sent was processed.
        expected = sum(d["batches_sent"] for d in done.values())
        drain_limit = max(args.drain_timeout, flush_interval + 5)
        processed, last_change, last_value = 0.0, time.time(), -1.0
        samples: dict[str, float] = {}
        while True:
            _, samples = scrape(url)
            processed = total(samples, BATCHES) - base_batches
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
        res.last_step = max(d["last_step"] for d in done.values())

        # Probe alerts (and their resolves), and the last assembled steps, still on their way.
        wait_until = time.time() + args.assembly_deadline + 5
        while time.time() < wait_until:
            _, samples = scrape(url)
            if of_job(samples, "gradwatch_assembly_steps_total", job) >= res.last_step + 1 and all(
                receiver.arrival(job, "numerical", probe.step, state) is not None
                for probe in probes
                for state in ("firing", "resolved")
            ):
                break
            time.sleep(0.2)
        monitor.observe(samples)
        for probe in probes:
            arrived = receiver.arrival(job, "numerical", probe.step)
            if arrived is None:
                res.probes_missing += 1
                continue
            res.latencies.append(arrived[0] - probe.t_agent)
            res.send_latencies.append(arrived[0] - probe.t_send)
            if arrived[1] != probe.rank:
                res.wrong_rank.append(f"step {probe.step}: rank {arrived[1]}, NaN on {probe.rank}")
            if receiver.arrival(job, "numerical", probe.step, "resolved") is None:
                res.unresolved += 1
        fired = receiver.rules_fired(job)
        extra = fired.pop("NonFiniteGradients", 0) - len(res.latencies)
        if extra > 0:
            fired["NonFiniteGradients not at a probe"] = extra
        res.other_alerts = fired

        mem = mem_kib(pid)
        values_sent = sum(d["values_sent"] for d in done.values())
        values_processed = values_sent * min(1.0, processed / max(1, expected))
        reporters = (
            sum(r for _, r in places(args.layout, list(range(ranks))) or [])
            if args.layout
            else ranks
        )
        res.offered_vps = reporters * layers * rate
        res.sent_vps = values_sent / args.duration
        res.sustained_vps = max(0.0, values_processed) / max(1e-9, t_done - t0)
        res.bytes_per_step = sum(d["bytes_sent"] for d in done.values()) / max(
            1, sum(d["steps_sent"] for d in done.values())
        )
        res.lost_batches = max(0, int(expected - processed))
        res.eagain_batches = sum(d["batches_eagain"] for d in done.values())
        res.rejected = int(total(samples, "gradwatch_ingest_rejected_total"))
        res.transit_lost = int(total(samples, "gradwatch_ingest_lost_batches_total"))
        res.agent_dropped = int(total(samples, "gradwatch_agent_dropped_steps_total"))
        res.job_step = of_job(samples, "gradwatch_job_step", job)
        res.asm_steps = of_job(samples, "gradwatch_assembly_steps_total", job)
        res.asm_incomplete = of_job(samples, "gradwatch_assembly_incomplete_steps_total", job)
        res.asm_inexact = of_job(samples, "gradwatch_assembly_inexact_steps_total", job)
        res.asm_late = of_job(samples, "gradwatch_assembly_late_reports_total", job)
        res.max_absent = monitor.max_absent
        res.max_lag_s = max((lag for _, lag in monitor.lags), default=math.nan)
        res.max_lag_warm_s = max(
            (lag for t, lag in monitor.lags if t >= t0 + warmup_s), default=math.nan
        )
        res.drain_s = t_done - t_end if res.caught_up else math.inf
        res.cpu_s = cpu1 - cpu0
        res.cpu_pct = 100.0 * res.cpu_s / max(1e-9, t_done - t0)
        res.peak_rss_mib = max(mem["VmHWM"], monitor.peak_rss_kib) / 1024
        res.rss_growth_mib = (
            rss_at(monitor.rss_trace, t_end) - rss_at(monitor.rss_trace, t0 + args.duration / 2)
        ) / 1024
        if monitor.scrapes:
            res.scrape_med_ms = statistics.median(monitor.scrapes) * 1000
            res.scrape_max_ms = max(monitor.scrapes) * 1000
            worst = monitor.scrapes.index(max(monitor.scrapes))
            res.scrape_max_at_s = monitor.scrape_at[worst] - t0
        res.scrape_errors = monitor.scrape_errors
        res.rss_trace = [(t - t0, kib / 1024) for t, kib in monitor.rss_trace]
        res.sender_lag_s = max(d["max_flush_lag_s"] for d in done.values())
        res.burst_send_s = max(d["max_burst_send_s"] for d in done.values())
        # The senders push in parallel: a flush took as long as its slower sender.
        # (strict=False: a sender told to exit early may have pushed one flush fewer.)
        pushes = [d["burst_send_s"] for d in done.values()]
        res.push_s = [max(flush) for flush in zip(*pushes, strict=False)]
        res.priority = {
            k.split('"')[1]: int(v)
            for k, v in samples.items()
            if k.startswith("gradwatch_ingest_priority_total{")
        }
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 configs x 30 s (~1 min)")
    parser.add_argument("--ranks", type=int, help="one config: ranks (with --layers)")
    parser.add_argument("--layers", type=int, help="one config: layers per rank")
    parser.add_argument(
        "--step-rate",
        type=float,
        help="one config: steps/s per rank (default 1; the ladder sets its own)",
    )
    parser.add_argument(
        "--duration", type=float, help="seconds of load per config (default 60, --quick 30)"
    )
    parser.add_argument(
        "--flush-every",
        type=int,
        default=10,
        help="rows per batch, as AgentConfig.flush_every (default 10)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        help="shards declared in every batch: "
        "default the world (FSDP), 1 = DDP; must divide every config's ranks",
    )
    parser.add_argument("--senders", type=int, default=2, help="sender processes")
    parser.add_argument(
        "--layout",
        help="one 3D config, e.g. pp=4,dp=512,tp=8 (outermost "
        "first; --layers per stage; ranks and shards follow from it)",
    )
    parser.add_argument(
        "--assembly-deadline",
        type=float,
        default=ASSEMBLY_DEADLINE_S,
        help="the collector's assembly_deadline_seconds (default 5)",
    )
    parser.add_argument(
        "--heartbeat-every",
        type=float,
        default=2.0,
        help="seconds between a rank's heartbeats (AgentConfig default 2)",
    )
    parser.add_argument("--probes", type=int, help="NaN probes per config (default 8, quick 3)")
    parser.add_argument(
        "--no-probe-flag",
        action="store_true",
        help="send probes without the header's nonfinite hint (an agent before it): "
        "they page only from the assembled step",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to wait after the run for the collector to catch up",
    )
    parser.add_argument(
        "--rss-trace",
        action="store_true",
        help="also print the collector's RSS over time per config",
    )
    args = parser.parse_args(argv)
    if args.layout is not None:
        from gradwatch.agent.topology import parse_layout  # imports torch

        try:
            layout = parse_layout(args.layout)
        except ValueError as exc:
            parser.error(str(exc))
        if args.ranks is not None or args.layers is None:
            parser.error("--layout goes with --layers (per stage), not --ranks")
        args.ranks, args.shards = layout.world, layout.shards
    if (args.ranks is None) != (args.layers is None):
        parser.error("--ranks and --layers go together")
    if args.ranks is not None:
        ladder: tuple[tuple[int, int, float], ...] = (
            (args.ranks, args.layers, args.step_rate or 1.0),
        )
    elif args.step_rate is not None:
        parser.error("--step-rate goes with --ranks and --layers (the ladder sets its own)")
    else:
        ladder = QUICK_LADDER if args.quick else DEFAULT_LADDER
    args.duration = args.duration or (30.0 if args.quick else 60.0)
    args.probes = args.probes if args.probes is not None else (3 if args.quick else 8)
    for ranks, _, rate in ladder:
        if args.shards is not None and (args.shards < 1 or ranks % args.shards):
            parser.error(
                f"--shards {args.shards} does not divide {ranks} ranks; use 1 (DDP), "
                "the world (FSDP, the default) or a divisor"
            )
        if args.duration < args.flush_every / rate:
            parser.error(
                f"--duration must cover at least one flush "
                f"({args.flush_every / rate:g} s at {rate:g} steps/s)"
            )
        try:
            probe_plan(
                ranks,
                steps_sent(args.duration, rate, args.flush_every),
                rate,
                args.probes,
                min(PROBE_WARMUP_S, args.duration / 3),
                args.flush_every,
            )
        except ValueError as exc:
            parser.error(str(exc))

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    results = []
    started = time.monotonic()
    with TimedReceiver() as receiver:
        for ranks, layers, rate in ladder:
            tag = f"{ranks}x{layers}@{rate:g}"
            print(
                f"== {tag}: {ranks} ranks x {layers} layers at {rate:g} steps/s, "
                f"{args.duration:g} s ...",
                flush=True,
            )
            r = run_config(ranks, layers, rate, args, receiver, tag)
            results.append(r)
            print(
                f"   sustained {fmt_rate(r.sustained_vps)} v/s of {fmt_rate(r.offered_vps)} "
                f"offered, lost {r.lost}, assembled {fmt_n(r.asm_steps)}/{r.last_step + 1} "
                f"(incomplete {fmt_n(r.asm_incomplete)}, late {fmt_n(r.asm_late)}), alert "
                f"p50/p99 {fmt_s(r.pct(50))}/{fmt_s(r.pct(99))} s, cpu {r.cpu_pct:.0f}%, "
                f"RSS {r.peak_rss_mib:.0f} MiB, scrape med {r.scrape_med_ms:.1f} ms, senders' "
                f"push per flush median/max {fmt_s(r.push_pct(50))}/{fmt_s(r.push_pct(100))} s",
                flush=True,
            )
    print(f"\ncollector load benchmark, {time.monotonic() - started:.0f} s total\n")
    print_table(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
