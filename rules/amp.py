"""Loss-scale collapse: the AMP loss scale keeps halving (an overflow storm).

A ``GradScaler`` halves its scale on every overflow (and skips that step) and
doubles it after ``growth_interval`` clean steps: a healthy run settles at a
scale and skips rarely -- a few steps at the start while it finds its level,
then one now and then. A collapse is either the scale falling to ``floor``
(default 1.0: gradients no longer scaled up at all; DeepSpeed's
``min_loss_scale`` default is also 1) or a storm of skipped steps: at least
``max_skip_fraction`` of the last ``window`` steps thrown away. The start-up
search (16 halvings from 2**16 at most with PyTorch's defaults) stays below
that share; the defaults are calibrated here on synthetic runs.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.step import Step


class LossScaleCollapseDetector:
    """Active while the loss scale is at or below ``floor`` or the skip share is too high.

    Steps that report no ``loss_scale`` (no AMP) are ignored.

    Example::

        det = LossScaleCollapseDetector(floor=1.0, window=200, max_skip_fraction=0.25)
        det.observe(step).evidence["halvings"]
    """

    @validated_params
    def __init__(
        self,
        *,
        floor: Annotated[float, Field(ge=0.0)] = 1.0,
        window: Annotated[int, Field(ge=10)] = 200,
        max_skip_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 0.25,
    ) -> None:
        self.floor, self.window, self.max_skip_fraction = floor, window, max_skip_fraction
        self._skips: deque[bool] = deque(maxlen=window)
        self._skipped = 0
        self._scale: float | None = None
        self._halvings = 0  # consecutive decreases since the last increase

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None (no new verdict) when it carries no loss scale."""
        scale = step.loss_scale
        if scale is None or not math.isfinite(scale):
            return None
        if self._scale is not None:
            if scale < self._scale:
                self._halvings += 1
            elif scale > self._scale:
                self._halvings = 0
        self._scale = scale
        if len(self._skips) == self.window:
            self._skipped -= self._skips[0]
        self._skips.append(step.skipped)
        self._skipped += step.skipped
        full = len(self._skips) == self.window
        share = self._skipped / len(self._skips)
        if scale > self.floor and not (full and share >= self.max_skip_fraction):
            return INACTIVE
        why = (
            f"loss scale {scale:g} at or below {self.floor:g}"
            if scale <= self.floor
            else f"{share:.0%} of the last {self.window} steps skipped on overflow"
        )
        summary = (
            f"AMP loss-scale collapse at step {step.step}: {why} "
            f"({self._halvings} consecutive decreases)"
        )
        evidence = {
            "loss_scale": scale,
            "halvings": self._halvings,
            "skipped_share": share,
            "skipped": self._skipped,
            "window": len(self._skips),
            "floor": self.floor,
        }
        return Finding(True, summary, evidence)
