"""Detectors on evaluations: generalization gap (seed ``diagnose``) and eval-mode wiring (Stage 6).

* :class:`GeneralizationGapDetector` -- validation loss rising while the
  training loss falls: "losses decreasing but val_losses diverging ->
  generalization gap: revisit regularization, not optimization". smdebug's
  Overfit rule compares the *levels* ((val - train) / train > 0.1); a level
  gap is normal in healthy runs (dropout, augmentation), so this one watches
  the *trends*, as the seed does.
* :class:`EvalModeWiringDetector` -- an evaluation ran with BatchNorm/Dropout
  modules still in training mode (the agent reports them on the eval).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Annotated

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.loss import finite_loss
from gradwatch.rules.step import Eval, Step


class GeneralizationGapDetector:
    """Active while the eval level has stayed well above its best for ``patience`` evals and train fell.

    Levels are medians of three consecutive evals: the lowest single eval of
    many noisy ones is an optimistic outlier. "Well above" is by ``rise``
    (relative) plus ``z`` times the evals' own noise, estimated from the
    second differences of the last 32 evals (which a linear trend does not
    inflate); z = 5 because a long run offers a noisy plateau a hundred
    chances (calibrated here: under 1% false alarms over 100 evals with 20%
    eval noise; a 1%-per-eval rise under 3% noise is caught ~20 evals in). Train losses are context
    (``observe`` returns None): the verdict is taken on each eval. At every
    eval the training level is the median of the last ``train_window``
    training losses; "training loss falls" means it is now below its value
    at the best level's eval.

    Example::

        det = GeneralizationGapDetector(rise=0.05, patience=2)
        det.observe(step)          # None: context only
        det.observe_eval(ev).active
    """

    @validated_params
    def __init__(
        self,
        *,
        min_evals: Annotated[int, Field(ge=3)] = 8,
        rise: Annotated[float, Field(gt=0.0)] = 0.05,
        patience: Annotated[int, Field(ge=1)] = 2,
        train_window: Annotated[int, Field(ge=1)] = 50,
        z: Annotated[float, Field(ge=0.0)] = 5.0,
    ) -> None:
        self.min_evals, self.rise, self.patience, self.train_window = min_evals, rise, patience, train_window
        self.z = z
        self._train: deque[float] = deque(maxlen=train_window)
        self._count = 0
        self._vals: deque[float] = deque(maxlen=32)
        self._three: deque[tuple[float, int, float | None]] = deque(maxlen=3)  # (val loss, step, train level)
        self._best: tuple[float, int, float | None] | None = None  # (level, step, train level)
        self._held = 0
        self._last: Finding = INACTIVE

    def observe(self, step: Step) -> None:
        """Remember the training loss; judged at the next eval."""
        loss = finite_loss(step)
        if loss is not None:
            self._train.append(loss)

    def observe_eval(self, ev: Eval) -> Finding | None:
        """Judge one evaluation; see the class docstring."""
        if ev.loss is None or not math.isfinite(ev.loss):
            return None  # an eval without a usable loss says nothing about the gap
        train = statistics.median(self._train) if len(self._train) >= min(5, self.train_window) else None
        return self._take(ev.loss, ev.step, train)

    def _take(self, loss: float, step: int, train: float | None) -> Finding:
        entry = (loss, step, train)
        self._count += 1
        self._vals.append(loss)
        self._three.append(entry)
        if len(self._three) < 3:
            return INACTIVE
        level = sorted(self._three, key=lambda e: e[0])[1]  # the median eval, with its step and train level
        if self._best is None or level[0] < self._best[0]:
            self._best = level
        self._last = self._judge(level, entry)
        return self._last

    def _judge(self, level: tuple[float, int, float | None], now: tuple[float, int, float | None]) -> Finding:
        best = self._best
        assert best is not None
        limit = best[0] + self.rise * abs(best[0]) + self.z * self._noise()
        train_now, train_best = now[2], best[2]
        above = level[0] > limit and self._three[0][1] > best[1]
        falling = train_now is not None and train_best is not None and train_now < train_best
        self._held = self._held + 1 if above and falling else 0
        if self._count < self.min_evals or self._held < self.patience:
            return INACTIVE
        assert train_now is not None and train_best is not None
        rise = level[0] / best[0] - 1 if best[0] else math.inf
        summary = (
            f"validation loss level {level[0]:.4g} at step {now[1]} is {rise:+.0%} over its best "
            f"{best[0]:.4g} (step {best[1]}) while training loss fell {train_best:.4g} -> "
            f"{train_now:.4g}: generalization gap"
        )
        evidence = {
            "val_loss": now[0],
            "val_level": level[0],
            "best_val_loss": best[0],
            "best_step": best[1],
            "rise": rise,
            "limit": limit,
            "train_loss": train_now,
            "train_loss_at_best": train_best,
            "evals_above": self.patience,
        }
        return Finding(True, summary, evidence)

    def _noise(self) -> float:
        return eval_noise(list(self._vals))


def eval_noise(values: Sequence[float]) -> float:
    """Standard deviation of one eval's loss, from second differences (blind to a linear trend).

    The root mean square, not a median: an outlier or a bend in the curve
    inflates it, which only makes the gap rule more careful.
    """
    if len(values) < 5:
        return 0.0
    v = values
    second = [(v[i + 1] - 2.0 * v[i] + v[i - 1]) ** 2 for i in range(1, len(v) - 1)]
    return math.sqrt(sum(second) / (6.0 * len(second)))


def gap_in(evals: Sequence[tuple[int, float, float | None]]) -> dict[str, float] | None:
    """The generalization-gap verdict over a list of ``(step, val loss, train level)`` evals.

    The same test as :class:`GeneralizationGapDetector` with its defaults,
    run over a history at once (the diagnosis uses it); None when no gap.
    """
    detector = GeneralizationGapDetector()
    found: Finding | None = None
    for step, val, train in evals:
        found = detector._take(val, step, train)
    if found is None or not found.active:
        return None
    return {k: found.evidence[k] for k in ("val_level", "best_val_loss", "best_step", "train_loss")}


class EvalModeWiringDetector:
    """Active on an eval that ran with BatchNorm/Dropout-family modules in training mode.

    Example::

        EvalModeWiringDetector().observe_eval(ev).evidence["modules"]
    """

    @validated_params
    def __init__(self, *, max_named: Annotated[int, Field(ge=1)] = 10) -> None:
        self.max_named = max_named

    def observe_eval(self, ev: Eval) -> Finding:
        """Judge one evaluation; see the class docstring."""
        modules = ev.train_mode_modules
        if not modules:
            return INACTIVE
        named = list(modules[: self.max_named])
        more = f" and {len(modules) - len(named)} more" if len(modules) > len(named) else ""
        summary = (
            f"evaluation at step {ev.step} ran with {len(modules)} module(s) in training mode: "
            f"{', '.join(named)}{more}; call model.eval() before evaluating"
        )
        return Finding(True, summary, {"modules": named, "count": len(modules), "eval_step": ev.step})
