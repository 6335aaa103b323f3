"""How much memory a piece of code allocates: CPU tensors via the torch profiler, CUDA via the
allocator's peak. Shared by agent_overhead.py and cuda_sync_check.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def cpu_allocated(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """Run ``fn``; return its result, the peak bytes of CPU tensors it had allocated at
    once, and those still allocated when it returned."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak, live


def cuda_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn``; return its result and the most CUDA memory allocated above what was
    allocated before it (``torch.cuda.max_memory_allocated``)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before
