"""Geometric-growth detector: the total grad norm grows by a steady factor per step.

Seed: "exploding gradients show norms growing geometrically, sometimes over
just a handful of steps, before hitting ``inf``". Geometric growth is a straight
line in log(norm) against the step, so the detector fits that line by least
squares over a window of recent finite steps and reports the per-step factor
``exp(slope)`` and how many steps remain, at that rate, until the norm
overflows the run's dtype.

Healthy runs also have stretches where the norm rises: the first steps out of
initialisation and LR warm-up. Those rises decelerate (the norm approaches a
plateau), while a diverging run keeps its rate or speeds up. So besides a good
fit, a large total rise and a high rate over the window, the newest half of the
window must still grow at the minimum rate.

Growth from a tiny norm is not an explosion: weights initialised too small
"wake up" and their gradients grow geometrically towards a normal level (nanoGPT
with its init scaled by 0.01: from 1e-4 to 0.05). So the norm must also be
large, in absolute terms (``min_norm``) and against the run's own earlier
typical level (``min_rise`` times the median of the ``history`` steps before
the fit window, where the run has such a history).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, dtype_name, is_amp_skip, validated_params
from gradwatch.rules.step import Step


def combined_norm(norms: np.ndarray) -> float:
    """The L2 norm of tensors whose own norms are ``norms``: the root of their squares' sum."""
    return math.sqrt(float(np.dot(norms, norms)))


def total_grad_norm(step: Step) -> float | None:
    """``step.grad_norm`` when reported, else the L2 norm of the layer norms, else None."""
    if step.grad_norm is not None:
        return step.grad_norm
    if step.layer_norms.size == 0:
        return None
    return combined_norm(np.asarray(step.layer_norms, dtype=np.float64))


class GradWake:
    """Whether a run's gradients woke up, as a too-small init's do: the median of the
    latest 20 grad norms reached ``wake`` times the median of the first 3, at some point
    within ``within`` steps of the first (waking gradients rise, then fall back as the
    loss falls: nanoGPT init x0.01 reached x13.7 by step 23, x1.8 by step 151; lr x100
    and healthy runs stay <= x1.07). A rise later in a run is no init's (an explosion
    mid-run is other rules'). Non-finite and zero norms are skipped.

    Example::

        wake = GradWake()
        wake.observe(step.step, total_grad_norm(step))
        wake.woken
    """

    def __init__(self, wake: float = 3.0, within: int = 200) -> None:
        self.wake, self.within = wake, within
        self.woken = False
        self._first: list[float] = []
        self._latest: deque[float] = deque(maxlen=20)
        self._from: int | None = None  # the step of the first norm

    @property
    def measured(self) -> bool:
        """Whether the first 3 norms are known (a run's stream may carry none)."""
        return len(self._first) == 3

    @property
    def first(self) -> float | None:
        """The median of the first 3 norms (of those seen so far); None before any."""
        return float(statistics.median(self._first)) if self._first else None

    @property
    def recent(self) -> float | None:
        """The median of the latest 20 norms; None before any."""
        return float(statistics.median(self._latest)) if self._latest else None

    def observe(self, step: int, norm: float | None) -> None:
        """Take one step's total grad norm into account."""
        if norm is None or not math.isfinite(norm) or norm <= 0.0:
            return
        if self._from is None:
            self._from = step
        if len(self._first) < 3:
            self._first.append(norm)
        self._latest.append(norm)
        if not self.woken and self.measured and len(self._latest) >= 10:
            if step - self._from <= self.within:
                # statistics.median: on 20 floats, every step of every rank, far cheaper.
                first = statistics.median(self._first)
                self.woken = statistics.median(self._latest) >= self.wake * first


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of ``y`` on ``x`` and its R² (0 when ``y`` is flat)."""
    # sum()/size rather than mean(): mean's bookkeeping dominates on 16 values.
    dx = x - x.sum() / x.size
    dy = y - y.sum() / y.size
    sxx = float(np.dot(dx, dx))
    syy = float(np.dot(dy, dy))
    if sxx == 0.0:
        return 0.0, 0.0
    slope = float(np.dot(dx, dy)) / sxx
    r2 = 0.0 if syy == 0.0 else min(1.0, slope * slope * sxx / syy)
    return slope, r2


class GeometricGrowthDetector:
    """Active while log(total grad norm) rises along a straight line at a high rate.

    Defaults (calibrated in ``tests/rules/test_rules_growth.py``; the seed gives
    the shape, not numbers): ``window=16`` steps so a divergence is caught within
    ~20 steps of its start; ``min_factor=1.1`` per step, over the window and over
    its newest half; ``min_r2=0.9`` so noisy plateaus (lognormal noise σ up to
    0.5) never fit a line that well; ``min_total_growth=10``: an order of
    magnitude across the window, so a slow drift is not an explosion.

    ``min_norm=1.0``: the norm clipping starts at in nanoGPT (``grad_clip``) and
    the Hugging Face Trainer (``max_grad_norm``), i.e. where practitioners call a
    total norm large; ``min_rise=10`` over the earlier typical level.

    Example::

        det = GeometricGrowthDetector(window=16)
        det.observe(step).evidence["steps_to_overflow"]
    """

    @validated_params
    def __init__(
        self,
        *,
        window: Annotated[int, Field(ge=6)] = 16,  # two halves of at least 3 steps to fit
        min_factor: Annotated[float, Field(gt=1.0)] = 1.1,
        min_r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9,
        min_total_growth: Annotated[float, Field(ge=1.0)] = 10.0,
        min_norm: Annotated[float, Field(ge=0.0)] = 1.0,
        min_rise: Annotated[float, Field(ge=1.0)] = 10.0,
        history: Annotated[int, Field(ge=1)] = 256,
    ) -> None:
        self.window = window
        self.min_factor = min_factor
        self.min_r2 = min_r2
        self.min_total_growth = min_total_growth
        self.min_norm, self.min_rise = min_norm, min_rise
        self._steps: deque[int] = deque(maxlen=window)
        self._logs: deque[float] = deque(maxlen=window)
        # Log norms from before the fit window: the run's earlier typical level.
        self._before: deque[float] = deque(maxlen=history)
        self._last_step: int | None = None

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None (no new verdict) when it carries no usable total norm."""
        norm = total_grad_norm(step)
        if is_amp_skip(step) or norm is None or not math.isfinite(norm) or norm <= 0.0:
            # No usable measurement is no evidence that growth stopped or started.
            return None
        if self._last_step is not None and step.step <= self._last_step:
            # Steps went back (a rollback): the old history no longer describes this run.
            self._steps.clear()
            self._logs.clear()
            self._before.clear()
        self._last_step = step.step
        if len(self._logs) == self.window:
            self._before.append(self._logs[0])
        self._steps.append(step.step)
        self._logs.append(math.log(norm))
        return self._judge(step, norm) if len(self._logs) == self.window else INACTIVE

    def typical_level(self) -> float | None:
        """The median total norm of the steps before the fit window; None before any."""
        if not self._before:
            return None
        return math.exp(float(np.median(np.fromiter(self._before, dtype=np.float64))))

    def _judge(self, step: Step, norm: float) -> Finding:
        x = np.fromiter(self._steps, dtype=np.float64, count=self.window)
        y = np.fromiter(self._logs, dtype=np.float64, count=self.window)
        slope, r2 = fit_line(x, y)
        half = self.window // 2
        recent_slope, _ = fit_line(x[-half:], y[-half:])
        min_slope = math.log(self.min_factor)
        total = math.exp(min(slope * (x[-1] - x[0]), 700.0))
        if (
            slope < min_slope
            or recent_slope < min_slope
            or r2 < self.min_r2
            or total < self.min_total_growth
        ):
            return INACTIVE
        typical = self.typical_level()
        if norm < self.min_norm or (typical is not None and norm < self.min_rise * typical):
            return INACTIVE  # growing from tiny, or back to the run's usual level: no explosion
        # Report the newest half's rate: the window may still hold steps from before
        # the growth began, and a divergence tends to speed up, not slow down.
        factor = math.exp(recent_slope)
        headroom = math.log(step.dtype_max) - math.log(norm)
        to_overflow = max(0, math.ceil(headroom / recent_slope))
        dtype = dtype_name(step.dtype_max)
        earlier = (
            ""
            if typical is None
            else f", ×{norm / typical:.3g} the run's earlier typical {typical:.3g}"
        )
        summary = (
            f"total grad norm growing ×{factor:.2f} per step (fit over {self.window} steps, "
            f"R² {r2:.2f}, now {norm:.3g}{earlier}); at this rate {dtype} overflows in "
            f"~{to_overflow} steps"
        )
        evidence = {
            "factor_per_step": factor,
            "window_factor_per_step": math.exp(slope),
            "window": self.window,
            "r2": r2,
            "grad_norm": norm,
            "total_growth": total,
            "steps_to_overflow": to_overflow,
            "dtype": dtype,
            "typical_grad_norm": typical,
        }
        return Finding(True, summary, evidence)
