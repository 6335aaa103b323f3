"""Weight detectors on cadence statistics (seed Stage 4; TheDeepChecker's weight checks).

* :class:`WeightRunawayDetector` -- "weight histograms with runaway magnitude
  indicate insufficient regularization or an exploding-gradient regime that
  the optimizer partially absorbed". Runaway is *geometric* growth of the
  total weight norm: a steady factor per sample that does not slow down.
  Healthy growth (random-walk diffusion without weight decay grows like
  sqrt(t); warm-up growth saturates) decelerates, which the fit rejects.
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
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.growth import fit_line, total_grad_norm
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Stats, Step

# The most cadence samples a weight-runaway window may hold: min_span steps at the
# agent's densest steady cadence (every step) would need more, but the early dense
# phase lasts ~20 samples (agent/cadence.py) and later ones are stats_every apart.
_MAX_SPAN_SAMPLES = 64
# "Since the start" only for a run seen from (near) its first step, as LossFlatFromStart's
# max_first_step: a resumed converged run is flat and moves little, and is healthy.
_FIRST_STEP_MAX = 10


class WeightRunawayDetector:
    """Active while the total weight norm grows geometrically over ``window`` cadence samples.

    The window is the newest ``window`` samples, widened to the newest ones
    spanning at least ``min_span`` steps (the agent samples densely at the start
    of a run, where weights grow out of their init; a fixed count of samples would
    span a different number of steps at every cadence). Conditions: growth of at
    least ``min_growth`` across the window, a straight line in log(norm) against
    the step (R² >= ``min_r2``), and the newest half still growing at
    ``min_recent`` of the window's rate (no deceleration).

    Example::

        det = WeightRunawayDetector(window=8, min_growth=2.0)
        det.observe_stats(stats).evidence["factor_per_sample"]
    """

    @validated_params
    def __init__(
        self,
        *,
        window: Annotated[int, Field(ge=4)] = 8,
        min_growth: Annotated[float, Field(gt=1.0)] = 2.0,
        min_r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.95,
        min_recent: Annotated[float, Field(ge=0.0)] = 0.8,
        min_span: Annotated[int, Field(ge=0)] = 0,
    ) -> None:
        self.window, self.min_growth, self.min_r2, self.min_recent = (
            window,
            min_growth,
            min_r2,
            min_recent,
        )
        self.min_span = min_span
        # Enough samples to span min_span steps at a dense cadence, still bounded.
        keep = max(window, _MAX_SPAN_SAMPLES)
        self._steps: deque[int] = deque(maxlen=keep)
        self._logs: deque[float] = deque(maxlen=keep)
        self._layers: deque[np.ndarray] = deque(maxlen=keep)
        self._names: tuple[str, ...] = ()

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no weight norms."""
        if stats.weight_norms is None:
            return None
        norms = np.asarray(stats.weight_norms, dtype=np.float64)
        if norms.size == 0 or not np.isfinite(norms).all():
            return None  # non-finite weights are the non-finite rule's
        total = math.sqrt(float(np.dot(norms, norms)))
        if total <= 0.0:
            return None
        if stats.layers != self._names or (self._layers and self._layers[-1].size != norms.size):
            # Another model layout (or the first sample): the old samples compare to nothing.
            self._steps.clear()
            self._logs.clear()
            self._layers.clear()
            self._names = stats.layers
        self._steps.append(stats.step)
        self._logs.append(math.log(total))
        self._layers.append(norms)
        n = self._window_size()
        return self._judge(total, n) if n else INACTIVE

    def _window_size(self) -> int:
        """How many of the newest samples make the window; 0 while too few or too short."""
        steps = self._steps
        if len(steps) < self.window:
            return 0
        newest = steps[-1]
        for n in range(self.window, len(steps) + 1):
            if newest - steps[-n] >= self.min_span:
                return n
        return 0  # dense early samples: a warm-up or waking weights, not a runaway trend

    def _judge(self, total: float, n: int) -> Finding:
        steps = list(self._steps)[-n:]
        # Against the step, not the sample index: early samples are dense, and growth
        # that slows in time would look straight over the index.
        x = np.asarray(steps, dtype=np.float64)
        y = np.asarray(list(self._logs)[-n:], dtype=np.float64)
        slope, r2 = fit_line(x, y)
        half = n // 2
        recent, _ = fit_line(x[-half:], y[-half:])
        growth = math.exp(min(y[-1] - y[0], 700.0))
        if (
            growth < self.min_growth
            or r2 < self.min_r2
            or slope <= 0
            or recent < self.min_recent * slope
        ):
            return INACTIVE
        per_sample = math.exp(min(slope * (steps[-1] - steps[0]) / (n - 1), 700.0))
        first, last = self._layers[-n], self._layers[-1]
        # Layers with a non-trivial share of the weights: a zero-initialised bias "grows"
        # infinitely.
        big = first >= 0.01 * float(first.max())
        ratios = np.where(big, last / np.where(first > 0, first, 1.0), 0.0)
        top = int(np.argmax(ratios))
        layer = self._names[top] if top < len(self._names) else f"#{top}"
        summary = (
            f"weight norm growing without bound: total {total:.4g} grew ×{growth:.2f} over {n} "
            f"samples (×{per_sample:.3f} per sample, steps {steps[0]}–{steps[-1]}); "
            f"fastest layer {layer!r} ×{float(ratios[top]):.2f}"
        )
        evidence = {
            "weight_norm": total,
            "growth": growth,
            "factor_per_sample": per_sample,
            "r2": r2,
            "since_step": steps[0],
            "fastest_layer": layer,
            "fastest_layer_growth": float(ratios[top]),
        }
        return Finding(True, summary, evidence)


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
        if stats.update_ratios is None:
            return None
        ratios = np.asarray(stats.update_ratios, dtype=np.float64)
        finite = np.isfinite(ratios)
        if not finite.any():
            return None
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
        inside = [(s, v) for s, v in self._losses if start <= s <= end]
        if len(inside) < 10:
            return False  # too few losses to tell: judge on the updates alone
        fifth = max(3, len(inside) // 5)
        first = float(np.median([v for _, v in inside[:fifth]]))
        last = float(np.median([v for _, v in inside[-fifth:]]))
        return last <= (1.0 - self.min_progress) * first

    def _learned(self) -> bool:
        """True unless the latest losses sit within ``min_progress`` of the run's first ones."""
        if len(self._start) < 10 or len(self._losses) < 10:
            return True  # too few losses to say it did not learn
        if self._start_step is None or self._start_step > _FIRST_STEP_MAX:
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


class LaggingLayersDetector:
    """Active while some weight matrices update ``factor`` times slower than the model's fast ones.

    ‖Δw‖/‖w‖ per layer, on weight matrices only (roles as for the layer ratio:
    norm gains, biases and embeddings move at rates of their own). A layer far
    below the others learns ~``factor`` times slower: a param group with a
    wrong learning rate, or gradients vanishing before they reach it. The
    reference is the upper decile of the layers' ratios, not their median:
    when most layers lag (every hidden layer of an MLP behind its head), the
    median is a lagging layer itself. Healthy spreads are narrow (at most 4.9x
    between the fastest and the slowest weight matrix on the nanoGPT-
    architecture trial). Layers below ``low`` are frozen (LayersFrozen's) and
    left out.

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
    ) -> None:
        self.factor, self.low, self.samples = factor, low, samples
        self.min_layers, self.max_named = min_layers, max_named
        self._sent: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._held = 0
        self._since: int | None = None

    def observe(self, step: Step) -> None:
        """Keep the roles the agent sent with the step's layers, for the next cadence sample."""
        if step.layer_roles:
            self._sent = (step.layers, step.layer_roles)

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no usable update ratios."""
        if stats.update_ratios is None or len(stats.layers) != np.asarray(stats.update_ratios).size:
            return None
        ratios = np.asarray(stats.update_ratios, dtype=np.float64)
        roles = roles_of(stats.layers, self._sent[1] if self._sent[0] == stats.layers else ())
        weight = (
            np.array([r == "weight" for r in roles]) & np.isfinite(ratios) & (ratios >= self.low)
        )
        if int(weight.sum()) < self.min_layers:
            return None
        logs = np.log10(ratios[weight])
        median = float(np.median(logs))
        upper = float(np.quantile(logs, 0.9, method="higher"))  # a layer, not between two
        lagging = np.flatnonzero(weight)[logs < upper - math.log10(self.factor)]
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
        return Finding(True, summary, evidence)


class SmallInitDetector:
    """Active once the weight matrices' total norm grew ``growth`` times over the first sample.

    Weights initialised far too small (nanoGPT with its init scaled by 0.01)
    "wake up": their norm, and the gradients' with it, grows by orders of
    magnitude towards the scale a standard init starts at, and the run learns
    late. Healthy runs from a standard init change their total weight norm by a
    small factor (x2.06 over 1,500 steps of the nanoGPT-architecture trial,
    weight decay included). Only a first sample taken within ``first_step``
    steps of the run describes the init; zero-initialised layers (LoRA's B, a
    zero head) barely move the total of the others, and the median weight
    matrix (of at least ``min_layers``) must have grown as much: a fresh head
    trained alone on a frozen backbone can grow 10x from its small default
    init. And the growth must be settling (at most ``settle`` times over the
    latest half of the run so far): weights that keep growing are exploding,
    not waking. Where grad norms are reported, they must have risen ``wake``
    times from the first steps' too (a small init starts with tiny gradients;
    a too-high lr that inflates the weights starts with normal ones). Weight
    matrices only, as for the layer ratio (roles).

    Example::

        det = SmallInitDetector(growth=10.0)
        det.observe_stats(stats).evidence["growth"]
    """

    @validated_params
    def __init__(
        self,
        *,
        growth: Annotated[float, Field(gt=1.0)] = 10.0,
        first_step: Annotated[int, Field(ge=1)] = 20,
        min_layers: Annotated[int, Field(ge=1)] = 3,
        settle: Annotated[float, Field(gt=1.0)] = 2.0,
        wake: Annotated[float, Field(ge=1.0)] = 3.0,
        max_named: Annotated[int, Field(ge=1)] = 5,
    ) -> None:
        self.growth, self.first_step, self.max_named = growth, first_step, max_named
        self.min_layers, self.settle, self.wake = min_layers, settle, wake
        self._sent: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._first: tuple[int, float, np.ndarray] | None = None
        self._layers: tuple[str, ...] = ()
        self._seen = False
        self._totals: deque[tuple[int, float]] = deque(maxlen=256)
        self._latched = False
        self._first_grads: list[float] = []
        self._grads: deque[float] = deque(maxlen=20)

    def observe(self, step: Step) -> None:
        """Keep the roles the agent sent, and the grad norms of the first and latest steps."""
        if step.layer_roles:
            self._sent = (step.layers, step.layer_roles)
        norm = total_grad_norm(step)
        if norm is not None and math.isfinite(norm) and norm > 0.0:
            if len(self._first_grads) < 3:
                self._first_grads.append(norm)
            self._grads.append(norm)

    def _woke(self) -> bool:
        """The grad norm rose from tiny first steps (a small init); True when never measured."""
        if len(self._first_grads) < 3 or not self._grads:
            return True  # no grad norms in this stream: judge on the weights alone
        return float(np.median(self._grads)) >= self.wake * float(np.median(self._first_grads))

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no usable weight norms."""
        if stats.weight_norms is None or len(stats.layers) != np.asarray(stats.weight_norms).size:
            return None
        norms = np.asarray(stats.weight_norms, dtype=np.float64)
        roles = roles_of(stats.layers, self._sent[1] if self._sent[0] == stats.layers else ())
        weight = np.array([r == "weight" for r in roles])
        if not weight.any() or not np.isfinite(norms[weight]).all():
            return None
        total = math.sqrt(float(np.dot(norms[weight], norms[weight])))
        if not self._seen:
            self._seen = True
            if stats.step <= self.first_step and total > 0.0:
                self._first, self._layers = (stats.step, total, norms), stats.layers
        if self._first is None or stats.layers != self._layers:
            return None  # joined mid-run, or another layout: the init is unknown
        step0, total0, norms0 = self._first
        grown = total / total0
        self._totals.append((stats.step, total))
        with np.errstate(divide="ignore", invalid="ignore"):
            layer_growth = np.where(weight & (norms0 > 0), norms / norms0, 0.0)
        judged = layer_growth[weight & (norms0 > 0)]
        # The whole model, not one fresh layer: a new classifier head trained alone (or a
        # zero-initialised one) can grow 10x from a small default init on its own.
        if (
            grown < self.growth
            or judged.size < self.min_layers
            or float(np.median(judged)) < self.growth
        ):
            return INACTIVE
        if not self._latched and not (self._settling(step0, stats.step, total) and self._woke()):
            return (
                INACTIVE  # still growing fast: exploding weights (lr too high) look the same so far
            )
        self._latched = True  # once seen settling, a later growth spurt does not end the incident
        top = np.argsort(-layer_growth)[: self.max_named]
        names = [stats.layers[i] for i in top if layer_growth[i] >= self.growth]
        summary = (
            f"weights started far too small: the weight matrices' total norm grew ×{grown:.3g} "
            "from "
            f"{total0:.3g} at step {step0} to {total:.3g} at step {stats.step} (a standard init "
            "changes "
            f"it by ~2×); initialisation scale too small"
            + (f" (fastest: {', '.join(repr(n) for n in names)})" if names else "")
            + "? Growth of the gradient norm from tiny values here is the weights waking up, not "
            "an explosion."
        )
        evidence = {
            "growth": grown,
            "settle": self.settle,
            "first_step": step0,
            "first_weight_norm": total0,
            "weight_norm": total,
            "fastest_layers": names,
        }
        return Finding(True, summary, evidence)

    def _settling(self, step0: int, now: int, total: float) -> bool:
        """True when the second half of the run so far grew the norm at most ``settle`` times.

        Waking weights approach the scale they settle at; exploding ones keep
        growing (lr far too high). Growth of 10x overall with at most 2x in the
        latest half is the first shape only.
        """
        half = step0 + (now - step0) / 2.0
        earlier = [t for s_, t in self._totals if s_ <= half]
        return bool(earlier) and total <= self.settle * earlier[-1]
