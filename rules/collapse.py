"""Collapses that stop learning with no statistic looking odd, and a loss that is no supervised one.

* :class:`ZeroLossDetector` -- a supervised loss that fell to exactly 0.0
  and stays there. Cross-entropy or MSE reaches exactly zero only when every
  example of every batch is predicted with certainty: the inputs contain the
  answer (label leakage), or the loss sees nothing (every label masked). A
  zero loss has a zero gradient, so the run has stopped learning from its
  data: category ``dead_pipeline``. One exact zero among small losses is
  rounding (a log with 4 decimals); a run of them is not.
* :class:`LrTooLowDetector` -- the learning rate collapsed by orders of
  magnitude long before the run could plausibly end, and the loss stalled
  (e.g. a per-epoch scheduler stepped per batch: ``StepLR(step_size=30)``
  decays 10x every 30 *batches*). A planned decay reaches such depths only in
  its last moments: cosine to zero spends 0.6% of the run below 1e-4 of its
  peak, a linear decay 0.01%, the classic step schedule never goes below
  1e-3. So the detector measures how long the lr has stayed collapsed against
  how long the run took to get there.
* :class:`SignedLossDetector` -- the first loss below zero: the engine stops the
  rules that read the loss as a supervised one there, and this says so.

Example::

    det = LrTooLowDetector()
    finding = det.observe(step)
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.loss import finite_loss
from gradwatch.rules.series import median_se, robust_sigma
from gradwatch.rules.step import Step


class ZeroLossDetector:
    """Active while the loss has been exactly 0.0 on ``consecutive`` observations in a row.

    Only for a supervised loss: it must have started above zero and never
    been negative (RL objectives and other signed losses are not judged).
    """

    @validated_params
    def __init__(self, *, consecutive: Annotated[int, Field(ge=2)] = 3) -> None:
        self.consecutive = consecutive
        self._started = False
        self._signed = False
        self._zeros = 0
        self._since: int | None = None
        self._before: float | None = None

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no loss."""
        loss = finite_loss(step)
        if loss is None:
            return None
        if loss < 0.0:
            self._signed = True
        if loss != 0.0:
            self._started = True
            self._zeros, self._since, self._before = 0, None, loss
            return INACTIVE
        if self._zeros == 0:
            self._since = step.step
        self._zeros += 1
        if self._signed or not self._started or self._zeros < self.consecutive:
            return INACTIVE
        summary = (
            f"training loss has been exactly 0 on {self._zeros} logged losses in a row since step "
            f"{self._since} (before: {self._before:.4g}): it no longer carries a training signal"
        )
        return Finding(
            True,
            summary,
            {"zero_losses": self._zeros, "since_step": self._since, "loss_before": self._before},
        )


class LrTooLowDetector:
    """Active while the lr sits at or below ``ratio`` of its peak, has stayed there for at least
    ``min_fraction`` of the steps the run took to get there, over at least ``min_losses`` losses,
    and the loss has not clearly improved since (``tolerance`` relative plus ``z`` standard errors).

    Reads the largest learning rate of the step's parameter groups; steps
    without one give no verdict, and an lr of exactly 0 everywhere is the
    OptimizerIdle rule's.
    """

    SUPERVISED_LOSS = True  # let go of at a loss below zero (rules/engine.py)

    @validated_params
    def __init__(
        self,
        *,
        ratio: Annotated[float, Field(gt=0.0, lt=1.0)] = 1e-4,
        min_fraction: Annotated[float, Field(gt=0.0)] = 0.25,
        min_losses: Annotated[int, Field(ge=3)] = 10,
        tolerance: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.02,
        z: Annotated[float, Field(ge=0.0)] = 3.0,
    ) -> None:
        self.ratio, self.min_fraction, self.min_losses = ratio, min_fraction, min_losses
        self.tolerance, self.z = tolerance, z
        self._first_step: int | None = None
        self._peak = 0.0
        self._peak_step = 0
        self._since: int | None = None  # first step of the current collapse
        self._early: list[float] = []  # the first losses of the collapse
        self._recent: deque[float] = deque(maxlen=min_losses)

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no learning rate."""
        lrs = [lr for lr in step.lr if math.isfinite(lr)]
        if not lrs or max(lrs) <= 0.0:
            return None
        lr = max(lrs)
        if self._first_step is None:
            self._first_step = step.step
        if lr > self._peak:
            self._peak, self._peak_step = lr, step.step
        if lr > self.ratio * self._peak:
            self._since = None
            return INACTIVE
        if self._since is None:
            self._since = step.step
            self._early, self._recent = [], deque(maxlen=self.min_losses)
        loss = finite_loss(step)
        if loss is not None:
            if len(self._early) < self.min_losses:
                self._early.append(loss)
            self._recent.append(loss)
        return self._judge(step.step, lr)

    def _judge(self, at: int, lr: float) -> Finding:
        assert self._since is not None and self._first_step is not None
        before = self._since - self._first_step
        if (
            at - self._since < self.min_fraction * before
            or len(self._early) < self.min_losses
            or len(self._recent) < self.min_losses
        ):
            return INACTIVE
        early, recent = np.asarray(self._early), np.asarray(self._recent)
        start, now = float(np.median(early)), float(np.median(recent))
        se = math.hypot(
            median_se(robust_sigma(early), early.size), median_se(robust_sigma(recent), recent.size)
        )
        if start - now > self.tolerance * abs(start) + self.z * se:
            return INACTIVE  # still learning at this rate: not too low
        summary = (
            f"learning rate {lr:.3g} is {lr / self._peak:.1e} of its peak {self._peak:.3g} "
            f"(step {self._peak_step}) since step {self._since}, {at - self._since} steps after "
            f"{before} steps of training, and the loss stalled ({start:.4g} -> {now:.4g}): "
            "a scheduler stepped per batch instead of per epoch?"
        )
        evidence = {
            "lr": lr,
            "peak_lr": self._peak,
            "peak_step": self._peak_step,
            "since_step": self._since,
            "steps_collapsed": at - self._since,
            "steps_before": before,
            "loss_at_collapse": start,
            "loss": now,
            "ratio": self.ratio,
        }
        return Finding(True, summary, evidence)


class SignedLossDetector:
    """Active from the run's first finite loss below zero on: the loss is read as a signed one.

    The engine lets the supervised-loss rules go at that loss (rules/engine.py); this
    says so once, with the step, so nobody takes their silence for health. A
    policy-gradient objective is signed by design, and so is the negative log-likelihood
    of a continuous density (Gaussian NLL, a normalizing flow); a cross-entropy or MSE
    below zero is a bug (a flipped sign, NLL on logits rather than log-probabilities).
    """

    def __init__(self) -> None:
        self._first: tuple[int, float] | None = None

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no finite loss."""
        loss = finite_loss(step)
        if loss is None:
            return None
        if self._first is None:
            if loss >= 0.0:
                return INACTIVE
            self._first = (step.step, loss)
        at, value = self._first
        summary = (
            f"the loss went below zero at step {at} ({value:.4g}): gradwatch reads it as a "
            "signed objective (reinforcement learning; a continuous density's negative "
            "log-likelihood) and no longer judges its spikes, rises or plateaus; a "
            "cross-entropy or MSE below zero is a bug"
        )
        return Finding(True, summary, {"first_negative_step": at, "first_negative_loss": value})
