"""A job's bounded history for the diagnosis, and the precursors found in it.

:class:`JobHistory` keeps what the seed's ``diagnose`` tree reads (recent
losses, grad norms, evaluations, the latest non-finite value) and marks
*precursors*: the first step each warning sign appeared in its latest episode
(layer ratio beyond 100, early-layer norms collapsing, activations saturating,
ReLUs dying, grad norm or weights growing 100x/10x, loss scale at 1, update
ratio > 0.1). The tree and the text built from it are in
:mod:`gradwatch.rules.diagnosis`, which re-exports these names.

Memory is bounded: fixed-size deques and one record per precursor signal.

Example::

    history = JobHistory()
    for step in steps:
        history.observe_step(step)
    history.precursors["layer_ratio"].step   # where the ratio first went past 100:1
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradwatch.rules.detector import is_amp_skip
from gradwatch.rules.growth import GradWake, total_grad_norm
from gradwatch.rules.ratio import LayerEnds
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Eval, Stats, Step
from gradwatch.rules.updates import model_update_ratio

LARGE_NORM = 1.0  # nanoGPT's grad_clip and HF Trainer's max_grad_norm default
RATIO_LIMIT = 2.0  # seed Stage 3: two orders of magnitude between first and last layers
SATURATED = (
    0.5  # share of tanh/sigmoid outputs pinned near the bounds (smdebug threshold_layer 50%)
)
DEAD = 0.9  # share of exact-zero ReLU outputs (healthy nets have ~50%)
# Share of GELU/SiLU outputs in the flat negative tail, as DeadGELUs' threshold
# (rules/default.yaml): healthy nanoGPT <= 0.018, lr x100 0.80; a layer of tiny
# pre-activations (nanoGPT init x0.01) reads 0.50-0.52 at its first steps, which at 0.5
# was named the earlier cause of that run's alerts, with "lower the learning rate".
DEAD_TAIL = 0.7
EPISODE_GAP = 200  # steps a precursor may pause before a new episode starts
SMALL_INIT_STEPS = (
    20  # a first weight sample this early describes the init (WeightsStartedTooSmall)
)
# As WeightsStartedTooSmall's ``wake`` (rules/default.yaml): weights grown 10x are a small
# init only if the grad norm also rose 3x from its first 3 steps at some point within the
# first WAKE_STEPS steps (nanoGPT init x0.01: x13.7 by step 23). nanoGPT lr x100 starts at
# the healthy ~5 and falls to ~0.4 while its weights grow x12: calling that
# "initialisation too small" contradicted its real cause. A rise later is no init's.
WAKE = 3.0
WAKE_STEPS = 200
# UpdateRatioTooLarge's ``high`` (rules/default.yaml, calibrated on nanoGPT: healthy peak
# 0.0056, lr x100 0.022-0.056): weights growing under updates this large grow by the lr.
LARGE_UPDATE = 0.03


@dataclass(slots=True)
class Precursor:
    """One warning sign's latest episode: where it began, its worst value, when it last held."""

    signal: str
    category: str
    step: int
    value: float
    detail: str
    peak: float
    peak_step: int
    last_step: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "class": self.category,
            "step": self.step,
            "value": self.value,
            "peak": self.peak,
            "peak_step": self.peak_step,
            "summary": self.detail,
        }


class JobHistory:
    """Bounded history of one job (its lowest-numbered reporting rank) for the diagnosis."""

    def __init__(
        self, steps: int = 1024, evals: int = 256, stats: int = 256, head: int = 64
    ) -> None:
        self.losses: deque[tuple[int, float]] = deque(maxlen=steps)
        self.norms: deque[tuple[int, float]] = deque(maxlen=steps)
        self.head: list[float] = []
        self.head_size = head
        self.first_step: int | None = None
        self.latest_step: int | None = None
        # A loss below zero or declared unsupervised: a vanishing layer ratio names no cause.
        self.unsupervised = False
        self.nonfinite: tuple[int, str, float] | None = None  # latest (step, signal, value)
        self.evals: deque[tuple[int, float, float | None]] = deque(maxlen=evals)
        self.weight_norms: deque[tuple[int, float]] = deque(maxlen=stats)
        self.precursors: dict[str, Precursor] = {}
        self._early_norms: list[float] = []
        self._wake = GradWake(WAKE, WAKE_STEPS)  # a small init's gradients waking up
        self._early_first: list[float] = []
        self._first_weight: float | None = None
        self._first_weight_step = 0
        self._roles: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._ratios: deque[float] = deque(maxlen=5)
        self._ends = LayerEnds()

    # ------------------------------------------------------------ inputs

    def observe_step(self, step: Step) -> None:
        """Take one step of the job's reporting rank into account."""
        if self.first_step is None:
            self.first_step = step.step
        self.latest_step = step.step
        if step.layer_roles:
            self._roles = (step.layers, step.layer_roles)
        if is_amp_skip(step):
            return  # overflow by design, recovered by the scaler
        if step.loss_scale is not None and step.loss_scale <= 1.0:
            self._mark(
                "loss_scale_floor",
                "loss_scale_collapse",
                step.step,
                step.loss_scale,
                f"AMP loss scale down to {step.loss_scale:g}",
                high=False,
            )
        loss = step.loss
        if loss is not None:
            self.unsupervised = self.unsupervised or -math.inf < loss < 0.0
            if math.isfinite(loss):
                self.losses.append((step.step, loss))
                if len(self.head) < self.head_size:
                    self.head.append(loss)
            else:
                self.nonfinite = (step.step, "loss", loss)
        norm = total_grad_norm(step)
        if norm is not None:
            if math.isfinite(norm):
                self._observe_norm(step.step, norm)
            elif self.nonfinite is None or self.nonfinite[0] != step.step:
                self.nonfinite = (step.step, "grad_norm", norm)
        if step.layer_norms.size:
            self._observe_layers(step)

    def observe_towers(self, layers: tuple[str, ...], towers: tuple[int, ...]) -> None:
        """The model's towers (census): the layer ratio it quotes is taken within one."""
        self._ends.set_towers(layers, towers)

    def observe_stats(self, stats: Stats) -> None:
        """Take one cadence sample into account: activations, weight norms, update ratios."""
        update = model_update_ratio(stats)
        for act in stats.act:
            if (
                act.sat_frac is not None
                and act.kind in ("tanh", "sigmoid")
                and act.sat_frac >= SATURATED
            ):
                self._mark(
                    "activation_saturation",
                    "saturation",
                    stats.step,
                    act.sat_frac,
                    f"{act.kind} outputs of {act.module!r} {act.sat_frac:.0%} saturated",
                )
            dead = (
                DEAD
                if act.kind in ("relu", "relu6")
                else DEAD_TAIL
                if act.kind in ("gelu", "silu")
                else None
            )
            if act.zero_frac is not None and dead is not None and act.zero_frac >= dead:
                what = (
                    "exactly zero" if act.kind in ("relu", "relu6") else "in the flat negative tail"
                )
                self._mark(
                    "dead_units",
                    "dead_units",
                    stats.step,
                    act.zero_frac,
                    f"{act.kind} outputs of {act.module!r} {act.zero_frac:.0%} {what}",
                )
        if stats.weight_norms is not None:
            w = np.asarray(stats.weight_norms, dtype=np.float64)
            if w.size and np.isfinite(w).all():
                w = w[
                    self._matrices(stats.layers, w.size)
                ]  # LayerNorm gains start at 1 whatever the init
                total = math.sqrt(float(np.dot(w, w)))
                self.weight_norms.append((stats.step, total))
                if self._first_weight is None:
                    self._first_weight, self._first_weight_step = total, stats.step
                elif self._first_weight > 0 and total >= 10 * self._first_weight:
                    grown = total / self._first_weight
                    if self._first_weight_step <= SMALL_INIT_STEPS and self._grads_woke():
                        # Grown 10x from the init itself, the gradients with them: weights
                        # waking up from a too-small init.
                        self._mark(
                            "small_init",
                            "vanishing_gradients",
                            stats.step,
                            grown,
                            f"total weight norm ×{grown:.0f} its value at step "
                            f"{self._first_weight_step}"
                            " (initialisation too small)",
                        )
                    elif update is not None and update >= LARGE_UPDATE:
                        # Moved by percents every step: the step size grows them, and the
                        # weight-runaway class would lead with weight decay.
                        self._mark(
                            "weight_growth",
                            "update_ratio",
                            stats.step,
                            grown,
                            f"total weight norm ×{grown:.0f} its first value under updates of "
                            f"{update:.2g} of the weights per step (healthy ~1e-3)",
                        )
                    else:
                        self._mark(
                            "weight_growth",
                            "weight_runaway",
                            stats.step,
                            grown,
                            f"total weight norm ×{grown:.0f} its first value",
                        )
        if update is not None and update > 0.1:
            self._mark(
                "update_ratio_high",
                "update_ratio",
                stats.step,
                update,
                f"‖Δw‖/‖w‖ {update:.3g} over the model (healthy ~1e-3)",
            )

    def _grads_woke(self) -> bool:
        """The grad norm woke up early in the run (GradWake); True when none was measured."""
        return not self._wake.measured or self._wake.woken

    def _matrices(self, layers: tuple[str, ...], size: int) -> np.ndarray:
        """Mask of the weight matrices among ``layers`` (every layer when none is known as one)."""
        if len(layers) != size:
            return np.ones(size, dtype=bool)
        roles = roles_of(layers, self._roles[1] if self._roles[0] == layers else ())
        mask = np.array([r == "weight" for r in roles], dtype=bool)
        return mask if mask.any() else np.ones(size, dtype=bool)

    def observe_eval(self, ev: Eval) -> None:
        """Take one evaluation into account, with the training level at that time."""
        if ev.loss is None or not math.isfinite(ev.loss):
            return
        recent = [v for _, v in list(self.losses)[-50:]]
        self.evals.append(
            (ev.step, ev.loss, statistics.median(recent) if len(recent) >= 5 else None)
        )

    # ------------------------------------------------------------ precursors

    def _observe_norm(self, step: int, norm: float) -> None:
        self.norms.append((step, norm))
        self._wake.observe(step, norm)
        if len(self._early_norms) < 10:
            self._early_norms.append(norm)
            return
        base = statistics.median(self._early_norms)
        # Growth from a tiny start towards a normal level (weights waking up) is no explosion:
        # the norm must also be large (the growth rule's min_norm, where clipping starts).
        if base > 0 and norm >= 100 * base and norm >= LARGE_NORM:
            self._mark(
                "grad_norm_growth",
                "exploding_gradients",
                step,
                norm / base,
                f"total grad norm ×{norm / base:.0f} its early level",
            )

    def _observe_layers(self, step: Step) -> None:
        # The same ends as the ratio rule: weight matrices, not norm gains or tied embeddings.
        end = self._ends.measure(step)
        if end is None:
            return
        self._ratios.append(end.log_ratio)
        if len(self._ratios) == self._ratios.maxlen:
            log_ratio = statistics.median(self._ratios)
            # Not vanishing under a loss that is no supervised one: LayerGradNormRatioVanishing
            # lets go there too (rules/ratio.py: a critic regressing growing returns).
            vanishing = log_ratio < 0
            if abs(log_ratio) >= RATIO_LIMIT and not (vanishing and self.unsupervised):
                ratio = 10.0**log_ratio
                how = f"1:{1 / ratio:.0f}" if vanishing else f"{ratio:.0f}:1"
                self._mark(
                    "layer_ratio",
                    "vanishing_gradients" if vanishing else "exploding_gradients",
                    step.step,
                    ratio,
                    f"first/last layer grad-norm ratio {how} ({end.first!r} vs {end.last!r})",
                    high=not vanishing,
                )
        if len(self._early_first) < 10:
            self._early_first.append(end.first_norm)
        elif (
            end.first_norm < 1e-2 * statistics.median(self._early_first) and not self._converging()
        ):
            # A loss that fell 10x shrinks every gradient with it (a memorized batch does):
            # that is convergence, not the first layer's gradient vanishing.
            drop = end.first_norm / statistics.median(self._early_first)
            self._mark(
                "first_layer_collapse",
                "vanishing_gradients",
                step.step,
                drop,
                f"first layer's grad norm fell to {drop:.2g}× its early level",
                high=False,
            )

    def _converging(self) -> bool:
        if len(self.head) < 10 or len(self.losses) < 3:
            return False
        start = statistics.median(self.head[:10])
        level = statistics.median(v for _, v in list(self.losses)[-3:])  # the gradients' loss now
        return level <= 0.1 * abs(start)

    def _mark(
        self, signal: str, category: str, step: int, value: float, detail: str, high: bool = True
    ) -> None:
        mark = self.precursors.get(signal)
        if mark is None or step - mark.last_step > EPISODE_GAP or step < mark.step:
            self.precursors[signal] = Precursor(
                signal, category, step, value, detail, value, step, step
            )
            return
        mark.last_step = step
        if (value > mark.peak) if high else (value < mark.peak):
            mark.peak, mark.peak_step = value, step
            if category == mark.category:
                # The same reading, larger. Another class (weight growth that began under
                # large updates and goes on under small ones) keeps the words of its own.
                mark.detail = detail
