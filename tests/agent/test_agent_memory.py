"""The agent stays within its documented memory budget (agent/budget.py, docs/agent-cost.md).

Allocations are measured with the torch profiler (CPU tensors): what ``watch()``
leaves allocated, plus the peak of what the optimizer step and ``log()``
allocate on cadence steps (SGD without momentum allocates nothing itself), so
the model's own activations and gradients are not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import gradwatch
from gradwatch.agent.budget import memory_budget
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.layout import DEFERRED_MAX_LAYERS, DEFERRED_NORM_BYTES


def allocated(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """Run ``fn``; return its result, the peak bytes it had allocated, and those still live."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak, live


@pytest.mark.parametrize("spread", [False, True], ids=["dense start", "spread samples"])
def test_a_model_of_n_parameters_stays_within_the_budget_on_cadence_steps(spread: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))  # 8.4M parameters
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Dense start: a whole sample on each of steps 1-8, then every 2 steps. Spread: a
    # sample every 8 steps, measured over its 8 phases (agent/weightstats.py).
    schedule = {"stats_every": 8, "early_stats": False} if spread else {"stats_every": 2}
    mon, _, persistent = allocated(
        lambda: gradwatch.watch(model, opt, job="mem", endpoint="tcp://127.0.0.1:1", **schedule)
    )
    budget = memory_budget(len(list(model.parameters())), mon.config, on_cpu=True)
    assert budget.total < 0.05 * 4 * n_params  # the budget itself is a small share
    assert mon._wstats is not None and mon._wstats.phases == 8
    peak = 0
    for _ in range(16):
        model(torch.randn(16, 1024)).square().mean().backward()

        def step() -> None:
            opt.step()
            mon.log(loss=1.0)

        _, step_peak, _ = allocated(step)
        peak = max(peak, step_peak)
        opt.zero_grad(set_to_none=True)
    mon.close()
    # Dense: samples at steps 1-8, 10, 12, 14, 16; spread: at 8 (steps 8-15) and 16.
    assert mon.stats.disabled is None
    assert mon.stats.stats_sent + mon.stats.stats_dropped == (2 if spread else 12)
    assert persistent + peak <= budget.total, (persistent, peak, budget)


def test_a_7b_model_of_300_tensors_is_budgeted_a_few_megabytes() -> None:
    cfg = AgentConfig(job="mem", rank=0, world=1)
    # A full parameter copy of 7B bf16 parameters was 14 GB at every cadence step. Now:
    # the update-ratio samples (4.7 MiB on the device) and one host copy of them on its
    # way to the shipper (agent/hostpart.py), with the rest under a megabyte.
    budget = memory_budget(300, cfg, elem_bytes=2)
    assert budget.copies == budget.samples and budget.total < 12 * 2**20
    assert memory_budget(300, cfg).total > memory_budget(30, cfg).total


def test_cpu_norms_stacked_later_are_budgeted_and_only_for_small_models() -> None:
    # agent/layout.py: fill_norms. Up to DEFERRED_MAX_LAYERS tensors a CPU read keeps its
    # 0-d norms until the shipper stacks them; the budget counts every batch in flight.
    cfg = AgentConfig(job="mem", rank=0, world=1)
    small = memory_budget(12, cfg, on_cpu=True)
    assert small.norms == (cfg.pool_size + 1) * cfg.flush_every * 12 * DEFERRED_NORM_BYTES
    assert memory_budget(12, cfg).norms == 0  # CUDA: stacked on the device at once
    assert memory_budget(DEFERRED_MAX_LAYERS + 1, cfg, on_cpu=True).norms == 0
    for n_tensors, deferred in ((DEFERRED_MAX_LAYERS, True), (DEFERRED_MAX_LAYERS + 1, False)):
        model = nn.Sequential(*(nn.Linear(2, 2, bias=False) for _ in range(n_tensors)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mon = gradwatch.watch(model, opt, job="mem", endpoint="tcp://127.0.0.1:1")
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
        assert (mon._norms is not None) is deferred, n_tensors
        mon.log(loss=1.0)
        mon.close()
