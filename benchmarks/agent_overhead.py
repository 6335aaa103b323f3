"""Step-time overhead of the gradwatch agent on CPU: every step, not just the median.

Six variants of the same training step run interleaved round-robin in one
process, so drift in the machine (thermal, other load) hits them equally:

* ``baseline`` -- no monitoring;
* ``agent``    -- ``gradwatch.watch`` at default settings, shipping to a PULL
  socket on loopback that a receiver thread drains. A run's first ~235 steps
  carry dense cadence statistics (agent/cadence.py), so on a short run (the
  transformer's) this variant measures that start;
* ``agent_s50`` -- the same with ``early_stats=False``: statistics every 50
  steps, which is the default schedule after the dense start (the rest of a
  run);
* ``agent_clock`` -- ``agent_s50`` with ``phase_clock=True``: the two forward hooks
  timing each step's phases, on by default in a job of several ranks only (one
  process here, so this is what every rank of such a job adds);
* ``read``     -- the physical limit: one fused read of all gradients
  (``torch._foreach_norm`` + ``torch.stack``) before ``opt.step()``, nothing else;
* ``naive``    -- what people write by hand: every parameter's grad norm
  read with ``.item()`` every step.

Workloads: a small GPT-style transformer (4 layers, d_model 256, 4 heads,
seq 128, vocab 1000, batch 8, AdamW), the ~0.4M-parameter MLP 256-512-512-10
(batch 64, SGD) and the 6x256 MLP of issue 14 (batch 64, SGD). For each it
prints, per variant, the p50 / p99 / max / mean step time and the overhead
of p50, p99 and mean against the baseline's; then the agent's own
training-thread time (the optimizer pre-hook, ``log()`` and every forward hook it
leaves on the model, timed directly:
steadier than step times on a busy machine) as p50 / p99 / max / mean, and
its ratio to the fused read timed the same way in the same run, both in wall
time and in the training thread's own CPU time (``time.thread_time``: what
it executed, without the time the OS gave other processes); the agent's
CPU time per kind of step (plain, flush, cadence, a spread sample's later phase named
by the units it carries: h hooks, r ratio gathers, w weight slice, c host copies, s ship;
weight-norm slice); then
the agent's extra memory: what ``watch()`` keeps allocated plus the peak of
what its calls allocate over a run of cadence steps (torch profiler, CPU
tensors; ``torch.cuda.max_memory_allocated`` on CUDA, see
cuda_sync_check.py), and the process's resident memory (RSS) with and
without the agent, measured in a fresh process per workload.
Targets at default settings: p50, p99 and mean overhead <= 0.5% (transformer)
and <= 3% (MLP); agent / read <= 1.2.

    python benchmarks/agent_overhead.py            # several hundred steps each
    python benchmarks/agent_overhead.py --quick    # a minute or so
    python benchmarks/agent_overhead.py --only mlp6x256
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from overhead_workloads import (  # benchmarks/ is on sys.path when run as a script
    RSS_STEPS,
    WORKLOADS,
    Receiver,
    Workload,
    extra_memory,
    rss_probe,
)
from torch import nn

import gradwatch
from gradwatch.agent.hooks import Detached
from gradwatch.agent.monitor import Monitor
from gradwatch.agent.spreadplan import Part

VARIANTS = ("baseline", "agent", "agent_s50", "agent_clock", "read", "naive")
AGENTS = ("agent", "agent_s50", "agent_clock")  # the variants that watch
# The agent's timed windows on a plain step: the optimizer pre-hook and log(), and with
# the phase clock (agent_clock: what a job of several ranks runs) its two forward hooks.
WINDOWS = {"agent": 2, "agent_s50": 2, "agent_clock": 4}

# Time spent inside the agent's training-thread entry points (and in the bare
# read), per step, measured directly. It misses indirect costs (cache
# pollution, the shipper thread holding the GIL), which the step times include.
# Both in wall time and in the thread's CPU time ("agent_cpu", "read_cpu").
# "agent" sums every timed entry point of the variant running the step: the
# agent's, or the read variant's same entry points around its bare read.
_INSIDE: dict[str, float] = {"agent": 0.0, "read": 0.0, "agent_cpu": 0.0, "read_cpu": 0.0}


def _timed(method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _INSIDE["agent"] += time.perf_counter() - t0
            _INSIDE["agent_cpu"] += time.thread_time() - c0

    return timed


def _own_steps_timed(method: Callable[..., Any]) -> Callable[..., Any]:
    """The process-wide pre-hook, timed for its own monitor's optimizer only: this
    process holds two watched variants, and each one's hook also sees the other's
    (and the unwatched variants') steps. A job watches one model; that second
    monitor's identity test is this benchmark's, not the agent's."""
    timed = _timed(method)

    def hook(mon: Monitor, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if optimizer is not mon._optimizer:
            return method(mon, optimizer, args, kwargs)
        return timed(mon, optimizer, args, kwargs)

    return hook


# Every way the agent runs on the training thread: the process-wide optimizer
# pre-hook, log(), and every hook it leaves on the model (the phase clock's forward
# pre/post hooks on every step, the activation hooks of a cadence step's forward):
# all of those are Detached (agent/hooks.py). Timing wrappers, benchmark only.
Monitor._any_pre_hook = _own_steps_timed(Monitor._any_pre_hook)  # type: ignore[method-assign]
Monitor.log = _timed(Monitor.log)  # type: ignore[method-assign]
Detached.__call__ = _timed(Detached.__call__)  # type: ignore[method-assign]


class BareRead:
    """The read variant: the fused read alone, where and as the agent runs.

    Its optimizer pre-hook does one bare ``_foreach_norm`` + ``stack``, timed
    inline ("read"), and its ``log()`` does nothing, timed as the agent's is. The
    timers cost CPU time of their own inside each window they measure (two clock
    reads, one a system call, on a cold cache: several microseconds each): two or
    four windows a step for the agent (``WINDOWS``), one for the read. This
    variant's windows minus its read are one timer's cost, so the agent's windows
    net of ``WINDOWS - 1`` of them carry one timer, as the read does.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.row = torch.empty(len(self.params), dtype=torch.float32)
        opt.register_step_pre_hook(self._read)
        self.log = _timed(self._nothing)

    def _read(self, *args: Any) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        norms = torch._foreach_norm([p.grad for p in self.params], 2, dtype=torch.float32)
        torch.stack(norms, out=self.row)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        _INSIDE["read"] += wall
        _INSIDE["read_cpu"] += cpu
        _INSIDE["agent"] += wall  # one of this variant's four windows
        _INSIDE["agent_cpu"] += cpu

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None


def make_step(
    work: Workload, variant: str, endpoint: str, sync: Callable[[], None]
) -> tuple[Callable[[], str], Callable[[], None]]:
    model = copy.deepcopy(work.model)
    opt = work.make_opt(model)
    params = [p for p in model.parameters() if p.requires_grad]
    mon = (
        gradwatch.watch(
            model,
            opt,
            job=f"bench-{work.name}-{variant}",
            endpoint=endpoint,
            early_stats=variant == "agent",
            phase_clock=variant == "agent_clock",
        )
        if variant in AGENTS
        else None
    )
    sink: list[float] = []
    bare = BareRead(model, opt) if variant == "read" else None

    def step() -> str:
        """One training step; returns what kind of step it was for the agent."""
        x, y = work.batch()
        loss = work.loss(model(x), y)
        loss.backward()
        kind = variant
        if mon is not None:
            cadence = mon._stats_now or mon._cadence.forced
            # A later phase of a sample spread over several steps (agent/weightstats.py).
            phase = mon._stats_now and bool(mon._spread_phase)
            index = mon._spread_phase
            part = _units(mon._parts[index]) if phase and index is not None else ""
            slicing = mon._wstats is not None and mon._wstats.busy
        opt.step()
        if bare is not None:
            bare.log(loss=loss)
        if mon is not None:
            mon.log(loss=loss)
            flushed = not mon._buffer._steps  # a flush hands the open segment over
            kind = (
                f"phase {part}"
                if phase
                else "cadence"
                if cadence
                else "flush"
                if flushed
                else "slice"
                if slicing
                else "plain"
            )
        elif variant == "naive":
            sink[:] = [p.grad.norm().item() for p in params]
            sink.append(loss.item())
        opt.zero_grad(set_to_none=True)
        sync()
        return kind

    return step, (mon.close if mon is not None else lambda: None)


def _units(part: Part) -> str:
    """The units a later step of a spread sample carries (agent/spreadplan.py), as letters:
    h hooks, r update-ratio gathers, w weight-norm slices, c host copies, s the ship."""
    carried = (
        ("h", part.hooks),
        ("r", part.ratios),
        ("w", part.weights),
        ("c", part.copy),
        ("s", part.ship),
    )
    return "".join(letter for letter, on in carried if on) or "-"


def measure(
    work: Workload, steps: int, warmup: int, chunk: int, endpoint: str, sync: Callable[[], None]
) -> dict[str, Any]:
    runners = {v: make_step(work, v, endpoint, sync) for v in VARIANTS}
    for step, _ in runners.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    inside: dict[str, list[float]] = collections.defaultdict(list)
    # agent CPU time by (variant, kind of step)
    kinds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    while len(times["baseline"]) < steps:
        for variant, (step, _) in runners.items():  # round-robin, chunk steps each
            ts = times[variant]
            for _ in range(chunk):
                for key in _INSIDE:
                    _INSIDE[key] = 0.0
                t0 = time.perf_counter()
                kind = step()
                ts.append(time.perf_counter() - t0)
                if variant in AGENTS or variant == "read":
                    inside[variant].append(_INSIDE["agent"])
                    inside[variant + "_cpu"].append(_INSIDE["agent_cpu"])
                if variant == "read":
                    inside["bare"].append(_INSIDE["read"])
                    inside["bare_cpu"].append(_INSIDE["read_cpu"])
                if variant in AGENTS:
                    kinds[variant, kind].append(_INSIDE["agent_cpu"])
    for _, close in runners.values():
        close()
    return {"times": times, "inside": inside, "kinds": dict(kinds)}


def base_step_cpu(work: Workload, steps: int) -> float:
    """The unwatched step's median thread CPU time: the denominator of CPU-time shares."""
    model = copy.deepcopy(work.model)
    opt = work.make_opt(model)
    times = []
    for _ in range(steps):
        c0 = time.thread_time()
        x, y = work.batch()
        work.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.thread_time() - c0)
    return statistics.median(times)


def measure_rss(name: str) -> dict[str, int] | None:
    """Run :func:`rss_probe` in a child process (a fresh heap); None if it failed."""
    done = subprocess.run(
        [sys.executable, __file__, "--rss-probe", name],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode:
        print(f"  (RSS probe failed: {done.stderr.strip().splitlines()[-1:]})")
        return None
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _q(ts: list[float], q: int) -> float:
    return statistics.quantiles(ts, n=100, method="inclusive")[q - 1]


def report(
    name: str,
    result: dict[str, Any],
    memory: tuple[int, int, int] | None,
    n_params: int,
    rss: dict[str, int] | None = None,
) -> None:
    times, inside = result["times"], result["inside"]
    base = times["baseline"]
    b50, b99, bmean = statistics.median(base), _q(base, 99), statistics.mean(base)
    print(f"\n{name}: {len(base)} steps per variant, {n_params:,} parameters")
    print(
        f"  {'variant':<10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8}"
        f" {'p50 +%':>7} {'p99 +%':>7} {'mean +%':>7}"
    )
    for variant, ts in times.items():
        p50, p99, mean = statistics.median(ts), _q(ts, 99), statistics.mean(ts)
        print(
            f"  {variant:<10} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f} {max(ts) * 1e3:>8.3f}"
            f" {mean * 1e3:>8.3f} {(p50 / b50 - 1) * 100:>+7.2f} {(p99 / b99 - 1) * 100:>+7.2f}"
            f" {(mean / bmean - 1) * 100:>+7.2f}"
        )
    read, rcpu = inside["bare"], inside["bare_cpu"]
    base_cpu = b50 if not result.get("base_cpu") else result["base_cpu"]
    r50, r99, rmean = statistics.median(rcpu), _q(rcpu, 99), statistics.mean(rcpu)
    print(
        f"  one fused gradient read (_foreach_norm + stack), same run, thread CPU: p50 "
        f"{r50 * 1e6:.0f} us, p99 {r99 * 1e6:.0f} us, max {max(rcpu) * 1e6:.0f} us, mean "
        f"{rmean * 1e6:.0f} us = {r50 / base_cpu * 100:.2f}% of the baseline step's thread CPU"
        f" ({base_cpu * 1e3:.2f} ms); wall p50 {statistics.median(read) * 1e6:.0f} us"
    )
    # One timer's own CPU time, step by step: the read variant's two windows (the
    # optimizer pre-hook and log()) minus its read (BareRead).
    timers = [w - r for w, r in zip(inside["read_cpu"], rcpu, strict=True)]
    t1, t1mean = statistics.median(timers), statistics.mean(timers)
    print(
        f"  one timer's own cost (the read variant's windows minus its read): p50 "
        f"{t1 * 1e6:.1f} us, mean {t1mean * 1e6:.1f} us"
    )
    for variant in AGENTS:
        extra = WINDOWS[variant] - 1
        t50, tmean = extra * t1, extra * t1mean
        wall, cpu = inside[variant], inside[variant + "_cpu"]
        c50, c99, cmean = statistics.median(cpu), _q(cpu, 99), statistics.mean(cpu)
        print(
            f"  {variant}: inside the agent (pre-hook, log, forward hooks), thread CPU: p50 "
            f"{c50 * 1e6:.0f} us, p99 {c99 * 1e6:.0f} us, max {max(cpu) * 1e6:.0f} us, mean "
            f"{cmean * 1e6:.0f} us = {c50 / base_cpu * 100:.2f}% / {c99 / base_cpu * 100:.2f}% / "
            f"{cmean / base_cpu * 100:.2f}% (p50 / p99 / mean) of the baseline step; agent / "
            f"read p50 {c50 / r50:.2f}x, p99 {c99 / r99:.2f}x, mean {cmean / rmean:.2f}x; wall "
            f"p50 {statistics.median(wall) * 1e6:.0f} us, p99 {_q(wall, 99) * 1e6:.0f} us"
        )
        print(
            f"    {variant} net of {extra} timer(s) (as the read, one left): p50 "
            f"{(c50 - t50) * 1e6:.0f} us, p99 {(c99 - t50) * 1e6:.0f} us, mean "
            f"{(cmean - tmean) * 1e6:.0f} us; agent / read p50 {(c50 - t50) / r50:.2f}x, "
            f"p99 {(c99 - t50) / r99:.2f}x, mean {(cmean - tmean) / rmean:.2f}x"
        )
        by_kind = {k: ts for (v, k), ts in result.get("kinds", {}).items() if v == variant}
        parts = [
            f"{kind} {len(ts)}x p50 {statistics.median(ts) * 1e6:.0f} us"
            for kind, ts in sorted(by_kind.items(), key=lambda kv: -len(kv[1]))
        ]
        print(f"    {variant} CPU time by kind of step: " + ", ".join(parts))
    if rss is not None:
        print(
            f"  process RSS (fresh process, {RSS_STEPS[name]} steps each): "
            f"{rss['before'] / 1024:.1f} MiB "
            f"unwatched -> {rss['after'] / 1024:.1f} MiB watched (+{rss['after'] - rss['before']}"
            f" KiB); peak {rss['before_peak'] / 1024:.1f} -> {rss['after_peak'] / 1024:.1f} MiB "
            f"(+{rss['after_peak'] - rss['before_peak']} KiB)"
        )
    if memory is not None:
        kept, peak, budget = memory
        print(
            f"  extra memory: {kept / 1024:.0f} KiB kept by watch() + {peak / 1024:.1f} KiB "
            f"peak in its calls over 24 early steps = {(kept + peak) / (4 * n_params) * 100:.2f}%"
            f" of the fp32 parameters; budget {budget / 1024:.0f} KiB"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--only", choices=tuple(WORKLOADS), help="run one workload")
    ap.add_argument("--transformer-steps", type=int, default=300)
    ap.add_argument("--mlp-steps", type=int, default=2000)
    ap.add_argument(
        "--rss-probe",
        choices=tuple(WORKLOADS),
        help="only the RSS probe of one workload, in this process; prints JSON (KiB)",
    )
    ap.add_argument(
        "--no-activation-stats",
        action="store_true",
        help="with --rss-probe: watch(..., activation_stats=False), to compare",
    )
    args = ap.parse_args()
    if args.rss_probe:
        steps = RSS_STEPS[args.rss_probe]
        print(json.dumps(rss_probe(args.rss_probe, steps, not args.no_activation_stats)))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    receiver = Receiver()
    endpoint = f"tcp://127.0.0.1:{receiver.port}"
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU; agent ships to {endpoint}")
    mlp_steps = 300 if args.quick else args.mlp_steps
    plan = [
        ("transformer", 30 if args.quick else args.transformer_steps, 3 if args.quick else 10, 5),
        ("mlp", mlp_steps, 50, 50),
        ("mlp6x256", mlp_steps, 50, 50),
    ]
    try:
        for name, steps, warmup, chunk in plan:
            if args.only and name != args.only:
                continue
            work = WORKLOADS[name]("cpu")
            n_params = sum(p.numel() for p in work.model.parameters())
            result = measure(work, steps, warmup, chunk, endpoint, lambda: None)
            result["base_cpu"] = base_step_cpu(work, steps=min(steps, 100))
            report(name, result, extra_memory(work, endpoint), n_params, measure_rss(name))
    finally:
        receiver.close()
    print(f"\nreceiver got {receiver.messages} messages")


if __name__ == "__main__":
    main()
