"""Vanishing-gradient detector: every gradient is ~0 while the loss is far from converged.

The seed's ``diagnose``: ``all(n < 1e-6 for n in norms[-50:]) and not
converged(losses)`` -> "vanishing gradients: check activation saturation,
depth, residuals". The total norm is below the threshold exactly when every
layer's is too small to matter, so the detector reads the total (the
reported ``grad_norm``, else the root sum of squares of the layer norms).

"Converged" is not defined by the seed. Here the loss is converged when its
recent median is at most ``converged_fraction`` of where it started, or below
``converged_loss`` in absolute terms: a run that solved its task may have
tiny gradients legitimately. Without a measured loss convergence cannot be
told, and the detector stays quiet.

Gradients that are *exactly* zero everywhere did not vanish through depth:
nothing reached the parameters at all (a detached graph, ``zero_grad()``
between ``backward()`` and ``step()``, a loss built from constants). That is a
dead pipeline, :class:`ZeroGradientsDetector`'s, and the vanishing detector
leaves such steps out.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Annotated

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.growth import total_grad_norm
from gradwatch.rules.loss import finite_loss
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Step

# ZeroGradientsDetector: a loss at or below this share of the last one that had a gradient
# has fallen to ~0 with the gradients (REINFORCE at lr x100: 0.13 -> 8.5e-14, a share of
# 6.5e-13; a learning step moves a loss by percents, float32 resolves 1.2e-7 of it).
COLLAPSED = 1e-6


class VanishingGradientDetector:
    """Active while the total grad norm stayed below ``threshold`` for ``window`` steps, the loss
    not converged.

    Example::

        det = VanishingGradientDetector(window=50, threshold=1e-6)
        det.observe(step).evidence["max_grad_norm"]
    """

    @validated_params
    def __init__(
        self,
        *,
        window: Annotated[int, Field(ge=1)] = 50,
        threshold: Annotated[float, Field(gt=0.0)] = 1e-6,
        converged_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1,
        converged_loss: Annotated[float, Field(ge=0.0)] = 1e-3,
        head: Annotated[int, Field(ge=1)] = 10,
    ) -> None:
        self.window, self.threshold = window, threshold
        self.converged_fraction, self.converged_loss, self.head = (
            converged_fraction,
            converged_loss,
            head,
        )
        self._norms: deque[float] = deque(maxlen=window)
        self._losses: deque[float] = deque(maxlen=window)
        self._head: list[float] = []

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None (no new verdict) without a finite, non-zero total grad norm."""
        loss = finite_loss(step)
        if loss is not None:
            if len(self._head) < self.head:
                self._head.append(loss)
            self._losses.append(loss)
        norm = total_grad_norm(step)
        if is_amp_skip(step) or norm is None or not math.isfinite(norm) or norm == 0.0:
            return None  # exact zeros: ZeroGradientsDetector's
        self._norms.append(norm)
        return self._judge(step)

    def _judge(self, step: Step) -> Finding:
        if (
            len(self._norms) < self.window
            or not self._head
            or len(self._losses) < min(self.window, 5)
        ):
            return INACTIVE
        largest = max(self._norms)
        if largest >= self.threshold:
            return INACTIVE
        start = statistics.median(self._head)
        level = statistics.median(self._losses)
        if level <= self.converged_loss or level <= self.converged_fraction * abs(start):
            return INACTIVE  # converged: tiny gradients are expected
        progress = f", {level / start:.0%} of where it started" if start else ""
        summary = (
            f"gradients vanished: total grad norm below {self.threshold:g} for {self.window} steps "
            f"(largest {largest:.3g}) while the loss is still {level:.4g}{progress}"
        )
        evidence = {
            "max_grad_norm": largest,
            "threshold": self.threshold,
            "window": self.window,
            "loss": level,
            "start_loss": start,
            "step": step.step,
        }
        return Finding(True, summary, evidence)


class ZeroGradientsDetector:
    """Active on an optimizer step where every gradient was exactly zero.

    Exactly zero means no gradient reached any parameter (the agent reports a
    parameter whose ``.grad`` is None as 0.0). Only the agent's per-layer norms
    count: a total norm a loop logged can read 0.0 when it was not measured
    (real Hugging Face logs under DeepSpeed report 0.0 on every other log of a
    healthy run). Steps the optimizer skipped (OptimizerIdle's) and GradScaler
    overflow skips give no verdict. The rule's ``for`` says how many such
    steps in a row page.

    What it says depends on what came before. Zero from the run's first step is
    the loop (a detached graph, ``zero_grad()`` between ``backward()`` and
    ``step()``). Zero right after steps that had gradients, with the loss fallen
    to ~0 with them (``COLLAPSED`` of the loss before), is the model's outputs
    pinned exactly where the loss wants them by one update: pytorch/examples'
    REINFORCE at lr x100 had gradients of 1.7-13.6 at step 1, then exactly 0 and
    a loss of ~1e-14 (a policy made deterministic) from step 2, and was told to
    check ``zero_grad()`` (benchmarks/pex_trial.py). Zero after gradients with the
    loss still where it was is the loop changed at that step.

    Example::

        det = ZeroGradientsDetector()
        det.observe(step).active   # True when every gradient norm is 0.0
    """

    def __init__(self) -> None:
        self._since: int | None = None
        # The latest step that had a gradient, and its loss (None: not logged).
        self._live: tuple[int, float | None] | None = None

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None without per-layer gradient norms or on an optimizer skip."""
        norms = step.layer_norms
        if step.skipped or norms.size == 0 or not np.isfinite(norms).all():
            return None
        if norms.any():
            self._since = None
            self._live = (step.step, finite_loss(step))
            return INACTIVE
        if self._since is None:
            self._since = step.step
        evidence: dict[str, object] = {"since_step": self._since, "layers": int(norms.size)}
        if self._live is not None:
            return self._after_gradients(step, evidence, *self._live)
        if step.loss == 0.0:
            # The loss itself is flat: pytorch/examples' DDP tutorial takes cross-entropy of
            # a one-column output (benchmarks/ddp_trial.py); log_softmax over one class is 0.
            summary = (
                f"every gradient is exactly zero since step {self._since}, and so is the "
                "loss: the loss is a constant (cross-entropy over a single class or column, "
                "every label masked or ignored, a loss multiplied by 0?)"
            )
            evidence["lead_check"] = (
                "does the loss depend on the model's outputs? (a loss of exactly 0 with no "
                "gradient: cross-entropy over one class, every label ignored)"
            )
            return Finding(True, summary, evidence)
        summary = (
            f"every gradient is exactly zero since step {self._since}: nothing reaches the "
            "parameters (a detached graph, zero_grad() between backward() and step(), or a "
            "loss built from constants?)"
        )
        return Finding(True, summary, evidence)

    def _after_gradients(
        self, step: Step, evidence: dict[str, object], live_step: int, live_loss: float | None
    ) -> Finding:
        """The finding for zero gradients that follow steps which had them (the class
        docstring): outputs pinned by an update, or the loop changed."""
        loss = finite_loss(step)
        evidence["last_gradient_step"] = live_step
        fell = (
            loss is not None
            and live_loss is not None
            and live_loss != 0.0
            and abs(loss) <= COLLAPSED * abs(live_loss)
        )
        if fell:
            summary = (
                f"every gradient is exactly zero since step {self._since}, right after steps "
                f"that had them (the last at step {live_step}), and the loss fell with them "
                f"from {live_loss:.4g} to {loss:.3g}: an update pinned the model's outputs "
                "exactly where the loss wants them (a policy made deterministic, a softmax or "
                "sigmoid at exactly 0 or 1), leaving nothing to learn from; so sudden a fall "
                "is an update too large, or a margin (hinge, triplet) every example now meets"
            )
            evidence["lead_check"] = (
                f"lower the learning rate: the update of step {live_step} pinned the outputs "
                "(a softmax or a policy at exactly 0 or 1 passes no gradient)"
            )
            return Finding(True, summary, evidence)
        summary = (
            f"every gradient is exactly zero since step {self._since}, after steps that had "
            f"them (the last at step {live_step})"
            + (f", while the loss is still {loss:.4g}" if loss is not None else "")
            + ": the loop stopped passing gradients there (zero_grad() moved between "
            "backward() and step(), a detach or no_grad added, a loss weight scheduled to 0?)"
        )
        evidence["lead_check"] = (
            f"what changed in the loop at step {self._since}: zero_grad() between backward() "
            "and step(), a detach or torch.no_grad(), a loss weight set to 0"
        )
        return Finding(True, summary, evidence)


class WeightsCutOffDetector:
    """Active on a step where no weight matrix gets a gradient any more, but other tensors do.

    A weight matrix (role ``weight``: a linear, convolution or attention projection)
    whose gradient was non-zero before and is now exactly zero, together with every
    other matrix that ever had one, while a bias or a norm gain still learns: no signal
    reaches any unit's input weights. The network is dead upstream of its last biases:
    every ReLU pushed negative by one update too large (pytorch/examples' mnist at lr
    x100: Adadelta's first step took the loss from 2.30 to 54,060 and the next ones left
    only ``fc2.bias`` with a gradient, at chance level for the remaining 1,870 steps), or
    the graph cut before every matrix. The model uses functional ReLUs, so no activation
    statistic could see it.

    Matrices that never had a gradient (frozen on purpose but left in the optimizer: a
    bias-only fine-tune) are not counted; all gradients zero is GradientsAllZero's.
    Optimizer skips and GradScaler overflows give no verdict.

    Example::

        det = WeightsCutOffDetector()
        det.observe(step).evidence["matrices"]
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[str, ...], tuple[str, ...], int] | None = None
        self._matrices = np.empty(0, dtype=np.intp)  # positions of the weight matrices
        self._ever = np.empty(0, dtype=bool)  # which matrix had a non-zero gradient once
        self._seen_all = False  # every matrix had one: the usual case after a step or two
        self._since: int | None = None

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None without per-layer gradient norms or on an optimizer skip."""
        norms = step.layer_norms
        if step.skipped or norms.size == 0 or not np.isfinite(norms).all():
            return None
        self._plan(step, norms.size)
        matrices = norms[self._matrices]
        if not self._seen_all:
            self._ever |= matrices != 0.0
            self._seen_all = bool(self._ever.all())
        # The collector runs this on every step of every rank: one test in the usual case.
        live = matrices.any() if self._seen_all else matrices[self._ever].any()
        if live or not self._ever.any() or not norms.any():
            self._since = None
            return INACTIVE
        if self._since is None:
            self._since = step.step
        flowing = np.flatnonzero(norms)
        names = step.layers if len(step.layers) == norms.size else ()
        learning = [names[i] for i in flowing] if names else []
        cut = int(self._ever.sum())
        summary = (
            f"no weight matrix has had a gradient since step {self._since} "
            f"({cut} that had one before); only {flowing.size} other tensor(s) still learn"
            + (f" ({', '.join(learning[:3])})" if learning else "")
            + ": every unit feeding them is dead (ReLUs pushed negative by an update too "
            "large?) or the graph is cut before them"
        )
        evidence = {"since_step": self._since, "matrices": cut, "still_learning": learning[:10]}
        return Finding(True, summary, evidence)

    def _plan(self, step: Step, size: int) -> None:
        key = (step.layers, step.layer_roles, size)
        if key == self._key:
            return
        self._key = key
        named = step.layers if len(step.layers) == size else tuple(f"#{i}" for i in range(size))
        roles = roles_of(named, step.layer_roles)
        self._matrices = np.array([i for i, r in enumerate(roles) if r == "weight"], np.intp)
        self._ever = np.zeros(self._matrices.size, dtype=bool)
        self._seen_all = False
