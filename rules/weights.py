"""Weight-norm detectors on cadence statistics (seed Stage 4; TheDeepChecker's weight checks).

* :class:`WeightRunawayDetector` -- "weight histograms with runaway magnitude
  indicate insufficient regularization or an exploding-gradient regime that
  the optimizer partially absorbed". Runaway is *geometric* growth of the
  total weight norm: a steady factor per sample that does not slow down.
  Healthy growth (random-walk diffusion without weight decay grows like
  sqrt(t); warm-up growth saturates) decelerates, which the fit rejects.
* :class:`SmallInitDetector` -- weights initialised far too small "wake up":
  their total norm grows by orders of magnitude, then settles.

The update-size detectors (:class:`UpdateRatioDetector`,
:class:`LaggingLayersDetector`) live in :mod:`gradwatch.rules.updates` and
:mod:`gradwatch.rules.lagging`; they are re-exported here so
``from gradwatch.rules.weights import ...`` keeps working.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.growth import combined_norm, fit_line, total_grad_norm
from gradwatch.rules.lagging import LaggingLayersDetector
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Stats, Step
from gradwatch.rules.updates import Direction, UpdateRatioDetector, model_update_ratio

__all__ = [
    "Direction",
    "finite_weight_norms",
    "LaggingLayersDetector",
    "SmallInitDetector",
    "UpdateRatioDetector",
    "WeightRunawayDetector",
]

# The most cadence samples a weight-runaway window may hold: min_span steps at the
# agent's densest steady cadence (every step) would need more, but the early dense
# phase lasts ~20 samples (agent/cadence.py) and later ones are stats_every apart.
_MAX_SPAN_SAMPLES = 64
# SmallInitDetector: this many steps without a gradient norm is a stream that has none
# (a log of losses): the weights alone decide. Fewer, and the norms may be on their way
# (cadence samples arrive before their steps' batch, flush_every 10 steps apart).
NO_GRADS_AFTER = 3


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
        large_update: Annotated[float, Field(gt=0.0)] = 0.03,
        min_step_growth: Annotated[float, Field(ge=0.0)] = 0.0,
    ) -> None:
        self.large_update, self.min_step_growth = large_update, min_step_growth
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
        # Each sample's ‖Δw‖/‖w‖ over the model (NaN: not measured), to say what drives a runaway.
        self._ratios: deque[float] = deque(maxlen=keep)
        self._names: tuple[str, ...] = ()

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no weight norms."""
        norms = finite_weight_norms(stats)
        if norms is None:
            return None
        total = combined_norm(norms)
        if total <= 0.0:
            return None
        if stats.layers != self._names or (self._layers and self._layers[-1].size != norms.size):
            # Another model layout (or the first sample): the old samples compare to nothing.
            self._steps.clear()
            self._logs.clear()
            self._layers.clear()
            self._ratios.clear()
            self._names = stats.layers
        self._steps.append(stats.step)
        self._logs.append(math.log(total))
        self._layers.append(norms)
        self._ratios.append(_model_ratio(stats, norms))
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

    def _fixed_steps(self, n: int) -> bool:
        """Whether the window's steps ‖Δw‖ (ratio x norm) stayed the same size while the norm
        grew: ``min_step_growth`` or less from its older half to its newer. Fixed-size steps
        add up to a norm that grows linearly, as a zero-initialised table learns (karpathy/
        makemore's bigram: x2.01 in 350 steps, its steps x0.99); growth that feeds itself
        grows its steps with it (every runaway at hand: x1.9 to x278). Unmeasured: False."""
        if self.min_step_growth <= 0.0:
            return False
        steps = np.exp(np.asarray(list(self._logs)[-n:])) * np.asarray(list(self._ratios)[-n:])
        older, newer = steps[: n // 2], steps[n // 2 :]
        older, newer = older[np.isfinite(older)], newer[np.isfinite(newer)]
        if not older.size or not newer.size or float(np.median(older)) <= 0.0:
            return False
        return float(np.median(newer)) < self.min_step_growth * float(np.median(older))

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
            or self._fixed_steps(n)
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
        evidence: dict[str, object] = {
            "weight_norm": total,
            "growth": growth,
            "factor_per_sample": per_sample,
            "r2": r2,
            "since_step": steps[0],
            "fastest_layer": layer,
            "fastest_layer_growth": float(ratios[top]),
        }
        # The newest half of the window, as the no-deceleration test reads it: what drives
        # the growth now (a warm-up's small early steps say nothing about it; Lightning's
        # one-cycle lr x100 read 0.013-0.018 on its first half, 0.027-0.045 on its newest).
        measured = [r for r in list(self._ratios)[-max(half, 1) :] if math.isfinite(r)]
        if measured:
            update = float(np.median(measured))
            evidence["update_ratio"] = update
            if update >= self.large_update:
                # Weight decay cannot hold weights that each step moves by percents: the
                # step size is the lever (nanoGPT lr x100 read "weight decay" first here).
                summary += (
                    f"; each update moves the weights by {update:.3g} of their norm (median "
                    "over the newest half of the window; healthy ~1e-3): steps this large "
                    "drive the growth"
                )
                evidence["lead_check"] = "lower the learning rate"
        return Finding(True, summary, evidence)


def finite_weight_norms(stats: Stats) -> np.ndarray | None:
    """The sample's weight norms as float64; None when absent, empty or not all finite
    (non-finite weights are the non-finite rule's)."""
    if stats.weight_norms is None:
        return None
    norms = np.asarray(stats.weight_norms, dtype=np.float64)
    return norms if norms.size and np.isfinite(norms).all() else None


def _model_ratio(stats: Stats, norms: np.ndarray) -> float:
    """The sample's ‖Δw‖/‖w‖ over the model (updates.model_update_ratio); NaN if unmeasured."""
    if stats.update_ratios is None or np.shape(stats.update_ratios) != norms.shape:
        return math.nan
    ratio = model_update_ratio(stats)
    return math.nan if ratio is None else ratio


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
        # The first sample's step and per-layer norms, and every later one's: per layer
        # while the roles are not yet sent (they arrive a step batch after the first
        # samples; each judgment sums the matrices under the roles known then, so the
        # start and now add up the same layers), then as the matrices' total under the
        # sent roles: 256 arrays of a 300-tensor model were 600 KiB a rank, the totals
        # 256 floats.
        self._first: tuple[int, np.ndarray] | None = None
        self._layers: tuple[str, ...] = ()
        self._seen = False
        self._kept: deque[tuple[int, np.ndarray | float]] = deque(maxlen=256)
        self._latched = False
        self._first_grads: list[float] = []
        self._grads: deque[float] = deque(maxlen=20)
        self._steps = 0  # steps observed
        self._unsupervised = False

    def loss_not_supervised(self) -> None:
        """The job's loss is no supervised loss (rules/engine.py): its targets are not fixed,
        so weights that grow ten-fold say nothing of the init. A DQN's values grow with the
        returns: CleanRL's dqn.py at lr x100 grew its weights x38 from a standard init and
        was told "weights started far too small"."""
        self._unsupervised = True

    def observe(self, step: Step) -> None:
        """Keep the roles the agent sent, and the grad norms of the first and latest steps."""
        if step.layer_roles:
            self._sent = (step.layers, step.layer_roles)
        self._steps += 1
        norm = total_grad_norm(step)
        if norm is not None and math.isfinite(norm) and norm > 0.0:
            if len(self._first_grads) < 3:
                self._first_grads.append(norm)
            self._grads.append(norm)

    def _woke(self) -> bool:
        """The grad norm rose from tiny first steps (a small init); True when never measured.

        Not yet measured is not never: a cadence sample often arrives before its steps'
        batch, and pytorch/examples' actor-critic at lr x100 (its weights x21 in two
        updates, then flat) was read as waking at step 3, before any of its gradient
        norms had arrived.
        """
        if len(self._first_grads) >= 3 and self._grads:
            return float(np.median(self._grads)) >= self.wake * float(np.median(self._first_grads))
        # Steps came and none carried a gradient norm: the stream has none (a log of
        # losses), so the weights alone decide.
        return not self._first_grads and self._steps >= NO_GRADS_AFTER

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no usable weight norms."""
        if self._unsupervised:
            return INACTIVE  # resolves what fired before the declaration arrived
        if stats.weight_norms is None or len(stats.layers) != np.asarray(stats.weight_norms).size:
            return None
        norms = np.asarray(stats.weight_norms, dtype=np.float64)
        roles = roles_of(stats.layers, self._sent[1] if self._sent[0] == stats.layers else ())
        weight = np.array([r == "weight" for r in roles])
        if not weight.any() or not np.isfinite(norms[weight]).all():
            return None
        if not self._seen:
            self._seen = True
            if stats.step <= self.first_step:
                self._first, self._layers = (stats.step, norms), stats.layers
        if self._first is None or stats.layers != self._layers:
            return None  # joined mid-run, or another layout: the init is unknown
        step0, norms0 = self._first
        total, total0 = combined_norm(norms[weight]), combined_norm(norms0[weight])
        self._kept.append((stats.step, total if self._sent[0] == stats.layers else norms))
        if not total0 > 0.0:
            return INACTIVE  # the matrices started at zero (or unmeasured): no scale to grow from
        grown = total / total0
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
        if not self._latched and not (
            self._settling(step0, stats.step, total, weight) and self._woke()
        ):
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

    def _settling(self, step0: int, now: int, total: float, weight: np.ndarray) -> bool:
        """True when the second half of the run so far grew the norm at most ``settle`` times.

        Waking weights approach the scale they settle at; exploding ones keep
        growing (lr far too high). Growth of 10x overall with at most 2x in the
        latest half is the first shape only.
        """
        half = step0 + (now - step0) / 2.0
        earlier = [kept for s_, kept in self._kept if s_ <= half]
        if not earlier:
            return False
        then = earlier[-1]
        return total <= self.settle * (
            combined_norm(then[weight]) if isinstance(then, np.ndarray) else then
        )
