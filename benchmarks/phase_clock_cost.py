"""What the phase clock costs a step: the agent with and without it, step by step.

The phase clock is two forward hooks on the model (agent/recording.py) timing each
step's wait for data and its forward pass, for the rules that compare ranks. Since
2026-12-07 ``watch()`` leaves it off in a single process (``phase_clock=None``: on
with several ranks or without an optimizer). ``agent_overhead.py`` times the agent's
own calls, so it misses most of a module hook's cost: a hook sends every call of the
model through the slow path of ``nn.Module.__call__`` (closures, the hook dicts
walked), on the cache the backward pass left. This script measures that directly.

Three copies of one model train side by side, one step each in turn (so drift in the
machine hits them alike): ``clock`` (``watch(..., phase_clock=True)``), ``no_clock``
(``phase_clock=False``, the one-process default) and ``bare`` (unwatched). Each step's
forward, backward, optimizer step and ``log()`` are timed in the training thread's CPU time;
it prints their medians and the clock's cost (``clock`` minus ``no_clock``) as a
share of the bare step.

    python benchmarks/phase_clock_cost.py                 # the 6x256 MLP of issue 14
    python benchmarks/phase_clock_cost.py --steps 4000 --width 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import gradwatch

PARTS = ("forward", "backward", "step", "log")
VARIANTS = ("clock", "no_clock", "bare")


def mlp(depth: int, width: int) -> nn.Sequential:
    """agent_overhead.py's mlp6x256 at the defaults; not imported from there, since
    importing that script wraps the agent's calls in its timers."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    runs = {}
    for name in VARIANTS:
        model = mlp(args.depth, args.width)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        # Nothing listens on the endpoint: the agent drops what it cannot send.
        mon = (
            gradwatch.watch(
                model,
                opt,
                job=f"clock-{name}",
                endpoint="tcp://127.0.0.1:1",
                early_stats=False,
                phase_clock=name == "clock",
            )
            if name != "bare"
            else None
        )
        runs[name] = (model, opt, mon, {part: [] for part in PARTS})
    tick = time.thread_time_ns
    for i in range(args.warmup + args.steps):
        for model, opt, mon, times in runs.values():
            t0 = tick()
            out = model(x)
            t1 = tick()
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            t2 = tick()
            opt.step()
            t3 = tick()
            if mon is not None:
                mon.log(loss=loss)
            t4 = tick()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                for part, ns in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    times[part].append(ns / 1e3)
    medians = {
        name: {part: statistics.median(ts) for part, ts in run[3].items()}
        for name, run in runs.items()
    }
    for _, _, mon, _ in runs.values():
        if mon is not None:
            mon.close()
    print(
        f"{args.depth}x{args.width} MLP, batch {args.batch}, one thread; {args.steps} steps "
        "each, in turn; thread CPU medians (us)"
    )
    print(f"  {'variant':<9}" + "".join(f"{part:>10}" for part in PARTS) + f"{'sum':>10}")
    for name, m in medians.items():
        print(
            f"  {name:<9}" + "".join(f"{m[p]:>10.1f}" for p in PARTS) + f"{sum(m.values()):>10.1f}"
        )
    cost = {p: medians["clock"][p] - medians["no_clock"][p] for p in PARTS}
    bare = sum(medians["bare"].values())
    print(
        "  the clock (clock - no_clock): "
        + ", ".join(f"{p} {cost[p]:+.1f}" for p in PARTS)
        + f"; {sum(cost.values()):+.1f} us a step = {sum(cost.values()) / bare * 100:+.2f}% of "
        f"the bare step ({bare:.0f} us)"
    )


if __name__ == "__main__":
    main()
