"""Update-size detectors on cadence statistics: ‖Δw‖/‖w‖ of the optimizer's steps.

* :class:`UpdateRatioDetector` -- ‖Δw‖/‖w‖ of the optimizer's update outside
  a sane band. Karpathy's rule of thumb (CS231n notes) puts a healthy ratio
  around 1e-3. ``direction="high"``: the weight-norm-weighted global ratio
  above ``high`` (default 0.1, two orders above the rule of thumb) -- the
  optimizer rewrites the weights every few steps. ``direction="low"``: even
  the fastest-moving layer below ``low`` (default 1e-6) while the learning
  rate is non-zero and not annealed away -- nothing learns (frozen
  parameters, an optimizer that never steps, bf16 rounding every update away).
  ``direction="small"``: the global ratio of the layers that move below
  ``low``, the rate not annealed away, and the loss no ``min_progress`` below
  where the run started -- everything moves, too little to learn.
  smdebug's WeightUpdateRatio uses 10 and 1e-8 on its own definition of the
  ratio; the defaults here are calibrated on synthetic runs.

:class:`LaggingLayersDetector` (some weight matrices updating far slower than
the rest) is in :mod:`gradwatch.rules.lagging`.

The weight-norm detectors (runaway growth, a too-small init) are in
:mod:`gradwatch.rules.weights`, which re-exports these for its importers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Annotated, Literal, NamedTuple

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.step import Stats, Step

# "Since the start" only for a run seen from (near) its first step, as LossFlatFromStart's
# max_first_step: a resumed converged run is flat and moves little, and is healthy.
FIRST_STEP_MAX = 10  # a first loss after this step is no run's start (a resume)


Direction = Literal["high", "low", "small", "partial"]


class UpdateRatioDetector:
    """Active while ‖Δw‖/‖w‖ is outside the band for ``samples`` consecutive cadence samples.

    See the module docstring for the two directions. ``observe`` only tracks
    the learning rate (largest param group; None when never reported).

    Example::

        det = UpdateRatioDetector(direction="high", high=0.1)
        det.observe_stats(stats).evidence["ratio"]
    """

    @validated_params
    def __init__(
        self,
        *,
        direction: Direction = "high",
        high: Annotated[float, Field(gt=0.0)] = 0.1,
        low: Annotated[float, Field(ge=0.0)] = 1e-6,
        samples: Annotated[int, Field(ge=1)] = 3,
        lr_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1,
        moving: Annotated[float, Field(gt=0.0)] = 1e-4,
        span: Annotated[int, Field(ge=0)] = 0,
        min_progress: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0,
    ) -> None:
        self.span, self.min_progress = span, min_progress
        # (step, loss) of recent steps: "high" holds only while the loss makes no progress.
        self._losses: deque[tuple[int, float]] = deque(maxlen=1024)
        self.direction, self.high, self.low, self.moving = direction, high, low, moving
        self.samples, self.lr_fraction = samples, lr_fraction
        self._lr: float | None = None
        self._lr_peak = 0.0
        self._held = 0
        self._since: int | None = None
        # "partial": per layer, how many samples in a row it was still, and since which
        # step (for the layer names the arrays were made for).
        self._still: tuple[tuple[str, ...], np.ndarray, np.ndarray] | None = None
        # The run's first 10 losses: "small" judges progress from them.
        self._start: list[float] = []
        self._start_step: int | None = None

    def observe(self, step: Step) -> None:
        """Track the lr (and the loss, for ``min_progress``); judged on cadence samples."""
        if self.min_progress and step.loss is not None and math.isfinite(step.loss):
            self._losses.append((step.step, step.loss))
            if len(self._start) < 10:
                self._start.append(step.loss)
                self._start_step = step.step if self._start_step is None else self._start_step
        if step.lr:
            lr = max(step.lr)
            if math.isfinite(lr):
                self._lr = lr
                self._lr_peak = max(self._lr_peak, lr)

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no update ratios."""
        read = finite_ratios(stats)
        if read is None:
            return None
        ratios, finite = read
        frozen: list[str] = []
        if self.direction == "high":
            value = self.global_ratio(ratios, finite, stats.weight_norms)
            outside = value > self.high
        elif self.direction == "small":
            # Layers that move, however little (exact zeros are WeightsFrozen's and
            # LayersFrozen's), weighted by their norm: the model's typical update.
            moving = finite & (ratios > 0.0)
            value = self.global_ratio(ratios, moving, stats.weight_norms) if moving.any() else 0.0
            outside = self._judged() and 0.0 < value < self.low
        elif self.direction == "partial":
            # Some layers never move while others learn: a freeze left on (or meant: the
            # rule is informational). Judged like "low", on the rate the run is using.
            still = self._longest_still(stats, finite & (ratios < self.low))
            value = float(still.sum())
            names = stats.layers if len(stats.layers) == ratios.size else ()
            frozen = [names[i] if names else f"#{i}" for i in np.flatnonzero(still)]
            # The rest must clearly learn (a converged model moves every layer a little).
            learning = bool((ratios[finite] >= self.moving).any())
            outside = self._judged() and learning and bool(still.any())
        else:
            value = float(ratios[finite].max())
            outside = self._judged() and value < self.low
        if not outside:
            self._held, self._since = 0, None
            return INACTIVE
        self._held += 1
        if self._since is None:
            self._since = stats.step
        if self.direction == "partial" and self._still is not None:
            # The layers still longest, not any layer on each sample (_longest_still).
            held = int(self._still[1].max())
            self._held = held
            self._since = int(self._still[2][self._still[1] == held].min())
        if self._held < self.samples or stats.step - self._since < self.span:
            return (
                INACTIVE  # a span: Adam's first steps and a waking init move weights fast, briefly
            )
        if self.direction == "high" and self._progressing(self._since, stats.step):
            return INACTIVE  # large updates that keep lowering the loss: a fast, healthy run
        if self.direction == "small" and self._learned():
            return INACTIVE  # the run learned since its start: small updates of a converged model
        return self._finding(value, stats, frozen)

    def _longest_still(self, stats: Stats, still: np.ndarray) -> np.ndarray:
        """The layers still in this sample that have been so for the most samples in a row.

        A layer skipped on some steps (LayerDrop in fairseq and HF models, an MoE expert no
        token was routed to) is still on one sample and moves on the next: two such layers
        in a row are no layer that never changes. Counted per layer."""
        kept = self._still
        if kept is None or kept[0] != stats.layers or kept[1].shape != still.shape:
            run, since = np.zeros(still.shape, dtype=np.int64), np.zeros(still.shape, np.int64)
        else:
            run, since = kept[1], kept[2]
        since = np.where(still & (run == 0), stats.step, since)
        run = np.where(still, run + 1, 0)
        self._still = (stats.layers, run, since)
        return still & (run == run.max()) if still.any() else still

    def _progressing(self, start: int, end: int) -> bool:
        """True when the loss fell ``min_progress`` from the start to the end of [start, end]."""
        if not self.min_progress:
            return False
        ends = loss_ends(self._losses, start, end)
        if ends is None:
            return False  # too few losses to tell: judge on the updates alone
        return ends.last <= (1.0 - self.min_progress) * ends.first

    def _learned(self) -> bool:
        """True unless the latest losses sit within ``min_progress`` of the run's first ones."""
        if len(self._start) < 10 or len(self._losses) < 10:
            return True  # too few losses to say it did not learn
        if self._start_step is None or self._start_step > FIRST_STEP_MAX:
            return True  # first seen mid-way (a resume, a restarted collector): not its start
        recent = [v for _, v in list(self._losses)[-max(3, len(self._losses) // 5) :]]
        return float(np.median(recent)) <= (1.0 - self.min_progress) * float(np.median(self._start))

    def _judged(self) -> bool:
        # Frozen only means something while the rate is non-zero and not annealed away.
        lr = self._lr
        return lr is not None and lr > 0.0 and lr >= self.lr_fraction * self._lr_peak

    @staticmethod
    def global_ratio(ratios: np.ndarray, finite: np.ndarray, weights: np.ndarray | None) -> float:
        """‖Δw‖/‖w‖ over the model (the layers ``finite`` selects) weighted by their weight norm."""
        if weights is not None and np.asarray(weights).shape == ratios.shape:
            w = np.asarray(weights, dtype=np.float64)
            ok = finite & np.isfinite(w)
            denominator = float(np.dot(w[ok], w[ok]))
            if denominator > 0.0:
                return math.sqrt(
                    float(np.dot(ratios[ok] * w[ok], ratios[ok] * w[ok])) / denominator
                )
        return float(np.median(ratios[finite]))

    def _finding(self, value: float, stats: Stats, frozen: list[str]) -> Finding:
        if self.direction == "partial":
            shown = ", ".join(repr(n) for n in frozen[:5]) + (" …" if len(frozen) > 5 else "")
            summary = (
                f"{len(frozen)} layer(s) never change (‖Δw‖/‖w‖ < {self.low:g}) for {self._held} "
                f"samples since step {self._since} while the others learn: {shown}; frozen on "
                "purpose, or requires_grad / the optimizer's param groups left wrong?"
            )
        elif self.direction == "high":
            summary = (
                f"updates too large: ‖Δw‖/‖w‖ = {value:.3g} > {self.high:g} for {self._held} "
                "samples "
                f"since step {self._since} (healthy is ~1e-3); learning rate too high?"
            )
        elif self.direction == "small":
            summary = (
                f"updates too small: ‖Δw‖/‖w‖ = {value:.3g} < {self.low:g} for {self._held} "
                "samples "
                f"since step {self._since} (healthy is ~1e-3) with lr {self._lr:.3g}, and the loss "
                "has "
                "not fallen since the start; learning rate too low, or an optimizer setting that "
                "shrinks every step (Adam's eps, a tiny lr multiplier)?"
            )
        else:
            summary = (
                f"weights frozen: the largest layer ‖Δw‖/‖w‖ is {value:.3g} < {self.low:g} for "
                f"{self._held} samples since step {self._since} with lr {self._lr:.3g}; are the "
                "parameters in the optimizer, and does it step?"
            )
        evidence = {
            "direction": self.direction,
            "ratio": value,
            "threshold": self.high if self.direction == "high" else self.low,
            "frozen_layers": frozen[:32],
            "samples": self._held,
            "since_step": self._since,
            "lr": self._lr,
            "step": stats.step,
        }
        return Finding(True, summary, evidence)


class LossEnds(NamedTuple):
    """Where the losses of a stretch of steps began and ended."""

    first: float  # median of the first fifth (at least 3 losses)
    last: float  # median of the last fifth
    first_step: int
    last_step: int


def loss_ends(losses: Iterable[tuple[int, float]], start: int, end: int) -> LossEnds | None:
    """The medians of the first and last fifths of the (step, loss) pairs in [start, end];
    None with fewer than 10 (too few to tell a trend from noise)."""
    inside = [(s, v) for s, v in losses if start <= s <= end]
    if len(inside) < 10:
        return None
    fifth = max(3, len(inside) // 5)
    first = float(np.median([v for _, v in inside[:fifth]]))
    last = float(np.median([v for _, v in inside[-fifth:]]))
    return LossEnds(first, last, inside[0][0], inside[-1][0])


def model_update_ratio(stats: Stats) -> float | None:
    """‖Δw‖/‖w‖ over the model as UpdateRatioTooLarge reads it (weighted by weight norm: a
    median over layers reads a tiny-init model's small layers as "updates too large");
    None when the sample carries no finite update ratio."""
    read = finite_ratios(stats)
    return None if read is None else UpdateRatioDetector.global_ratio(*read, stats.weight_norms)


def finite_ratios(stats: Stats) -> tuple[np.ndarray, np.ndarray] | None:
    """The sample's update ratios (float64) and which are finite; None without a finite one."""
    if stats.update_ratios is None:
        return None
    ratios = np.asarray(stats.update_ratios, dtype=np.float64)
    finite = np.isfinite(ratios)
    return (ratios, finite) if finite.any() else None
