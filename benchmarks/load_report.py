"""The collector load benchmark's results: one configuration's numbers, and the table.

Split from ``collector_load.py`` (which runs the configurations) so that each
reads on its own. ``breaks`` is the issue's target: no loss, complete
assembly, every probe alert, p99 alert latency under one flush interval plus
1 s, peak RSS under 1 GiB, median scrape under 100 ms.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

OLD_HISTORY_STEPS = 2048  # the per-rank history the collector used to keep
GiB = 1 << 30


@dataclass
class Result:
    ranks: int
    layers: int
    rate: float
    shards: int
    duration: float
    flush_every: int
    load_avg: float = math.nan  # 1-min load average before the collector started
    offered_vps: float = 0.0  # nominal: ranks x layers x step rate
    sent_vps: float = 0.0  # what the senders actually sent, over the run
    sustained_vps: float = 0.0
    lost_batches: int = 0  # sent, never processed
    eagain_batches: int = 0
    rejected: int = 0
    transit_lost: int = 0
    agent_dropped: int = 0
    job_step: float = math.nan
    last_step: int = -1
    drain_s: float = math.nan  # after the last send, until all was processed
    caught_up: bool = False
    asm_steps: float = math.nan
    asm_incomplete: float = math.nan
    asm_inexact: float = math.nan
    asm_late: float = math.nan
    max_absent: float = 0.0
    max_lag_s: float = math.nan
    max_lag_warm_s: float = math.nan  # after the probes' warm-up: without the schema flush
    latencies: list[float] = field(default_factory=list)  # agent -> webhook
    send_latencies: list[float] = field(default_factory=list)  # batch sent -> webhook
    probes_planned: int = 0
    probes_missing: int = 0
    wrong_rank: list[str] = field(default_factory=list)
    unresolved: int = 0
    other_alerts: dict[str, int] = field(default_factory=dict)
    cpu_pct: float = 0.0
    cpu_s: float = 0.0
    peak_rss_mib: float = 0.0
    rss_start_mib: float = 0.0
    rss_growth_mib: float = math.nan  # RSS at the end of the run minus at its middle
    scrape_med_ms: float = math.nan
    scrape_max_ms: float = math.nan
    scrape_max_at_s: float = math.nan  # when the slowest scrape began, seconds into the run
    scrape_errors: int = 0
    sender_lag_s: float = 0.0
    burst_send_s: float = 0.0
    push_s: list[float] = field(default_factory=list)  # per flush: the senders' push time
    priority: dict[str, int] = field(default_factory=dict)  # gradwatch_ingest_priority_total
    log_lines: list[str] = field(default_factory=list)
    rss_trace: list[tuple[float, float]] = field(default_factory=list)  # (s since start, MiB)
    layout: str = ""  # a 3D layout (pp=..,dp=..,tp=..); "" = every rank sends layers
    bytes_per_step: float = math.nan  # batch bytes sent per rank and step, all ranks averaged

    @property
    def name(self) -> str:
        shape = f"{self.layout}x{self.layers}" if self.layout else f"{self.ranks}x{self.layers}"
        return shape + (f"@{self.rate:g}" if self.rate != 1.0 else "")

    @property
    def flush_interval(self) -> float:
        return self.flush_every / self.rate

    @property
    def lost(self) -> int:
        return self.lost_batches + self.eagain_batches + self.rejected + self.transit_lost

    def push_pct(self, q: float) -> float:
        """The senders' push time per flush at percentile ``q`` (100: the slowest)."""
        if not self.push_s:
            return math.nan
        ordered = sorted(self.push_s)
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]  # nearest rank

    def pct(self, q: float, values: list[float] | None = None) -> float:
        values = self.latencies if values is None else values
        if not values and not self.probes_missing:
            return math.nan
        ordered = sorted(values) + [math.inf] * self.probes_missing
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]  # nearest rank


def rss_at(trace: list[tuple[float, int]], when: float) -> float:
    """VmRSS (KiB) of the last sample at or before ``when`` (the first if none)."""
    before = [kib for t, kib in trace if t <= when]
    return float(before[-1] if before else trace[0][1]) if trace else math.nan


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


def fmt_n(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}"


def breaks(r: Result) -> list[str]:
    why = []
    if r.lost:
        why.append(
            f"loss ({r.lost_batches} unprocessed, {r.eagain_batches} EAGAIN, "
            f"{r.rejected} rejected, {r.transit_lost} lost in transit)"
        )
    if not (r.asm_incomplete == 0 and r.asm_late == 0 and r.asm_steps >= r.last_step + 1):
        why.append(
            f"assembly ({fmt_n(r.asm_steps)} of {r.last_step + 1} steps assembled, "
            f"{fmt_n(r.asm_incomplete)} incomplete, {fmt_n(r.asm_late)} late reports)"
        )
    if r.probes_missing:
        why.append(f"{r.probes_missing} of {r.probes_planned} probe alerts missing")
    limit = r.flush_interval + 1.0
    if not r.pct(99) <= limit:
        why.append(f"alert p99 {fmt_s(r.pct(99))} s > flush interval + 1 = {limit:g} s")
    if r.peak_rss_mib * (1 << 20) > GiB:
        why.append(f"peak RSS {r.peak_rss_mib:.0f} MiB > 1 GiB")
    if r.scrape_med_ms > 100:
        why.append(f"median scrape {r.scrape_med_ms:.0f} ms > 100 ms")
    if r.scrape_max_ms > 1000:
        why.append(f"max scrape {r.scrape_max_ms:.0f} ms > 1 s (at +{r.scrape_max_at_s:.0f} s)")
    return why


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    head = (
        "config",
        "offered v/s",
        "sustained v/s",
        "lost",
        "drain s",
        "asm steps",
        "incompl/late",
        "lag max s (warm)",
        "alert p50/p99 s",
        "send->hook p50/p99 ms",
        "n",
        "cpu %",
        "RSS MiB",
        "2nd half MiB",
        "scrape med/max ms",
        "sender lag s",
        "push/flush med/max s",
    )
    rows = []
    for r in results:
        rows.append(
            (
                r.name,
                fmt_rate(r.offered_vps),
                fmt_rate(r.sustained_vps),
                f"{r.lost}" + (f" (+{r.eagain_batches} EAGAIN)" if r.eagain_batches else ""),
                fmt_s(r.drain_s),
                f"{fmt_n(r.asm_steps)}/{r.last_step + 1}",
                f"{fmt_n(r.asm_incomplete)}/{fmt_n(r.asm_late)}",
                f"{fmt_s(r.max_lag_s)} ({fmt_s(r.max_lag_warm_s)})",
                f"{fmt_s(r.pct(50))}/{fmt_s(r.pct(99))}",
                f"{fmt_ms(r.pct(50, r.send_latencies))}/{fmt_ms(r.pct(99, r.send_latencies))}",
                f"{len(r.latencies)}/{r.probes_planned}",
                f"{r.cpu_pct:.0f}",
                f"{r.rss_start_mib:.0f}->{r.peak_rss_mib:.0f}",
                f"{r.rss_growth_mib:+.1f}",
                f"{r.scrape_med_ms:.1f}/{r.scrape_max_ms:.1f}",
                f"{r.sender_lag_s:.2f}",
                f"{fmt_s(r.push_pct(50))}/{fmt_s(r.push_pct(100))}",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    shards = "shards = world (FSDP)" if args.shards is None else f"shards = {args.shards}"
    print(
        f"\n(values = per-layer gradient norms; config = ranks x layers[@steps/s, default 1]; "
        f"flush every {args.flush_every} steps; {shards}; {args.duration:g} s per config; "
        f"{args.senders} sender processes on {os.cpu_count()} CPUs; lost = unprocessed + "
        "EAGAIN + rejected + lost in transit; asm steps = steps assembled / steps sent; "
        "incompl/late = assembly incomplete steps / late reports; lag max = largest "
        "gradwatch_job_ingest_lag_seconds seen (warm: after the first 20 s, i.e. without "
        "the first flush, which carries every rank's schema); alert = NaN logged at the agent -> "
        "webhook, incl. batching (target p99 < flush interval + 1 s); send->hook = from "
        "the batch's send; p99 of n probes is their max; push/flush = the senders' time to "
        "push one flush of every rank's batch (a simulation cost: real ranks ship from "
        "their own hosts); cpu % of one core over run + "
        "drain; RSS = start->peak (VmHWM); 2nd half = RSS growth over the run's second "
        "half)"
    )
    broke = next(((r, why) for r in results if (why := breaks(r))), None)
    if broke is None:
        print(
            "\nno configuration broke (loss, incomplete/late assembly, missing alert, alert "
            "p99 > flush interval + 1 s, RSS > 1 GiB, median scrape > 100 ms)"
        )
    else:
        r, why = broke
        print(f"\nBREAKS at {r.name}: " + "; ".join(why))
    for r in results:
        notes = [
            f"load avg {r.load_avg:.2f} before the run",
            f"{r.bytes_per_step:.0f} batch bytes per rank and step",
        ]
        if r.last_step + 1 > OLD_HISTORY_STEPS:
            notes.append(
                f"{r.last_step + 1} steps per rank, past the {OLD_HISTORY_STEPS} of "
                "per-rank history the collector used to keep (1.17 GiB at 64x1000): "
                f"RSS {r.rss_start_mib:.0f}->{r.peak_rss_mib:.0f} MiB, "
                f"{r.rss_growth_mib:+.1f} MiB over the second half"
            )
        later = breaks(r)
        if later and broke is not None and r is not broke[0]:
            notes.append("also over: " + "; ".join(later))
        if r.scrape_max_ms > 100:
            notes.append(f"max scrape {r.scrape_max_ms:.0f} ms at +{r.scrape_max_at_s:.1f} s")
        if r.asm_inexact:
            notes.append(f"{fmt_n(r.asm_inexact)} inexact assembled steps")
        if r.max_absent:
            notes.append(f"up to {r.max_absent:.0f} ranks absent")
        if r.job_step != r.last_step:
            notes.append(f"gradwatch_job_step {fmt_n(r.job_step)}, last step sent {r.last_step}")
        if r.wrong_rank:
            notes.append(f"alert rank is not the NaN's rank: {', '.join(r.wrong_rank[:3])}")
        if r.unresolved:
            notes.append(f"{r.unresolved} probe incidents never resolved")
        if r.other_alerts:
            notes.append(
                "other alerts fired: "
                + ", ".join(f"{rule} x{n}" for rule, n in sorted(r.other_alerts.items()))
            )
        if r.agent_dropped:
            notes.append(f"collector counted {r.agent_dropped} agent-dropped steps")
        if r.priority:
            notes.append(
                "flagged batches: "
                + ", ".join(f"{k} {v}" for k, v in sorted(r.priority.items()) if v)
            )
        if r.scrape_errors:
            notes.append(f"{r.scrape_errors} failed scrapes")
        warnings = [ln for ln in r.log_lines if "WARNING" in ln or "ERROR" in ln]
        if warnings:
            notes.append(
                f"{len(warnings)} collector log warning/error lines, first: {warnings[0][:200]}"
            )
        print(f"  {r.name}: " + "; ".join(notes))
        if args.rss_trace and r.rss_trace:
            every = max(1, len(r.rss_trace) // 12)
            print(
                f"  {r.name} RSS MiB over time: "
                + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in r.rss_trace[::every])
            )
