"""On a CUDA device: prove the agent never synchronises, and measure its overhead.

Self-contained; run it once on a GPU machine:

    python benchmarks/cuda_sync_check.py             # checks, then timings
    python benchmarks/cuda_sync_check.py --quick     # fewer timed steps
    python benchmarks/cuda_sync_check.py --allow-cpu # dry run on CPU (AMP as bf16, no sync check)

Exits 0 with "no CUDA device, skipped" when there is no GPU.

**Sync check.** Each workload (MLP, small GPT, and a larger GPT; fp32 and
AMP fp16 with ``torch.amp.GradScaler``) runs monitored steps after a warm-up
(first steps allocate) under ``torch.cuda.set_sync_debug_mode("error")``:

* fp32: the *whole* training step runs in error mode, so any synchronising
  call made by the agent (or the loop) raises;
* AMP: ``GradScaler.step`` itself syncs by design (it reads ``found_inf``),
  so error mode is switched on only inside the agent's entry points (the
  optimizer pre-hook, ``log``, ``log_eval``, ``checkpoint_saved``, ``close``).

The agent never raises into training: a sync error inside it is caught and
switches it off, so PASS also requires ``mon.stats.disabled is None`` (the
reason is printed otherwise). The AMP run forces an overflow every 7th step
to exercise the skipped-step path. The checked window starts with
``mon.data_changed()``, so it holds the dense early cadence (a cadence step
on each of its first 8 steps: activation hooks, sampled update ratios, weight
norms read a slice per step) as well as plain and flush steps. A second window
per workload spreads samples over their phases (``SPARSE``) with the phase
clock on: the forward hooks every rank of a multi-rank job runs.

**Memory.** For each workload, ``torch.cuda.max_memory_allocated`` over 40
steps from a fresh ``watch()`` (dense cadence), agent minus baseline: the
agent's peak extra device memory, printed beside its budget
(gradwatch/agent/budget.py). ``--allow-cpu`` measures CPU tensors with the
torch profiler instead.

**Overhead.** Like ``agent_overhead.py``: baseline / agent / naive
(per-parameter ``.item()``) interleaved round-robin in one process, median
and p90 of wall time per step with a ``torch.cuda.synchronize()`` closing
each step, for each workload and precision.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from memory_probe import cpu_allocated, cuda_peak  # benchmarks/ is on sys.path
from tiny_gpt import TinyGPT
from torch import nn

import gradwatch
from gradwatch.agent.budget import memory_budget
from gradwatch.agent.monitor import Monitor

# agent: the default schedule (the dense start of a run, from its 21st step);
# agent_s50: the schedule of the rest of a run (early_stats=False, a sample every 50);
# agent_clock: agent_s50 with the phase clock, what every rank of a multi-rank job runs.
VARIANTS = ("baseline", "agent", "agent_s50", "agent_clock", "read", "naive")
# The sync check's second window: samples far enough apart to be spread over their
# phases (agent/weightstats.py), one step of a sample on most steps; with the phase
# clock's forward hooks (on by default only where several ranks run), so the two
# windows check both ways the initial weights are read (agent/recording.py).
SPARSE = {"stats_every": 10, "early_stats": False, "phase_clock": True}


# ---------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    model: nn.Module
    make_opt: Callable[[nn.Module], torch.optim.Optimizer]
    x: torch.Tensor
    y: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def gpt(device: str, name: str, d: int, heads: int, layers: int, seq: int, batch: int) -> Workload:
    model = TinyGPT(1000, d, heads, layers, seq).to(device)
    idx = torch.randint(0, 1000, (batch, seq + 1), device=device)
    return Workload(
        name,
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4),
        idx[:, :-1],
        idx[:, 1:],
        _lm_loss,
    )


def mlp(device: str) -> Workload:
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    ).to(device)
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    return Workload(
        "mlp",
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        x,
        y,
        lambda out, t: nn.functional.cross_entropy(out.float(), t),
    )


def workloads(device: str, quick: bool) -> list[Workload]:
    if device == "cpu":  # the dry run proves the script, not the numbers: a tiny GPT
        return [mlp(device), gpt(device, "gpt-tiny", 64, 2, 2, 32, 4)]
    out = [mlp(device), gpt(device, "gpt-small", 256, 4, 4, 128, 8)]
    if not quick:
        out.append(gpt(device, "gpt-medium", 768, 12, 12, 512, 8))
    return out


# ---------------------------------------------------------------- sync scoping

_SCOPED = threading.local()


def _error_mode_inside(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an agent entry point with sync debug mode "error" when scoping is on."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_SCOPED, "on", False) or not torch.cuda.is_available():
            return method(*args, **kwargs)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return wrapper


# Installed before any Monitor exists, so the registered pre-hook is wrapped too.
for _name in (
    "_any_pre_hook",
    "_pre_hook",
    "log",
    "log_eval",
    "checkpoint_saved",
    "data_changed",
    "close",
):
    if hasattr(Monitor, _name):  # _any_pre_hook: the process-wide optimizer hook
        setattr(Monitor, _name, _error_mode_inside(getattr(Monitor, _name)))


# ---------------------------------------------------------------- one step


class Runner:
    """One model copy, one variant, one precision; ``step()`` runs a training step."""

    def __init__(
        self,
        work: Workload,
        variant: str,
        amp: bool,
        endpoint: str,
        device: str,
        schedule: dict[str, Any] | None = None,
    ) -> None:
        self.model = copy.deepcopy(work.model)
        self.opt = work.make_opt(self.model)
        self.work, self.variant, self.amp, self.device = work, variant, amp, device
        self.scaler = torch.amp.GradScaler(device) if amp else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.mon = None
        if variant.startswith("agent"):
            if schedule is None:
                schedule = {
                    "early_stats": variant == "agent",
                    "phase_clock": variant == "agent_clock",
                }
            self.mon = gradwatch.watch(
                self.model,
                self.opt,
                job=f"sync-{work.name}",
                endpoint=endpoint,
                scaler=self.scaler,
                **schedule,
            )
        self.sink: list[float] = []
        self.row = torch.empty(len(self.params), dtype=torch.float32, device=device)
        self.count = 0

    def step(self, overflow: bool = False) -> None:
        # fp16 is what GradScaler is for; the CPU dry run uses bf16, which CPUs run fast.
        half = torch.float16 if self.device == "cuda" else torch.bfloat16
        autocast = torch.autocast(self.device, dtype=half) if self.amp else nullcontext()
        with autocast:
            loss = self.work.loss(self.model(self.work.x), self.work.y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            if overflow:
                # A device-side fill, no sync: the scaler will skip this step.
                self.params[0].grad.view(-1)[:1].fill_(float("inf"))
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            if self.variant == "read":  # the limit: one fused read of the gradients
                norms = torch._foreach_norm([p.grad for p in self.params], 2, dtype=torch.float32)
                torch.stack(norms, out=self.row)
            self.opt.step()
        if self.mon is not None:
            self.mon.log(loss=loss)
            if self.count % 50 == 49:
                self.mon.log_eval(loss=loss.detach())
        elif self.variant == "naive":
            self.sink[:] = [p.grad.norm().item() for p in self.params]
        self.opt.zero_grad(set_to_none=True)
        self.count += 1

    def close(self) -> None:
        if self.mon is not None:
            self.mon.close()


# ---------------------------------------------------------------- sync check


def loop_itself_syncs(work: Workload, amp: bool, endpoint: str, device: str) -> bool:
    """Whether the unmonitored loop already syncs (then only the agent is scoped)."""
    if amp or device != "cuda":
        return amp  # GradScaler.step reads found_inf on the host by design
    runner = Runner(work, "baseline", amp, endpoint, device)
    for _ in range(5):
        runner.step()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(5):
            runner.step()
        return False
    except RuntimeError as exc:
        print(f"  note: {work.name} syncs without the agent ({exc}); scoping to the agent")
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")


def sync_check(
    work: Workload, amp: bool, endpoint: str, device: str, steps: int, sparse: bool = False
) -> bool:
    """``sparse``: samples every 10 steps, each spread over its phases, with the phase
    clock; else the dense early cadence (a whole sample on each of the window's first 8
    steps), without it."""
    label = f"{work.name}/{'amp-fp16' if amp else 'fp32'}/{'spread+clock' if sparse else 'dense'}"
    scoped = loop_itself_syncs(work, amp, endpoint, device)
    runner = Runner(work, "agent", amp, endpoint, device, SPARSE if sparse else None)
    for i in range(20):  # warm-up: allocator, cuBLAS handles, pinned host buffers
        runner.step(overflow=amp and i == 10)
    if device == "cuda":
        torch.cuda.synchronize()
    # Sync debug mode cannot see a non_blocking copy into pageable memory
    # (the driver makes it synchronous), so check the host buffers directly.
    buffers = list(runner.mon._buffer.pool.queue)
    pinned = device != "cuda" or all(b.is_pinned() for b in buffers)
    error: BaseException | None = None
    scope = "agent entry points" if scoped else "whole step"
    try:
        if device == "cuda" and not scoped:
            torch.cuda.set_sync_debug_mode("error")
        _SCOPED.on = device == "cuda" and scoped
        if not sparse:
            runner.mon.data_changed("sync check")  # dense cadence again, inside the window
        for i in range(steps):
            runner.step(overflow=amp and i % 7 == 3)
        runner.mon.checkpoint_saved(runner.mon.step, "ckpt/check.pt")
        runner.close()
    except RuntimeError as exc:
        error = exc
    finally:
        _SCOPED.on = False
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    stats = runner.mon.stats
    ok = error is None and pinned and stats.disabled is None and stats.steps_logged == steps + 20
    wstats = runner.mon._wstats
    phases = wstats.phases if wstats is not None else 0
    print(
        f"  {'PASS' if ok else 'FAIL'}  {label:<30} error mode on: {scope}; {phases} phases; "
        f"{stats.steps_logged} steps logged, {stats.steps_sent} sent, "
        f"{stats.steps_dropped} dropped"
    )
    if error is not None:
        print(f"        raised: {error}")
    if not pinned:
        print("        host buffers are not pinned: the device-to-host copy would block")
    if stats.disabled is not None:
        print(f"        agent switched off: {stats.disabled}")
    return ok


# ---------------------------------------------------------------- overhead


def overhead(work: Workload, amp: bool, endpoint: str, device: str, steps: int) -> None:
    runners = {v: Runner(work, v, amp, endpoint, device) for v in VARIANTS}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for runner in runners.values():
        for _ in range(20):
            runner.step()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    while len(times["baseline"]) < steps:
        for variant, runner in runners.items():
            for _ in range(10):
                sync()
                t0 = time.perf_counter()
                runner.step()
                sync()
                times[variant].append(time.perf_counter() - t0)
    for runner in runners.values():
        runner.close()
    base = times["baseline"]
    b50, b99, bmean = statistics.median(base), _p99(base), statistics.mean(base)
    print(f"\n  {work.name} {'amp-fp16' if amp else 'fp32'}: {steps} steps per variant")
    print(
        f"    {'variant':<11} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8}"
        f" {'p50 +%':>7} {'p99 +%':>7} {'mean +%':>7}"
    )
    for variant, ts in times.items():
        p50, p99, mean = statistics.median(ts), _p99(ts), statistics.mean(ts)
        print(
            f"    {variant:<11} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f} {max(ts) * 1e3:>8.3f}"
            f" {mean * 1e3:>8.3f} {(p50 / b50 - 1) * 100:>+7.2f}"
            f" {(p99 / b99 - 1) * 100:>+7.2f} {(mean / bmean - 1) * 100:>+7.2f}"
        )


def _p99(ts: list[float]) -> float:
    return statistics.quantiles(ts, n=100, method="inclusive")[98]


# ---------------------------------------------------------------- memory


def memory(work: Workload, endpoint: str, device: str, steps: int = 40) -> None:
    """The agent's peak extra memory over its first ``steps`` steps, beside its budget."""
    peaks = {}
    for variant in ("baseline", "agent"):

        def run(variant: str = variant) -> Runner:
            runner = Runner(work, variant, False, endpoint, device)
            for _ in range(steps):
                runner.step()
            return runner

        if device == "cuda":
            runner, peaks[variant] = cuda_peak(run)
        else:
            runner, peaks[variant], _ = cpu_allocated(run)
        runner.close()
        if runner.mon is not None:
            n_layers = len(runner.mon._reader.names)
            acts = runner.mon._acts.columns if runner.mon._acts is not None else ()
            budget = memory_budget(n_layers, runner.mon.config, act_columns=len(acts))
    n_params = sum(p.numel() for p in work.model.parameters())
    extra = peaks["agent"] - peaks["baseline"]
    how = "max_memory_allocated" if device == "cuda" else "CPU tensors (profiler)"
    print(
        f"  {work.name:<12} {n_params:>12,} params: agent peak {peaks['agent'] / 2**20:9.1f} "
        f"MiB, baseline {peaks['baseline'] / 2**20:9.1f} MiB, extra "
        f"{extra / 2**20:7.2f} MiB ({how}); budget {budget.total / 2**20:.2f} MiB"
    )


# ---------------------------------------------------------------- main


def drain(stop: threading.Event, sock: zmq.Socket) -> None:
    while not stop.is_set():
        if sock.poll(100):
            sock.recv_multipart()


def main() -> int:
    ap = argparse.ArgumentParser(description="gradwatch agent: CUDA sync check and overhead")
    ap.add_argument("--quick", action="store_true", help="fewer steps, small workloads only")
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run on CPU without the sync check (to test this script)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    args = ap.parse_args()
    if torch.cuda.is_available():
        device = "cuda"
    elif args.allow_cpu:
        device = "cpu"
        print("no CUDA device: dry run on CPU, sync debug mode NOT checked")
    else:
        print("no CUDA device, skipped")
        return 0
    torch.manual_seed(0)
    steps = args.steps or (30 if args.quick else 200)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}")

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    stop = threading.Event()
    drainer = threading.Thread(target=drain, args=(stop, sock), daemon=True)
    drainer.start()
    ok = True
    try:
        works = workloads(device, args.quick)
        precisions = (False, True)
        print("\nsync check (torch.cuda.set_sync_debug_mode('error')):")
        for work in works:
            for amp in precisions:
                for sparse in (False, True):
                    ok &= sync_check(work, amp, endpoint, device, max(steps // 2, 30), sparse)
        print("\nmemory (fp32, the first steps from watch(): the dense early cadence):")
        for work in works:  # on CPU the profiler records every op: fewer steps
            memory(work, endpoint, device, steps=40 if device == "cuda" else 10)
        print("\noverhead (interleaved round-robin, wall time per step incl. sync):")
        for work in works:
            for amp in precisions:
                overhead(work, amp, endpoint, device, steps)
    finally:
        stop.set()
        drainer.join(2)
        sock.close(linger=0)
        ctx.term()
    print(f"\nsync check: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
