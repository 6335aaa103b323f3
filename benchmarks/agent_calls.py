"""Where the agent's time goes: thread CPU per agent call inside a real training loop.

``agent_overhead.py`` times the agent as a whole; this script wraps each of its
internal calls (the optimizer pre-hook and its gradient read, ``log()`` and its
commit, the forward hooks, the update-ratio gathers and ratios, the weight-norm
slices, the host copies a spread sample ships) with ``time.thread_time_ns`` and prints, per
call, how often it ran and its median, largest and total CPU time. The calls
run where the loop puts them (after a backward pass, on a cold cache), which is
why they cost several times what they cost alone. Nested calls are counted in
their callers too (``ratios`` inside ``log``). Default settings, early
statistics on, so the first steps are cadence steps.

    python benchmarks/agent_calls.py --workload transformer --steps 40
    python benchmarks/agent_calls.py --workload mlp6x256 --steps 600
    python benchmarks/agent_calls.py --workload transformer --steps 40 --stats-every 10 --no-early
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from agent_overhead import WORKLOADS  # benchmarks/ is on sys.path when run as a script

import gradwatch
from gradwatch.agent import activations, hooks, recording, sampling, updateratios, weightstats
from gradwatch.agent.monitor import Monitor

_TIMES: dict[str, list[float]] = collections.defaultdict(list)

# (class, method): every call the training thread makes into the agent, by layer.
CALLS: list[tuple[type, str]] = [
    (Monitor, "_any_pre_hook"),
    (recording.StepRecorder, "_read_grads"),
    (Monitor, "log"),
    (recording.StepRecorder, "_commit"),
    (sampling.Sampler, "_cadence_work"),
    (sampling.Sampler, "_queue_stats"),
    (Monitor, "_forward_began"),
    (Monitor, "_forward_ended"),
    (hooks.Detached, "__call__"),
    (weightstats.WeightStats, "sample_before"),
    (weightstats.WeightStats, "after"),
    (weightstats.WeightStats, "begin"),
    (weightstats.WeightStats, "advance"),
    (updateratios.RatioSampler, "compute"),
    (updateratios.RatioSampler, "export"),
    (activations.ActHooks, "arm"),
    (activations.ActHooks, "stats"),
    (activations.ActHooks, "export"),
]


def _wrap(cls: type, name: str) -> None:
    method: Callable[..., Any] = getattr(cls, name)
    label = f"{cls.__name__}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return method(*args, **kwargs)
        finally:
            _TIMES[label].append((time.thread_time_ns() - t0) / 1e3)

    setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="transformer")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stats-every", type=int, default=50)
    ap.add_argument(
        "--no-early",
        action="store_true",
        help="early_stats=False: samples every --stats-every steps, spread over their phases",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for cls, name in CALLS:  # before watch(): hooks are bound at attach
        _wrap(cls, name)
    work = WORKLOADS[args.workload]("cpu")
    model, opt = work.model, work.make_opt(work.model)
    mon = gradwatch.watch(
        model,
        opt,
        job="calls",
        endpoint="tcp://127.0.0.1:1",
        stats_every=args.stats_every,
        early_stats=not args.no_early,
    )
    for _ in range(args.steps):
        x, y = work.batch()
        loss = work.loss(model(x), y)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad(set_to_none=True)
    mon.close()
    print(f"{args.workload}: {args.steps} steps, thread CPU per call (us)")
    print(f"  {'call':<32} {'calls':>6} {'p50':>8} {'max':>8} {'total':>10}")
    for label, ts in _TIMES.items():
        print(
            f"  {label:<32} {len(ts):>6} {statistics.median(ts):>8.0f} {max(ts):>8.0f}"
            f" {sum(ts):>10.0f}"
        )


if __name__ == "__main__":
    main()
