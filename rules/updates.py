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
* :class:`LaggingLayersDetector` -- some weight matrices update orders of
  magnitude slower than the model's fastest ones, and their gradients do not
  explain it, nor does their own growth: the optimizer gives them a far smaller
  step per unit of gradient.

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
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Stats, Step

# "Since the start" only for a run seen from (near) its first step, as LossFlatFromStart's
# max_first_step: a resumed converged run is flat and moves little, and is healthy.
FIRST_STEP_MAX = 10  # a first loss after this step is no run's start (a resume)
# LaggingLayersDetector's running mean of log gradient norms: one step in GRAD_EVERY is
# folded in at weight 1/4, so the mean follows the last ~8 steps (the offline check on
# the kept traces used the median of the last 16).
GRAD_MEAN_WEIGHT = 0.25
GRAD_EVERY = 2
# LaggingLayersDetector: param-group learning rates within this factor of each other are
# one rate (a float32 round trip, or a scheduler's rounding).
SAME_LR = 1.0 + 1e-6


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
            still = finite & (ratios < self.low)
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
        if self._held < self.samples or stats.step - self._since < self.span:
            return (
                INACTIVE  # a span: Adam's first steps and a waking init move weights fast, briefly
            )
        if self.direction == "high" and self._progressing(self._since, stats.step):
            return INACTIVE  # large updates that keep lowering the loss: a fast, healthy run
        if self.direction == "small" and self._learned():
            return INACTIVE  # the run learned since its start: small updates of a converged model
        return self._finding(value, stats, frozen)

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


# A weight matrix whose norm is below this share of the median matrix's has no update
# ratio to compare: LoRA's zero-initialised B reads 0.008 of the median after one step
# (and ‖Δw‖/‖w‖ ~0.2, its update over almost nothing), which made the A matrices "lag
# 30x" at step 2 of a healthy LoRA fine-tune. Healthy full models: the smallest weight
# matrix is >= 0.22 of the median (nanoGPT, minGPT, the HF GPT-2 and the fault suite).
SIZED_SHARE = 0.1


def _sized(weight_norms: np.ndarray | None, weight: np.ndarray) -> np.ndarray:
    """The layers whose weight norm is at least SIZED_SHARE of the median weight matrix's
    (all of them when the sample carries no weight norms)."""
    if weight_norms is None:
        return np.ones_like(weight)
    norms = np.asarray(weight_norms, dtype=np.float64)
    if norms.shape != weight.shape or not weight.any():
        return np.ones_like(weight)
    with np.errstate(invalid="ignore"):
        return np.asarray(norms >= SIZED_SHARE * float(np.median(norms[weight])), dtype=bool)


class LaggingLayersDetector:
    """Active while some weight matrices update ``factor`` times slower than the model's fast
    ones, not because their gradients are smaller.

    ‖Δw‖/‖w‖ per layer, on weight matrices only (roles as for the layer ratio:
    norm gains, biases and embeddings move at rates of their own). A layer far
    below the others learns ~``factor`` times slower. The reference is the upper
    decile of the layers' ratios, not their median: when most layers lag (every
    hidden layer of an MLP behind its head), the median is a lagging layer
    itself. Layers below ``low`` are frozen (LayersFrozen's) and left out, and so
    are matrices far smaller than the median one (``SIZED_SHARE``: a
    zero-initialised LoRA B).

    A lag counts only when the optimizer moved the layer less *per unit of its
    gradient*: its step ‖Δw‖/‖g‖ (‖g‖ a running mean of its gradient norms, in
    logs) at least ``unexplained`` times below the median step of the layers that
    do not lag. A param group with a far smaller learning rate (the cause this
    rule names first) does that under any optimizer. A layer whose gradient is
    small moves little under SGD (the same step per unit of gradient for every
    layer) with nothing misconfigured: a healthy LSTM's first ~40 steps
    (pytorch/examples' word_language_model, hand-written SGD at lr 20: lags up to
    93x). That is gradients vanishing on the way down, which
    LayerGradNormRatioVanishing and the activation rules judge against the run's
    own history. A sample is not judged before its layers' gradient norms arrive
    (a rank that sends none sends no samples either).

    Nor does a lag count that the layer's own growth explains: a ratio is small
    when ‖Δw‖ is small *or* when ‖w‖ grew. A layer counts only while its lag, net
    of how much more its weight norm grew since the first sample than the median
    matrix's, is still ``factor``. CleanRL's PPO (healthy, Adam): the value head
    grew x10.5 as its outputs climbed towards the returns and lagged 30-45x, its
    steps the size they had been. A param group at a smaller rate barely grows.

    Example::

        det = LaggingLayersDetector(factor=100.0)
        det.observe_stats(stats).evidence["lagging_layers"]
    """

    @validated_params
    def __init__(
        self,
        *,
        factor: Annotated[float, Field(gt=1.0)] = 100.0,
        low: Annotated[float, Field(ge=0.0)] = 1e-6,
        samples: Annotated[int, Field(ge=1)] = 3,
        min_layers: Annotated[int, Field(ge=3)] = 3,
        max_named: Annotated[int, Field(ge=1)] = 10,
        unexplained: Annotated[float, Field(ge=1.0)] = 1.0,
    ) -> None:
        self.factor, self.low, self.samples = factor, low, samples
        self.min_layers, self.max_named = min_layers, max_named
        self.unexplained = unexplained
        self._sent: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        # log10 of each layer's gradient norm, a running mean over recent steps: one array
        # per rank, where a window of the last 16 steps would hold 16 (on every rank).
        self._grads: tuple[tuple[str, ...], np.ndarray] | None = None
        self._since_fold = 0
        self._held = 0
        self._since: int | None = None
        # Each layer's weight norm in the first sample that had it (a layer started at
        # zero: its first non-zero one), for the layer set that sample named.
        self._first: tuple[tuple[str, ...], np.ndarray] | None = None
        # The latest step's learning rate per param group: () when none was sent.
        self._lrs: tuple[float, ...] = ()

    def observe(self, step: Step) -> None:
        """Keep the roles the agent sent with the step's layers, its learning rates and
        its gradient norms."""
        if step.layer_roles:
            self._sent = (step.layers, step.layer_roles)
        if step.lr:
            self._lrs = step.lr
        if self.unexplained <= 1.0 or not step.layers or step.layer_norms.size != len(step.layers):
            return
        # Folded in every GRAD_EVERY-th step only: a few array operations per fold, where
        # the collector handles every step of every reporting rank.
        self._since_fold += 1
        last = self._grads
        if last is not None and last[0] == step.layers and self._since_fold < GRAD_EVERY:
            return
        self._since_fold = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.asarray(step.layer_norms, dtype=np.float64))
        if last is None or last[0] != step.layers:
            self._grads = (step.layers, logs)
            return
        # A layer without a finite norm this step (none yet, NaN) keeps its mean.
        mean = last[1]
        fine = np.isfinite(logs)
        start = fine & ~np.isfinite(mean)
        mean[start] = logs[start]
        move = fine & ~start
        mean[move] += GRAD_MEAN_WEIGHT * (logs[move] - mean[move])

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no usable update ratios."""
        if stats.update_ratios is None or len(stats.layers) != np.asarray(stats.update_ratios).size:
            return None
        ratios = np.asarray(stats.update_ratios, dtype=np.float64)
        roles = roles_of(stats.layers, self._sent[1] if self._sent[0] == stats.layers else ())
        weight = (
            np.array([r == "weight" for r in roles]) & np.isfinite(ratios) & (ratios >= self.low)
        )
        weight &= _sized(stats.weight_norms, weight)
        if int(weight.sum()) < self.min_layers:
            return None
        logs = np.log10(ratios[weight])
        median = float(np.median(logs))
        upper = float(np.quantile(logs, 0.9, method="higher"))  # a layer, not between two
        lagging = np.flatnonzero(weight)[logs < upper - math.log10(self.factor)]
        with np.errstate(divide="ignore", invalid="ignore"):
            lags = upper - np.log10(ratios)
        lagging = self._not_grown(stats, weight, lagging, lags)
        counted = self._unexplained(stats, ratios, weight, lagging)
        if counted is None:
            return None  # no gradient norms for these layers yet: no judgement
        lagging = counted
        if lagging.size == 0:
            self._held, self._since = 0, None
            return INACTIVE
        self._held += 1
        if self._since is None:
            self._since = stats.step
        if self._held < self.samples:
            return INACTIVE
        names = [stats.layers[i] for i in lagging]
        slowest = float(ratios[lagging].min())
        shown = ", ".join(repr(n) for n in names[: self.max_named]) + (
            " …" if len(names) > self.max_named else ""
        )
        summary = (
            f"{len(names)} weight layer(s) update over {self.factor:g}× slower than the model's "
            "fastest "
            f"(‖Δw‖/‖w‖ down to {slowest:.3g} against {10.0**upper:.3g} in the upper decile, "
            "median "
            f"{10.0**median:.3g}) for {self._held} samples since step {self._since}: {shown}"
        )
        evidence = {
            "lagging_layers": names[: self.max_named],
            "count": len(names),
            "slowest_ratio": slowest,
            "median_ratio": 10.0**median,
            "reference_ratio": 10.0**upper,
            "samples": self._held,
            "since_step": self._since,
        }
        lrs = self._lrs
        if lrs and all(math.isfinite(lr) for lr in lrs):
            evidence["group_lrs"] = list(lrs)
            if max(lrs) <= min(lrs) * SAME_LR:
                # One rate for every layer: the rule's first suspect, a param group at a
                # smaller rate, cannot be it (CleanRL's PPO at lr x1000, one Adam group:
                # the collapsed actor's steps, scaled by second moments of its first
                # huge gradients, lagged 10,000x; it was told to check group rates).
                evidence["lead_check"] = (
                    f"not a smaller learning rate (every param group runs at {lrs[0]:.3g}): "
                    "the optimizer's own scaling shrinks these layers' steps, most often "
                    "Adam's second moments still holding far larger earlier gradients (an "
                    "earlier blow-up: lower the learning rate), else a per-layer trust ratio "
                    "(LARS, LAMB) or a hook that scales their updates"
                )
                evidence["ruled_out"] = [
                    "per-parameter-group learning rates",
                    "layer-wise learning-rate decay",
                ]
        return Finding(True, summary, evidence)

    def _not_grown(
        self, stats: Stats, weight: np.ndarray, lagging: np.ndarray, lags: np.ndarray
    ) -> np.ndarray:
        """The lagging layers whose lag (``lags``: log10 below the upper decile) is still
        ``factor`` net of their weight norm's growth since the first sample, beyond the
        median matrix's growth (the class docstring: a ratio small because ‖w‖ grew)."""
        norms = stats.weight_norms
        if norms is None or len(norms) != weight.size:
            return lagging
        now = np.asarray(norms, dtype=np.float64)
        first = self._first
        if first is None or first[0] != stats.layers:
            self._first = (stats.layers, now.copy())
            return lagging
        start = first[1]
        unset = ~(start > 0)  # NaN (not read yet) or zero (a zero-initialised layer)
        start[unset] = now[unset]
        if lagging.size == 0:
            return lagging
        with np.errstate(divide="ignore", invalid="ignore"):
            growth = np.log10(now / start)
        others = weight.copy()
        others[lagging] = False
        known = others & np.isfinite(growth)
        if not known.any():
            return lagging
        excess = np.nan_to_num(growth[lagging] - float(np.median(growth[known])), nan=0.0)
        result: np.ndarray = lagging[
            lags[lagging] - np.maximum(excess, 0.0) >= math.log10(self.factor)
        ]
        return result

    def _unexplained(
        self, stats: Stats, ratios: np.ndarray, weight: np.ndarray, lagging: np.ndarray
    ) -> np.ndarray | None:
        """The lagging layers whose step per unit of gradient (‖Δw‖/‖g‖) is ``unexplained``
        times below the median of the other weight matrices' (the class docstring); None
        while no gradient norms of these layers have arrived (a sample can arrive before
        its steps' batch)."""
        grads, norms = self._grads, stats.weight_norms
        if lagging.size == 0 or self.unexplained <= 1.0:
            return lagging
        if grads is None or grads[0] != stats.layers:
            return None
        if norms is None or len(norms) != ratios.size:
            return lagging
        with np.errstate(divide="ignore", invalid="ignore"):
            steps = np.log10(ratios * np.asarray(norms, dtype=np.float64)) - grads[1]
        others = weight.copy()
        others[lagging] = False
        known = others & np.isfinite(steps)
        if not known.any():
            return lagging
        reference = float(np.median(steps[known]))
        # A lagging layer whose step is not known (no finite gradient norm yet) counts.
        kept = ~(steps[lagging] >= reference - math.log10(self.unexplained))
        result: np.ndarray = lagging[kept]
        return result
