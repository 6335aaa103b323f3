"""One training step as the rules see it: host-side numbers, already decoded.

The collector builds these from wire batches; ``gradwatch replay`` builds them
from trace lines. ``None`` always means "not measured", never zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True, slots=True)
class Step:
    """Signals of one optimizer step of one job (one rank, or ranks combined).

    ``layer_norms`` are per-parameter gradient L2 norms in model order, float64,
    aligned with ``layers``; a non-finite entry means that layer's gradient held
    a NaN or Inf. ``grad_norm`` is the total norm *before* clipping when the loop
    reported it (``mon.log(grad_norm=clip_grad_norm_(...))``), else the norm of
    the gradients the optimizer saw.
    """

    job: str
    step: int
    time: float
    rank: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    layers: tuple[str, ...] = ()
    layer_norms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    lr: tuple[float, ...] = ()
    loss_scale: float | None = None
    skipped: bool = False
    scalars: Mapping[str, float] = field(default_factory=dict)
    # Largest finite value of the gradients' dtype: the growth detector projects
    # how many steps remain until the total norm overflows it.
    dtype_max: float = FLOAT32_MAX
