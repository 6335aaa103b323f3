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
# A schema naming this column is a cadence-statistics schema, not a step
# schema: its layer values are the parameters' L2 norms (weights, not
# gradients) and this cell itself holds MISSING. See docs/wire.md.
WEIGHT_NORMS: Final = "stats/weight_norm"
# The schema id agents give their cadence-statistics schema (step schemas
# count up from 0 and never reach it).
STATS_SCHEMA_ID: Final = 1 << 30


def lr(group: int) -> str:
    return f"{LR_PREFIX}{group}"


def scalar(name: str) -> str:
    return f"{SCALAR_PREFIX}{name}"
