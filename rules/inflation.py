"""Weights inflating while the loss stalls: updates too large for the weights (lr too high).

An invariant of healthy training: the weights stay steady. A run from a
standard init changes the total norm of its weight matrices by a small factor
(at most x1.49 in any 200 steps, and x2.06 over 1,500, across the nanoGPT,
minGPT and Hugging Face GPT-2 trials in ``benchmarks/``, the last one also at
4x its default lr), whatever its learning rate schedule. With the learning
rate ~100x too high, each update moves the weights by percents of their norm;
the norm inflates x5.7-x14.7 within the first 200 steps while the loss sits
on a plateau far above where the healthy run goes (nanoGPT, minGPT's adder and a GPT-2 under the HF
Trainer all did; the last one raised no alert before this rule: its update
ratio was above UpdateRatioTooLarge's 0.03 only while its loss still fell).

Two other shapes grow the weights fast and are told apart here:

* a too-small init "waking up" (WeightsStartedTooSmall): its gradients grow
  with its weights, at some point ``wake`` times their first steps' (nanoGPT
  init x0.01: the median of 20 steps reached x13.7 by step 23); with the lr
  too high they fall (at most x0.48 in the three trials, healthy x0.56);
* fast healthy learning: the loss falls while the weights grow; and once it has
  converged its loss is flat, far below where it began (a least-squares control
  grew its small init x3.7 in 20 steps while its loss fell 41 -> 0.002), so a
  stall counts only at ``above_start`` of the run's first losses or more (the
  three lr x100 runs stall at 0.57-0.7 of theirs).

Memory: a deque of per-layer weight norms, the samples of the latest ``within`` steps
(at most 256), and one of losses.

Example::

    det = WeightInflationDetector(growth=3.0, within=200)
    det.observe(step); det.observe_stats(stats).evidence["growth"]
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.growth import GradWake, combined_norm, total_grad_norm
from gradwatch.rules.history import WAKE_STEPS
from gradwatch.rules.roles import roles_of
from gradwatch.rules.series import slope_t
from gradwatch.rules.step import Stats, Step
from gradwatch.rules.updates import FIRST_STEP_MAX, loss_ends
from gradwatch.rules.weights import finite_weight_norms

__all__ = ["WeightInflationDetector"]

# A cadence sample: its step, the weight matrices' total norm, and each matrix's norm.
_Sample = tuple[int, float, np.ndarray]
# As kept: its step and every layer's norm. Which layers are matrices is decided when a
# sample is judged, from the roles known then: the agent's first samples (its first steps,
# the weights the run started from among them) arrive before the step batch that carries
# the roles, and a history dropped when they come would lose the start.
_Kept = tuple[int, np.ndarray]


class WeightInflationDetector:
    """Active while the weight matrices' norm grew ``growth`` times within ``within`` steps,
    the loss fell less than ``min_progress`` over the latest ``span`` steps and still sits
    at ``above_start`` of the run's first losses or more, and the gradients never woke up
    (module docstring). A loss whose latest ``trend_losses`` fall with a slope ``learn_z``
    standard errors below zero is learning, however slowly, and is no stall: karpathy/
    makemore's bigram table starts at zero, so AdamW grows its norm x36 in 97 steps
    while the loss falls 1% (t = -28.7 over 50 losses); the lr-too-high runs that page
    here plateau (t >= -2.5).

    Once active, the incident holds while the weights stay ``growth`` times above the
    base it was measured from and the loss stays stalled: a run whose lr is far too high
    is one incident, however slowly its weights grow afterwards.
    """

    @validated_params
    def __init__(
        self,
        *,
        growth: Annotated[float, Field(gt=1.0)] = 3.0,
        within: Annotated[int, Field(ge=1)] = 200,
        span: Annotated[int, Field(ge=10, le=1000)] = 100,  # the loss deque holds 1,024 steps
        min_progress: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.1,
        wake: Annotated[float, Field(ge=1.0)] = 3.0,
        above_start: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.25,
        learn_z: Annotated[float, Field(ge=0.0)] = math.inf,
        trend_losses: Annotated[int, Field(ge=3, le=1000)] = 50,
    ) -> None:
        self.growth, self.within, self.span = growth, within, span
        self.min_progress, self.wake, self.above_start = min_progress, wake, above_start
        self.learn_z, self.trend_losses = learn_z, trend_losses
        # The run's first 10 losses (from a step <= FIRST_STEP_MAX): where a stall sits.
        self._start: list[float] = []
        self._kept: deque[_Kept] = deque(maxlen=256)
        self._losses: deque[tuple[int, float]] = deque(maxlen=1024)
        self._wake = GradWake(wake, WAKE_STEPS)  # a small init's gradients waking up
        self._sent: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._layers: tuple[str, ...] = ()
        self._base: _Kept | None = None  # the sample an active incident grew from

    def observe(self, step: Step) -> None:
        """Keep the losses, the roles the agent sent, and the first and latest grad norms."""
        if step.layer_roles:
            self._sent = (step.layers, step.layer_roles)
        if step.loss is not None and math.isfinite(step.loss):
            self._losses.append((step.step, step.loss))
            if len(self._start) < 10 and (self._start or step.step <= FIRST_STEP_MAX):
                self._start.append(step.loss)
        self._wake.observe(step.step, total_grad_norm(step))

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no usable weight norms."""
        norms = self._layer_norms(stats)
        if norms is None:
            return None
        now, chosen = stats.step, self._chosen(stats, norms.size)
        # Only samples within `within` steps are ever a base: at stats_every 50, ~5 arrays
        # a rank instead of up to 256 (a 300-tensor model: 12 KiB, not 600).
        while self._kept and now - self._kept[0][0] > self.within:
            self._kept.popleft()
        self._kept.append((now, norms))
        kept = self._base
        if kept is None:
            inside = [item for item in self._kept if now - item[0] <= self.within]
            kept = min(inside, key=lambda item: combined_norm(item[1][chosen]))
        base = (kept[0], combined_norm(kept[1][chosen]), kept[1][chosen])
        matrices = norms[chosen]
        total = combined_norm(matrices)
        if not self._inflated(base, total, matrices):
            self._base = None  # never grown, or come back down: no incident
            return INACTIVE
        stalled = self._stalled(now)
        if stalled is None or self._wake.woken:
            self._base = None
            return INACTIVE
        self._base = kept
        return self._finding(stats, total, base, stalled)

    def _inflated(self, base: _Sample, total: float, matrices: np.ndarray) -> bool:
        """Grown ``growth`` times from ``base``: the total, and three in four weight matrices.

        Not the total alone: zero-initialised matrices (LoRA's B, half of a LoRA model's
        matrices; a fresh head) can grow it on their own. With the lr too high nearly every
        matrix inflates: the lower quartile of their growth was x3.5-x9.0 where the total
        grew x3.7-x14.7. Matrices that start below a tenth of the median one (B after one
        step) are left out.
        """
        if base[1] <= 0.0 or total < self.growth * base[1]:
            return False
        first = base[2]
        kept = first >= 0.1 * float(np.median(first))
        growths = matrices[kept] / first[kept]
        return bool(kept.any()) and float(np.percentile(growths, 25)) >= self.growth

    def _layer_norms(self, stats: Stats) -> np.ndarray | None:
        """Every layer's weight norm; a new layout starts the history afresh."""
        norms = finite_weight_norms(stats)
        if norms is None:
            return None
        if stats.layers != self._layers or len(stats.layers) != norms.size:
            self._kept.clear()  # another layout: old norms compare to nothing
            self._layers, self._base = stats.layers, None
        return norms

    def _chosen(self, stats: Stats, size: int) -> np.ndarray:
        """Which layers are weight matrices, by the roles known now (every layer where none
        is known as a matrix): norm gains start at 1 and barely move; embeddings are tied."""
        if len(stats.layers) == size:
            roles = roles_of(stats.layers, self._sent[1] if self._sent[0] == stats.layers else ())
            matrices = np.array([r == "weight" for r in roles], dtype=bool)
            if matrices.any():
                return matrices
        return np.ones(size, dtype=bool)

    def _stalled(self, now: int) -> tuple[float, float, int] | None:
        """(first, last, from_step) of a loss that fell less than ``min_progress`` over the
        latest ``span`` steps; None while it fell more, or too few losses tell."""
        ends = loss_ends(self._losses, now - self.span, now)
        if ends is None or ends.last_step - ends.first_step < 0.8 * self.span:
            return None  # no loss series over the span: the weights alone page nobody
        first, last = ends.first, ends.last
        if last <= (1.0 - self.min_progress) * first:
            return None
        recent = [loss for step, loss in list(self._losses)[-self.trend_losses :] if step <= now]
        if slope_t(recent) <= -self.learn_z:
            return None  # falling steadily: slow learning, not a stall
        if len(self._start) < 10 or last < self.above_start * float(np.median(self._start)):
            # Converged to a floor (or the start unknown: joined mid-run), not stuck on a
            # plateau near where it began.
            return None
        return first, last, ends.first_step

    def _finding(
        self, stats: Stats, total: float, base: _Sample, stalled: tuple[float, float, int]
    ) -> Finding:
        grown = total / base[1]
        first, last, since = stalled
        summary = (
            f"weights inflating while the loss stalls: the weight matrices' total norm grew "
            f"×{grown:.3g} from {base[1]:.4g} at step {base[0]} to {total:.4g} at step "
            f"{stats.step} (healthy runs: ≤ ×1.5 in any 200 steps), while the loss went from "
            f"{first:.4g} to {last:.4g} since step {since}; updates too large for the weights: "
            "learning rate too high?"
        )
        evidence = {
            "growth": grown,
            "base_step": base[0],
            "base_weight_norm": base[1],
            "weight_norm": total,
            "loss_first": first,
            "loss_last": last,
            "loss_since_step": since,
            "grad_norm_first": self._wake.first,
            "grad_norm_recent": self._wake.recent,
        }
        return Finding(True, summary, evidence)
