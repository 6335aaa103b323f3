"""Non-finite detector: the loss, the total grad norm or a layer's grad norm is NaN/Inf.

Seed, Stage 2: a ``nan``/``inf`` loss is a numerical failure to report at once.
What the seed's worked example teaches is that the *first* layers to go bad
point at the cause (the crash showed in the loss, the trouble began in early
layers), so the detector remembers, per layer, the first step of the current
incident at which that layer went non-finite, and names the earliest ones.

AMP steps a GradScaler skipped on overflow are not findings: their gradients
are Inf by design and the scaler recovers; a storm of them is loss-scale
collapse, another rule's job.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.step import Step

_NEVER = -1  # first-bad step of a layer that has stayed finite this incident


class NonFiniteDetector:
    """Active while the loss, ``grad_norm`` or any entry of ``layer_norms`` is NaN/Inf.

    Example::

        det = NonFiniteDetector(max_named=10)
        det.observe(step).evidence["first_nonfinite"]  # ['0.weight', ...]
    """

    @validated_params
    def __init__(self, *, max_named: Annotated[int, Field(ge=1)] = 10) -> None:
        # max_named: 10 names fit one alert line and a Slack message; the rest
        # are counted in the evidence, not named.
        self.max_named = max_named
        self._layers: tuple[str, ...] = ()
        self._first_bad = np.full(0, _NEVER, dtype=np.int64)
        self._in_incident = False

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None (no new verdict) when it carries no loss and no grad norms."""
        if is_amp_skip(step):
            return INACTIVE
        if step.loss is None and step.grad_norm is None and step.layer_norms.size == 0:
            return None
        norms = np.asarray(step.layer_norms, dtype=np.float64)
        bad = ~np.isfinite(norms)
        loss_bad = step.loss is not None and not math.isfinite(step.loss)
        total_bad = step.grad_norm is not None and not math.isfinite(step.grad_norm)
        if not (loss_bad or total_bad or bad.any()):
            if self._in_incident:  # a clean step ends the incident
                self._first_bad.fill(_NEVER)
                self._in_incident = False
            return INACTIVE
        if step.layers != self._layers or self._first_bad.size != norms.size:
            self._layers = step.layers
            self._first_bad = np.full(norms.size, _NEVER, dtype=np.int64)
        self._in_incident = True
        newly = bad & (self._first_bad == _NEVER)
        self._first_bad[newly] = step.step
        return self._finding(step, int(bad.sum()), norms.size)

    def _first_names(self) -> tuple[list[str], int | None]:
        seen = np.flatnonzero(self._first_bad != _NEVER)
        if seen.size == 0:
            return [], None
        # Stable sort keeps model order among layers that went bad on the same step.
        order = seen[np.argsort(self._first_bad[seen], kind="stable")][: self.max_named]
        names = [self._layers[i] if i < len(self._layers) else f"#{i}" for i in order]
        return names, int(self._first_bad[order[0]])

    def _finding(self, step: Step, n_bad: int, n_layers: int) -> Finding:
        first, first_step = self._first_names()
        what = []
        if step.loss is not None and not math.isfinite(step.loss):
            what.append(f"loss is {step.loss}")
        if n_bad:
            where = f"; first: {', '.join(first[:3])}" if first else ""
            what.append(f"{n_bad} of {n_layers} layer grad norms non-finite{where}")
        elif step.grad_norm is not None and not math.isfinite(step.grad_norm):
            what.append(f"total grad norm is {step.grad_norm}")
        evidence = {
            "loss": step.loss,
            "grad_norm": step.grad_norm,
            "nonfinite_layers": n_bad,
            "layers": n_layers,
            "first_nonfinite": first,
            "first_nonfinite_step": first_step,
        }
        return Finding(True, f"non-finite values at step {step.step}: " + "; ".join(what), evidence)
