"""Names of the per-step columns a batch may carry (see docs/wire.md).

Agents and the collector agree on these strings; anything else a loop logs
travels as ``s/<name>`` and becomes a signal rules can refer to by name.
"""

from __future__ import annotations

from typing import Final

LOSS: Final = "loss"
LOSS_SCALE: Final = "loss_scale"
# 1.0 when the optimizer step was skipped (AMP overflow), 0.0 when it ran.
SKIPPED: Final = "skipped"
LR_PREFIX: Final = "lr/"
SCALAR_PREFIX: Final = "s/"
# A scalar the loop logs under this name is the *pre-clip* total grad norm.
GRAD_NORM_SCALAR: Final = "grad_norm"
# 1.0 when any gradient on the sending rank is NaN/Inf, else 0.0: sent by
# data-parallel replicas that send no per-layer norms (a replica whose model
# shard already has a reporter), so a non-finite gradient is still seen.
GRAD_NONFINITE_SCALAR: Final = "grad_nonfinite"
# Host seconds of a step before its gradient sync, measured by the agent: from
# the previous log() to the first training forward (waiting for data), and in
# training forward passes (on CUDA: launch time, unless the queue is full). In a
# synchronous job every rank's step takes as long as the slowest, so these, not
# the step time, tell which rank the others wait for.
DATA_SECONDS_SCALAR: Final = "data_seconds"
FORWARD_SECONDS_SCALAR: Final = "forward_seconds"
# A schema naming this column is a cadence-statistics schema, not a step
# schema: its layer values are the parameters' L2 norms (weights, not
# gradients) and this cell itself holds MISSING. See docs/wire.md.
WEIGHT_NORMS: Final = "stats/weight_norm"
# The schema id agents give their cadence-statistics schema (step schemas
# count up from 0 and never reach it).
STATS_SCHEMA_ID: Final = 1 << 30
# Update ratios ||dw||/||w|| of a cadence step's update ride in the
# cadence-statistics schema as one named column per layer: this prefix + layer.
UPDATE_RATIO_PREFIX: Final = "stats/update_ratio/"
# Activation statistics ride in the cadence-statistics schema as named columns
# ``act/<module>/<kind>/<stat>`` (kind: relu, relu6, tanh, sigmoid, gelu, silu,
# softmax, other);
# split with ``rsplit("/", 2)`` since a module name may itself hold "/".
ACT_PREFIX: Final = "act/"
ACT_MEAN: Final = "mean"
ACT_STD: Final = "std"
ACT_ZERO_FRAC: Final = "zero_frac"
ACT_SAT_FRAC: Final = "sat_frac"


def lr(group: int) -> str:
    return f"{LR_PREFIX}{group}"


def scalar(name: str) -> str:
    return f"{SCALAR_PREFIX}{name}"


def act(module: str, kind: str, stat: str) -> str:
    return f"{ACT_PREFIX}{module}/{kind}/{stat}"


def update_ratio(layer: str) -> str:
    return f"{UPDATE_RATIO_PREFIX}{layer}"
