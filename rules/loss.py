"""Detectors on the shape of the training-loss curve (seed, Stage 2).

"Classify the pathology: nan/inf (numerical), spikes then recovery, a flat
line from step one (dead pipeline or vanishing gradients), or a curve that
decreases then rises (learning rate too high)." NaN is the non-finite rule's;
these are the other three shapes, and one invariant of a supervised loss:

* :class:`FlatFromStartDetector` -- the loss has made no progress since step one.
* loss jumps (spikes, level shifts, divergence) are :mod:`gradwatch.rules.spike`'s.
* :class:`RisingLossDetector` -- the loss trend turns up after decreasing.
* :class:`LossAboveStartDetector` -- the loss far above the run's first: worse than at its start.

Every comparison is between medians with a MAD noise scale (:mod:`series`),
so single noisy batches decide nothing.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.series import MAD_TO_SIGMA, flat_since_start, median_se, slope_t
from gradwatch.rules.step import Step


def total_grad_norm(step: Step) -> float | None:
    """The step's total gradient norm: the logged one, else the layers' combined.

    None when unmeasured or not finite.
    """
    norm = step.grad_norm
    if norm is None and step.layer_norms.size:
        norm = float(np.sqrt(np.sum(np.square(step.layer_norms))))
    if norm is None or not math.isfinite(norm):
        return None
    return norm


def finite_loss(step: Step) -> float | None:
    """The step's loss when it was measured, finite, and not an AMP-skipped step."""
    if step.loss is None or is_amp_skip(step) or not math.isfinite(step.loss):
        return None
    return step.loss


class FlatFromStartDetector:
    """Active while the loss has stayed where it started (seed Stage 2: dead pipeline).

    Compares the median of the first ``head`` losses with the median of the
    latest ``window`` ones (see :func:`series.flat_since_start`): flat when
    the progress (the fall) plus ``z`` standard errors is within ``tolerance``
    of the starting level -- one-sided, since a loss that makes no progress
    may wander up a little as well as down (up to 2x ``tolerance``) -- the
    very first losses were not higher (it learned early, then converged),
    no block of ``head`` losses on the way fell below the start either (it
    went down, then back up), and the latest window shows no steady descent (a
    slope ``z`` standard errors below zero: a fine-tune learning slowly moves
    its loss by a fraction of a percent per hundred steps). Only judges runs
    it saw from (near) step one
    (``max_first_step``): a collector restarted mid-run, or a resumed
    converged run, is not "from the start". While the learning rate is still
    rising across the window (warm-up) it does not judge.

    Example::

        det = FlatFromStartDetector(head=50, window=200, tolerance=0.02)
        det.observe(step).evidence["change"]
    """

    SUPERVISED_LOSS = True  # let go of at a loss below zero (rules/engine.py)

    @validated_params
    def __init__(
        self,
        *,
        head: Annotated[int, Field(ge=5)] = 50,
        window: Annotated[int, Field(ge=10)] = 200,
        tolerance: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.02,
        z: Annotated[float, Field(ge=0.0)] = 3.0,
        max_first_step: Annotated[int, Field(ge=0)] = 10,
        check_every: Annotated[int, Field(ge=1)] = 10,
    ) -> None:
        self.head, self.window, self.tolerance, self.z = head, window, tolerance, z
        self.max_first_step, self.check_every = max_first_step, check_every
        self._first_step: int | None = None
        self._head: list[float] = []
        self._tail: deque[float] = deque(maxlen=window)
        self._lrs: deque[float | None] = deque(maxlen=window)
        self._since_check = 0
        self._last: Finding = INACTIVE
        self._block: list[float] = []
        self._low = math.inf

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no loss (see the class docstring)."""
        if self._first_step is None:
            self._first_step = step.step
        loss = finite_loss(step)
        if loss is None or self._first_step > self.max_first_step:
            return None
        if len(self._head) < self.head:
            self._head.append(loss)
            return INACTIVE
        self._tail.append(loss)
        self._block.append(loss)
        if len(self._block) == self.head:  # the lowest level on the way: did it ever make progress?
            self._low = min(self._low, float(np.median(self._block)))
            self._block = []
        self._lrs.append(max(step.lr) if step.lr else None)
        self._since_check += 1
        if len(self._tail) < self.window or self._since_check < self.check_every:
            return self._last
        self._since_check = 0
        self._last = self._judge(step)
        return self._last

    def _judge(self, step: Step) -> Finding:
        lr_then, lr_now = self._lrs[0], self._lrs[-1]
        if lr_then is not None and lr_now is not None and lr_then < 0.99 * lr_now:
            return INACTIVE  # warm-up: the loss may not move until the rate has risen
        # One-sided: a dead pipeline makes no progress; its loss may wander up as well as down
        # (labels shuffled against the inputs: +-3% around chance). Up by more than twice the
        # tolerance is a rising loss, and a level that fell on the way made progress.
        verdict = flat_since_start(self._head[:5], self._head, self._tail, self.tolerance, self.z)
        noise = verdict.bound - abs(verdict.change)  # z standard errors, relative to the start
        wandered = (
            verdict.change + noise <= self.tolerance and -verdict.change <= 2.0 * self.tolerance
        )
        floor = abs(verdict.head) * (1.0 - self.tolerance - noise)
        progressed = (
            verdict.first > verdict.head * (1.0 + self.tolerance) + noise * abs(verdict.head)
            or min(self._low, verdict.tail) < floor
        )
        # Hysteresis: once flagged, the incident lasts until the loss has clearly moved on
        # (2x the tolerance below its start), so a run hovering at the bound is one incident.
        holding = self._last.active and verdict.change <= 2.0 * self.tolerance
        if not holding and (not wandered or progressed or self._trend() <= -self.z):
            return INACTIVE
        summary = (
            f"loss has not improved since step one: median {verdict.tail:.4g} over the last "
            f"{self.window} steps vs {verdict.head:.4g} over the first {self.head} "
            f"(change {-verdict.change:+.2%}; progress under {self.tolerance:.0%}); dead pipeline?"
        )
        evidence = {
            "first_loss": verdict.first,
            "start_level": verdict.head,
            "level": verdict.tail,
            "change": verdict.change,
            "bound": verdict.bound,
            "tolerance": self.tolerance,
            "lr": lr_now,
            "steps": step.step - (self._first_step or 0) + 1,
        }
        return Finding(True, summary, evidence)

    def _trend(self) -> float:
        """t statistic of the slope across the latest window: a slow, steady descent is learning."""
        return slope_t(self._tail)


class SortedWindow:
    """The last ``size`` values, kept sorted too: the median is a lookup, an update a memmove."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float) -> None:
        if len(self._order) == self._order.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._order[0])]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()

    def median(self) -> float:
        n = len(self._sorted)
        mid = n // 2
        return self._sorted[mid] if n % 2 else 0.5 * (self._sorted[mid - 1] + self._sorted[mid])

    def values(self) -> np.ndarray:
        """The values in ascending order."""
        return np.asarray(self._sorted, dtype=np.float64)


class RisingLossDetector:
    """Active while the loss trend has turned up after decreasing (seed Stage 2: LR too high).

    Losses are summarised per block of ``block`` steps by their median and
    the standard error of that median. Active when each of the last
    ``sustain`` blocks sits above the lowest block so far by at least ``rise``
    (relative), by ``z`` standard errors of the difference, *and* by ``undo``
    of the drop from the first block to the lowest (the rise takes back a
    real share of the run's progress: near a converged loss of 3e-4, a move
    to 5e-4 is +66% yet nothing; and a loss that fell to exactly 0 has no
    relative rise at all), and the lowest block came after the first one
    fell by ``drop`` -- the curve went down first, then up -- and the newest
    block is not ``z`` standard errors below the oldest of the sustained ones:
    a loss falling again is learning (after a jump to a new data
    distribution, it learns the new data), not the seed's rising curve.

    Example::

        det = RisingLossDetector(block=25, rise=0.2, sustain=3)
        det.observe(step).evidence["rise"]
    """

    SUPERVISED_LOSS = True  # let go of at a loss below zero (rules/engine.py)

    @validated_params
    def __init__(
        self,
        *,
        block: Annotated[int, Field(ge=5)] = 25,
        rise: Annotated[float, Field(gt=0.0)] = 0.2,
        z: Annotated[float, Field(ge=0.0)] = 4.0,
        sustain: Annotated[int, Field(ge=1)] = 3,
        drop: Annotated[float, Field(ge=0.0)] = 0.05,
        undo: Annotated[float, Field(ge=0.0)] = 0.25,
    ) -> None:
        self.block, self.rise, self.z, self.sustain, self.drop = block, rise, z, sustain, drop
        self.undo = undo
        self._current: list[float] = []
        self._first: float | None = None
        self._best: tuple[float, float, int] | None = None  # (median, se, step)
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=sustain)
        self._last: Finding = INACTIVE

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no loss (see the class docstring)."""
        loss = finite_loss(step)
        if loss is None:
            return None
        self._current.append(loss)
        if len(self._current) < self.block:
            return self._last
        values = np.asarray(self._current, dtype=np.float64)
        self._current = []
        median = float(np.median(values))
        se = median_se(MAD_TO_SIGMA * float(np.median(np.abs(values - median))), values.size)
        summary = (median, se, step.step)
        if self._first is None:
            self._first = median
        self._recent.append(summary)
        if self._best is None or median < self._best[0]:
            self._best = summary
        self._last = self._judge()
        return self._last

    def _judge(self) -> Finding:
        best, first = self._best, self._first
        if best is None or first is None or len(self._recent) < self.sustain:
            return INACTIVE
        if first < best[0] * (1.0 + self.drop):
            return INACTIVE  # never went down: not "decreases then rises"
        need = max(best[0] * self.rise, self.undo * (first - best[0]))
        for median, se, _ in self._recent:
            gap = median - best[0]
            if not (gap > need and gap > self.z * math.hypot(se, best[1])):
                return INACTIVE
        latest, oldest = self._recent[-1], self._recent[0]
        if oldest[0] - latest[0] > self.z * math.hypot(oldest[1], latest[1]):
            # Falling again across the sustained blocks: the run is learning its way back
            # down (after a change of data it learns the new data), not rising. A learning
            # rate too high keeps the loss up or pushes it higher (seed Stage 2).
            return INACTIVE
        rise = latest[0] / best[0] - 1.0 if best[0] > 0 else None
        undone = (latest[0] - best[0]) / (first - best[0])
        relative = f"{rise:+.0%} over" if rise is not None else "up from"
        summary = (
            f"loss is rising again: block median {latest[0]:.4g} at step {latest[2]} is "
            f"{relative} its low {best[0]:.4g} at step {best[2]}, taking back {undone:.0%} of its "
            f"drop from {first:.4g}, for {self.sustain} blocks of {self.block} steps; "
            "learning rate too high?"
        )
        evidence = {
            "low": best[0],
            "low_step": best[2],
            "level": latest[0],
            "rise": rise,
            "undone": undone,
            "start_level": first,
            "block": self.block,
            "blocks_above": self.sustain,
        }
        return Finding(True, summary, evidence)


class LossAboveStartDetector:
    """Active while the loss is ``factor`` times the run's first loss: worse than at its start.

    The first loss of a run from its initialisation is about what a trivial predictor
    scores (log of the class count for a classifier; the targets' variance for a
    regressor whose head starts near zero), and a supervised loss falls from there. The
    median of the latest ``over`` losses at ``factor`` times that first loss means the
    updates made the model far worse than its start: pytorch/examples'
    word_language_model with AdamW at the script's default lr of 20 went from 10.1 to
    18,514 at its second step and stayed there, while every other loss rule was still
    waiting for a history to judge a jump against (LossExtremeStep wants 20 values). Only
    for runs seen from (near) step one (``max_first_step``) with a positive first loss,
    so a resumed run or a loss that may be negative is not judged; the detector starts
    afresh at a planned data change, which is never a start.

    Example::

        det = LossAboveStartDetector(factor=10.0, over=3)
        det.observe(step).evidence["ratio"]
    """

    SUPERVISED_LOSS = True  # let go of at a loss below zero (rules/engine.py)

    @validated_params
    def __init__(
        self,
        *,
        factor: Annotated[float, Field(gt=1.0)] = 10.0,
        over: Annotated[int, Field(ge=1)] = 3,
        max_first_step: Annotated[int, Field(ge=0)] = 10,
    ) -> None:
        self.factor, self.over, self.max_first_step = factor, over, max_first_step
        self._first: tuple[int, float] | None = None  # the run's first finite loss and its step
        self._recent: deque[float] = deque(maxlen=over)

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no loss or the run is not judged."""
        loss = finite_loss(step)
        if loss is None:
            return None
        if self._first is None:
            self._first = (step.step, loss)
        first_step, first = self._first
        # A first loss after max_first_step is no start (a resume, a collector restarted).
        if first <= 0.0 or first_step > self.max_first_step:
            return None
        self._recent.append(loss)
        if len(self._recent) < self.over:
            return INACTIVE
        # statistics.median: on 3 values a tenth of np.median's cost, on every step.
        level = float(statistics.median(self._recent))
        if level < self.factor * first:
            return INACTIVE
        ratio = level / first
        times = f"{ratio:,.0f}" if ratio < 1e6 else f"{ratio:.3g}"
        summary = (
            f"loss {level:.4g} (median of the last {self.over}) is {times}× the run's "
            f"first loss {first:.4g} at step {first_step}: the model predicts far worse than "
            "it did at its start, where it scored about what a trivial predictor does"
        )
        evidence = {
            "level": level,
            "first_loss": first,
            "first_step": first_step,
            "ratio": ratio,
            "factor": self.factor,
        }
        return Finding(True, summary, evidence)
