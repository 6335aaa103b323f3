"""The agent's memory budget: what it may hold, as a function of the model's tensor count.

The budget does not grow with the number of parameter *elements*, only with the
number of trainable tensors (the layers): a 7B-parameter model of ~300 tensors
is budgeted like a small one with as many tensors. docs/agent-cost.md explains
each term; tests/agent/test_agent_memory.py checks that a watched model stays
within it (allocations measured with the torch profiler).

Example::

    >>> from gradwatch.agent.budget import memory_budget
    >>> from gradwatch.agent.config import AgentConfig
    >>> b = memory_budget(300, AgentConfig(job="doc", rank=0, world=1), elem_bytes=2)
    >>> b.samples, b.copies, b.total < 12 * 2**20
    (4915200, 4915200, True)
"""

from __future__ import annotations

from dataclasses import dataclass

from gradwatch.agent.activations import hook_transient_bytes
from gradwatch.agent.actsample import SAMPLE as ACT_SAMPLE
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.items import MAX_STATS_IN_FLIGHT
from gradwatch.agent.layout import DEFERRED_MAX_LAYERS, DEFERRED_NORM_BYTES
from gradwatch.agent.updateratios import SAMPLE
from gradwatch.agent.weightstats import MAX_PHASES

F32 = 4
# Allocator rounding, 0-d results of the fused norms, views: a fixed allowance.
SLACK = 64 * 1024


@dataclass(frozen=True, slots=True)
class Budget:
    """Bytes the agent may hold on the model's device and in (pinned) host memory."""

    step_buffer: int  # device: two halves of flush_every rows
    host_pool: int  # host (pinned under CUDA): pool_size flushed halves in flight
    samples: int  # device: update-ratio samples before and after the update
    stats: int  # device and host: cadence vectors in progress and queued
    # device, during a cadence step's forward only: one activation hook's temporaries
    # (one hook runs at a time and frees them when it returns); 0 without activations
    hooks: int = 0
    slack: int = SLACK
    act_rows: int = 0  # device: the hooks' sample rows (a row per hooked module)
    # host (pinned under CUDA): spread samples queued for the shipper, each with a copy
    # of the update-ratio samples and of the hooks' buffer (agent/hostpart.py)
    copies: int = 0
    # host, CPU models of up to DEFERRED_MAX_LAYERS tensors: gradient norms read but not
    # yet stacked into their rows, for every batch in flight (agent/layout.py: fill_norms)
    norms: int = 0

    @property
    def total(self) -> int:
        return (
            self.step_buffer
            + self.host_pool
            + self.samples
            + self.stats
            + self.hooks
            + self.slack
            + self.act_rows
            + self.copies
            + self.norms
        )


def memory_budget(
    n_layers: int,
    config: AgentConfig,
    elem_bytes: int = F32,
    act_columns: int = 0,
    sample: int = SAMPLE,
    act_row_width: int = 0,
    on_cpu: bool = False,
) -> Budget:
    """The budget for a model of ``n_layers`` trainable tensors of ``elem_bytes`` each element.

    ``act_columns``: activation-statistics columns (3 per hooked module at most);
    ``act_row_width``: the longest softmax row among the hooked modules (0: none);
    ``on_cpu``: the model is on a CPU, where small models' norms are stacked later.
    """
    width = n_layers + config.device_columns
    row_bytes = config.flush_every * width * F32
    # A cadence vector: activations, ratios, weight norms; plus a round's partial
    # norms (at most one slice per tensor and phase boundary).
    vector = (act_columns + 2 * n_layers + n_layers + MAX_PHASES) * F32
    queued = config.pool_size + config.max_pending_events
    samples = 2 * n_layers * sample * elem_bytes
    # A module has 2 columns at least: at most act_columns // 2 rows of ACT_SAMPLE.
    act_buffer = (act_columns + act_columns // 2 * (ACT_SAMPLE + 1)) * F32
    return Budget(
        step_buffer=2 * row_bytes,
        host_pool=(config.pool_size + 1) * row_bytes,
        samples=samples,
        stats=(queued + 3) * vector,
        hooks=hook_transient_bytes(act_row_width) if act_columns else 0,
        act_rows=act_buffer,
        copies=MAX_STATS_IN_FLIGHT * ((samples if config.update_ratios else 0) + act_buffer),
        norms=(config.pool_size + 1) * config.flush_every * n_layers * DEFERRED_NORM_BYTES
        if on_cpu and n_layers <= DEFERRED_MAX_LAYERS
        else 0,
    )
