"""Detectors on evaluations: generalization gap (seed ``diagnose``) and eval-mode wiring (Stage 6).

* :class:`GeneralizationGapDetector` -- validation loss rising while the
  training loss falls: "losses decreasing but val_losses diverging ->
  generalization gap: revisit regularization, not optimization". smdebug's
  Overfit rule compares the *levels* ((val - train) / train > 0.1); a level
  gap is normal in healthy runs (dropout, augmentation), so this one watches
  the *trends*, as the seed does.
* :class:`ValTrainGapDetector` -- the validation loss is an order of
  magnitude above the training loss from the first evals on: the two do not
  measure the same thing (a wiring or data problem, not overfitting).
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

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.loss import finite_loss
from gradwatch.rules.nonfinite import NonFiniteDetector
from gradwatch.rules.step import Eval, Step

# The evals' level: a median of 5 halves single-eval noise (1.2 / sqrt(5)) and still moves
# within 3 evals of a real turn.
LEVEL_EVALS = 5
# 3 standard errors: one-sided, a flat level crosses it about once in 700 evals.
LEVEL_Z = 3.0


class GeneralizationGapDetector:
    """Active from the ``patience``-th eval in a row well above the best while train fell, until
    an eval comes back half-way to the best (hysteresis: one overfitting episode is one incident).

    "Well above" is ``rise`` (relative) over the lowest eval so far plus ``z``
    times the evals' own noise, estimated from the second differences of the
    last 32 evals (which a linear trend does not inflate); z = 5 because a
    long run offers a noisy plateau a hundred chances (calibrated here: under
    1% false alarms over 100 evals with 20% eval noise; a 1%-per-eval rise
    under 3% noise is caught ~20 evals in). A noise estimate needs
    ``noise_evals`` evals: a run that evaluates once per epoch (5-10 evals)
    is judged on the material rise, ``few_rise`` over the best, with the
    training loss fallen to ``few_train_drop`` of its level at the best eval
    (the calibration corpus labels overfitting at 1.25x the best eval with
    the training loss at half its level then). ``noise_only`` keeps only the
    noise bar (no verdict before ``noise_evals`` evals, no material rise): the
    default pack's info rule beside its page. Train
    losses are context (``observe`` returns None): the verdict is taken on
    each eval. At every eval the training level is the median of the
    training losses since the previous eval (at least 5, at most the last
    ``train_window``); "training loss falls" means it is now below its value
    at the best eval.

    Example::

        det = GeneralizationGapDetector(rise=0.05, patience=2)
        det.observe(step)          # None: context only
        det.observe_eval(ev).active
    """

    @validated_params
    def __init__(
        self,
        *,
        min_evals: Annotated[int, Field(ge=3)] = 3,
        rise: Annotated[float, Field(gt=0.0)] = 0.05,
        few_rise: Annotated[float, Field(gt=0.0)] = 0.25,
        noise_evals: Annotated[int, Field(ge=5)] = 8,
        few_train_drop: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5,
        patience: Annotated[int, Field(ge=1)] = 2,
        train_window: Annotated[int, Field(ge=1)] = 50,
        z: Annotated[float, Field(ge=0.0)] = 5.0,
        noise_only: bool = False,
    ) -> None:
        self.min_evals, self.rise, self.patience, self.train_window = (
            min_evals,
            rise,
            patience,
            train_window,
        )
        self.few_rise, self.noise_evals, self.z = few_rise, noise_evals, z
        self.few_train_drop = few_train_drop
        # Only the noise bar (rise + z x noise, from noise_evals evals on): the material rise
        # and the few-evals judgement are left to another rule (an early notice beside a page).
        self.noise_only = noise_only
        self._train: deque[float] = deque(maxlen=train_window)
        self._since_eval = 0  # training losses since the previous eval
        self._count = 0
        self._vals: deque[float] = deque(maxlen=32)
        self._best_level = math.inf  # lowest median of LEVEL_EVALS evals in a row
        self._best: tuple[float, int, float | None] | None = None  # (val loss, step, train level)
        self._held = 0
        self._open = False
        self._close_above = math.inf

    def observe(self, step: Step) -> None:
        """Remember the training loss; judged at the next eval."""
        loss = finite_loss(step)
        if loss is not None:
            self._train.append(loss)
            self._since_eval += 1

    def observe_eval(self, ev: Eval) -> Finding | None:
        """Judge one evaluation; see the class docstring."""
        if ev.loss is None or not math.isfinite(ev.loss):
            return None  # an eval without a usable loss says nothing about the gap
        # The training level now: the losses since the previous eval (at least 5), so a log
        # that holds a loss every 100 steps and an eval per epoch is not judged on old losses.
        recent = list(self._train)[-max(self._since_eval, 5) :]
        self._since_eval = 0
        train = statistics.median(recent) if len(recent) >= min(5, self.train_window) else None
        return self._take(ev.loss, ev.step, train)

    def _take(self, loss: float, step: int, train: float | None) -> Finding:
        self._count += 1
        best = self._best
        # The limit comes from the evals before this one: a value never widens its own bar.
        limit = self._limit(best[0]) if best is not None else math.inf
        self._vals.append(loss)
        if best is None or (loss < best[0] and not self._open):
            self._best, self._held = (loss, step, train), 0
            return INACTIVE
        if self._open:
            if loss > self._close_above:
                return self._finding(loss, step, train, self._close_above)  # still the same episode
            self._open, self._held = False, 0
            if loss < best[0]:
                self._best = (loss, step, train)
            return INACTIVE
        falling = train is not None and best[2] is not None and train < best[2]
        halved = (
            train is not None and best[2] is not None and train <= self.few_train_drop * best[2]
        )
        bar = limit
        # Many evals: the material rise (few_rise over the best with the training loss at half
        # its level then: the corpus's overfitting label) also counts, on the evals' level
        # (median of the last LEVEL_EVALS) against its lowest: on a small, noisy validation set
        # the noise bar can sit above a validation loss that has doubled while the training
        # loss fell tenfold, while single evals bounce 25% over an optimistic best.
        level = self._level()
        if level is not None:
            self._best_level = min(self._best_level, level)
        if len(self._vals) > self.noise_evals and level is not None and not self.noise_only:
            # ... plus LEVEL_Z standard errors of that median, so a flat but noisy level does
            # not cross it by chance over a long run.
            spread = LEVEL_Z * eval_noise(list(self._vals)) / math.sqrt(LEVEL_EVALS)
            if halved and level >= (1 + self.few_rise) * self._best_level + spread:
                bar = min(bar, best[0] + self.few_rise * abs(best[0]))
        self._held = self._held + 1 if loss > bar and falling else 0
        if self._count < self.min_evals or self._held < self.patience:
            return INACTIVE
        # Few evals, no noise estimate: a noisy small validation set can bounce 25%; what
        # overfitting adds is the training loss falling far (to half its level at the best).
        if len(self._vals) <= self.noise_evals and not halved:
            return INACTIVE
        # Hysteresis: the episode lasts until an eval comes back half-way from the bar to
        # the best.
        self._open, self._close_above = True, best[0] + 0.5 * (bar - best[0])
        return self._finding(loss, step, train, bar)

    def _level(self) -> float | None:
        if len(self._vals) < LEVEL_EVALS:
            return None
        return statistics.median(list(self._vals)[-LEVEL_EVALS:])

    def _limit(self, best: float) -> float:
        if len(self._vals) < self.noise_evals:
            return math.inf if self.noise_only else best + self.few_rise * abs(best)
        return best + self.rise * abs(best) + self.z * eval_noise(list(self._vals))

    def _finding(self, loss: float, step: int, train: float | None, bar: float) -> Finding:
        best = self._best
        assert best is not None
        rise = loss / best[0] - 1 if best[0] else math.inf
        train_best = best[2]
        trend = (
            f" while training loss fell {train_best:.4g} -> {train:.4g}"
            if train is not None and train_best is not None
            else ""
        )
        summary = (
            f"validation loss {loss:.4g} at step {step} is {rise:+.0%} over its best "
            f"{best[0]:.4g} (step {best[1]}){trend}: generalization gap"
        )
        evidence = {
            "val_loss": loss,
            "val_level": loss,
            "best_val_loss": best[0],
            "best_step": best[1],
            "rise": rise,
            "limit": bar,
            "train_loss": train,
            "train_loss_at_best": train_best,
            "evals_above": self.patience,
        }
        return Finding(True, summary, evidence)


class ValTrainGapDetector:
    """Active when the validation loss was ``factor`` times the training level at each of the first
    ``evals`` evaluations: a gap present from the start, however both trend.

    Overfitting opens a gap over time; a gap of an order of magnitude at the
    first evals, before the model can have memorised its training set, says
    the two losses do not measure the same thing: validation data from another
    distribution or preprocessing, labels misaligned, a loss reduced
    differently (sum vs mean), or evaluation wired to another head. Judged at
    the ``evals``-th eval with a training level; once active it stays so
    while each new eval is still ``factor / 2`` times the training level.

    An eval is not weighed while the latest training losses are themselves
    ``factor`` times their window's median: the model is blowing up, and the
    eval only echoes it (pytorch/examples' time_sequence_prediction with LBFGS
    went from 1e-4 to 1e16 in one step; this rule then paged "the two do not
    measure the same data" against a training median from before the jump).
    LossFarAboveStart and the spike rules own that incident.
    """

    @validated_params
    def __init__(
        self,
        *,
        factor: Annotated[float, Field(gt=1.0)] = 10.0,
        evals: Annotated[int, Field(ge=1)] = 3,
        train_window: Annotated[int, Field(ge=1)] = 50,
    ) -> None:
        self.factor, self.evals, self.train_window = factor, evals, train_window
        self._train: deque[float] = deque(maxlen=train_window)
        self._ratios: list[tuple[int, float, float]] = []  # (step, val, train level)
        self._verdict: Finding | None = None  # None: not judged yet

    def observe(self, step: Step) -> None:
        """Remember the training loss; judged at the next eval."""
        loss = finite_loss(step)
        if loss is not None:
            self._train.append(loss)

    def observe_eval(self, ev: Eval) -> Finding | None:
        """Judge one evaluation; see the class docstring."""
        if (
            ev.loss is None
            or not math.isfinite(ev.loss)
            or len(self._train) < min(5, self.train_window)
        ):
            return None
        train = statistics.median(self._train)
        if max(list(self._train)[-5:]) > self.factor * train:
            return None  # the training loss itself left its level: the eval echoes it
        if self._verdict is not None:
            if self._verdict.active and ev.loss < 0.5 * self.factor * train:
                self._verdict = INACTIVE  # the gap closed: judged for good
            return self._verdict
        self._ratios.append((ev.step, ev.loss, train))
        if len(self._ratios) < self.evals:
            return INACTIVE
        gaps = [val / level if level > 0 else math.inf for _, val, level in self._ratios]
        if min(gaps) < self.factor:
            self._verdict = INACTIVE
            return INACTIVE
        first = self._ratios[0]
        # "its first evals": the first the detector could weigh (an eval that arrives
        # before any training loss, or while the training loss blows up, is not).
        summary = (
            f"validation loss was {min(gaps):.0f}x or more the training loss at each of its "
            f"first {len(gaps)} evals weighed (from step {first[0]}: {first[1]:.4g} vs "
            f"{first[2]:.4g}): the two do not measure the same data or the same loss"
        )
        self._verdict = Finding(
            True,
            summary,
            {
                "ratios": gaps,
                "val_losses": [v for _, v, _ in self._ratios],
                "train_levels": [t for _, _, t in self._ratios],
                "first_eval_step": first[0],
                "factor": self.factor,
            },
        )
        return self._verdict


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
        return Finding(
            True, summary, {"modules": named, "count": len(modules), "eval_step": ev.step}
        )


class EvalLossNonFiniteDetector:
    """Active on an evaluation whose loss is NaN/Inf, until one is finite again.

    A loss is finite by construction, on held-out data as on training data: a
    non-finite eval loss means the evaluation overflowed (fp16 without a
    scaler there), divided by an empty set, or the weights it read are no
    longer finite. The training loss may stay finite meanwhile (evaluation
    runs in another precision, on other inputs), so no training-side rule sees
    it: seen on a held-out real log (every one of its 7 evals NaN, no alert).
    When the training side is non-finite too (its latest loss or gradient
    norm; a GradScaler's overflow skip does not count), the eval only echoes
    it: NonFiniteGradients owns that incident and says where it began, so this
    stays quiet rather than page twice.

    Example::

        det = EvalLossNonFiniteDetector()
        det.observe(step)          # None: context only
        det.observe_eval(ev).active
    """

    @validated_params
    def __init__(self) -> None:
        self._first: int | None = None  # the step of the episode's first non-finite eval
        # The training side as NonFiniteGradients judges it: its own detector, so the two
        # rules agree on what "non-finite training" is.
        self._training = NonFiniteDetector()
        self._train_bad = False  # the latest training step was non-finite

    def observe(self, step: Step) -> None:
        """Remember whether the training side is finite; judged at the next eval."""
        if is_amp_skip(step):
            return
        found = self._training.observe(step)
        self._train_bad = found is not None and found.active

    def observe_eval(self, ev: Eval) -> Finding:
        """Judge one evaluation; see the class docstring."""
        if ev.loss is None or math.isfinite(ev.loss) or self._train_bad:
            self._first = None
            return INACTIVE
        if self._first is None:
            self._first = ev.step
        summary = (
            f"validation loss at step {ev.step} is {ev.loss} (non-finite since the eval at "
            f"step {self._first}): the evaluation overflowed, averaged over nothing, or read "
            "non-finite weights"
        )
        return Finding(True, summary, {"eval_loss": str(ev.loss), "since_step": self._first})
