"""Loss jumps: a spike, a change of data the run learns from, or a jump that stays (seed Stage 2).

The seed tells "spikes then recovery" from a loss that stays up (learning
rate too high). A third shape looks the same for its first steps: the data
or the task changed, the loss jumped to a new level, and the run *learns
again*: the loss falls steadily from the new level while the gradient norm
does not grow. Healthy training on stationary data does not jump, so the
jump is worth a note; a run that learns after it is not broken, so it is not
worth a page. What tells the three apart is what follows the jump:

* back to the old level within a few losses: a **spike** (a bad batch or
  shard); reported once it is over, naming its steps, so the user can skip
  those batches when resuming (PaLM, OLMo practice);
* still up after ``decide`` losses and falling steadily, the gradient norm
  not rising: a **level shift** (a new data source, a task switch nobody
  announced); reported at info with the advice to call
  ``mon.data_changed()``, and the detector accepts the new level;
* still up and not falling: the jump **stays** (a spike that does not
  recover, a divergence): reported as a spike from then on, and as a
  divergence once it has lasted ``diverge_after`` losses.

A jump with an optimizer-side cause is never read as a change of data and
pages without waiting: the learning rate rose ``lr_jump`` x over the run's
recent rate just before or during it (a schedule, a bump, the end of a
warm-up), or the gradient norm rose more than ``grad_excess`` times the
loss's rise in log space. For the usual losses a harder batch cannot do
that: mean squared error's gradient grows as the square root of the loss,
cross-entropy's is bounded (|p - y| <= sqrt 2 per example) while its loss is
not, so a gradient outgrowing the loss means the network's Jacobian grew
(unnormalised inputs, weights thrown by a large step), not the data.

Example::

    det = LossSpikeDetector(window=128, sigmas=6.0, decide=16)
    finding = det.observe(step)
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.growth import fit_line
from gradwatch.rules.loss import SortedWindow, finite_loss, total_grad_norm
from gradwatch.rules.series import MAD_TO_SIGMA, slope_t
from gradwatch.rules.step import Step

Report = Literal["spike", "divergence", "shift"]
Verdict = Literal["stays", "shift"]


class LossSpikeDetector:
    """Judges loss jumps; ``report`` picks which of the module docstring's shapes it is active for.

    An episode opens when a loss is ``sigmas`` noise scales above the running
    level (median of the last ``window`` losses; noise 1.4826 x their MAD, in
    log space when the losses are positive, floored at ``min_rel_sigma``), at
    least ``min_rise`` (relative) above it, and undoing at least ``min_range``
    of the run's own progress (its start level, the median of its first 5
    losses, minus the level): near a converged 3e-4 loss, 3e-3 is many noise
    scales and 10x up, yet a negligible share of a run that started at 2. The
    reference is frozen for the episode (its losses never enter the window).
    It ends when ``recover_steps`` losses in a row are back within
    ``recover_sigmas``, when it is read as a level shift, or after
    ``rebase_after`` losses up (the new level is accepted). A spike counts
    only when ``min_steps`` losses in a row were up: one or two hard batches
    are noise (the one-step extreme is LossExtremeStep's).

    ``report="spike"``: active for the recovered spike's last loss, or, for a
    jump that stays or has an optimizer-side cause, while its latest loss is
    up. ``report="divergence"``: while up after ``diverge_after`` losses.
    ``report="shift"``: active for the loss at which a level shift is read.
    """

    SUPERVISED_LOSS = True  # let go of at a loss below zero (rules/engine.py)

    @validated_params
    def __init__(
        self,
        *,
        report: Report = "spike",
        window: Annotated[int, Field(ge=8)] = 128,
        min_history: Annotated[int, Field(ge=8)] = 64,
        sigmas: Annotated[float, Field(gt=0.0)] = 6.0,
        min_rise: Annotated[float, Field(ge=0.0)] = 0.1,
        min_rel_sigma: Annotated[float, Field(ge=0.0)] = 0.001,
        min_range: Annotated[float, Field(ge=0.0)] = 0.1,
        recover_sigmas: Annotated[float, Field(ge=0.0)] = 3.0,
        recover_steps: Annotated[int, Field(ge=1)] = 3,
        min_steps: Annotated[int, Field(ge=1)] = 3,
        decide: Annotated[int, Field(ge=4)] = 16,
        learn_z: Annotated[float, Field(gt=0.0)] = 3.0,
        wait_z: Annotated[float, Field(ge=0.0)] = 1.0,
        lr_jump: Annotated[float, Field(gt=1.0)] = 2.0,
        grad_excess: Annotated[float, Field(gt=1.0)] = 2.0,
        diverge_after: Annotated[int, Field(ge=1)] = 50,
        rebase_after: Annotated[int, Field(ge=2)] = 1000,
    ) -> None:
        if min_history > window:
            raise ValueError(f"min_history ({min_history}) must not exceed window ({window})")
        if wait_z > learn_z:
            raise ValueError(f"wait_z ({wait_z}) must not exceed learn_z ({learn_z})")
        if not min_steps <= decide < diverge_after:
            raise ValueError(
                f"need min_steps ({min_steps}) <= decide ({decide}) < diverge_after "
                f"({diverge_after}): a jump is read before it can be a divergence"
            )
        self.report, self.window, self.min_history = report, window, min_history
        self.sigmas, self.min_rise, self.min_rel_sigma = sigmas, min_rise, min_rel_sigma
        self.min_range, self.recover_sigmas, self.recover_steps = (
            min_range,
            recover_sigmas,
            recover_steps,
        )
        self.min_steps, self.decide, self.learn_z, self.wait_z = min_steps, decide, learn_z, wait_z
        self.lr_jump, self.grad_excess = lr_jump, grad_excess
        self.diverge_after, self.rebase_after = diverge_after, rebase_after
        self._first: list[float] = []  # the run's first losses: where its progress is measured from
        self._window = SortedWindow(window)
        self._grads: deque[float] = deque(maxlen=window)
        self._lrs: deque[float] = deque(maxlen=window)
        self._sigma: tuple[float, bool] | None = None  # cached noise scale and its space
        self._sigma_age = 0
        self._episode: _Episode | None = None
        self._written = -1  # the latest step whose weights were written outside the optimizer

    def weights_written(self, step: int) -> None:
        """The agent saw the weights written outside the optimizer before ``step``'s update
        (agent/fence.py): a jump that starts there is that write's, not the batches'."""
        self._written = max(self._written, step)

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried no loss (NaN is the non-finite rule's)."""
        loss = finite_loss(step)
        if loss is None:
            return None
        grad = total_grad_norm(step)
        lr = max(step.lr) if step.lr else None
        if len(self._first) < 5:
            self._first.append(loss)
        episode = self._episode
        if episode is None:
            episode = self._maybe_open(step.step, loss)
            if episode is None:
                self._remember(loss, grad, lr)
                return INACTIVE
            self._episode = episode
        else:
            episode.add(step.step, loss)
        episode.observe_cause(self, grad, lr)
        if episode.recovered >= self.recover_steps:
            self._episode = None
            return self._recovered(episode)
        if episode.steps >= self.rebase_after:
            self._rebase()  # the loss settled at a new level: accept it
            return INACTIVE
        if episode.verdict is None and episode.seen >= self.decide:
            episode.verdict = self._read(episode, final=episode.seen >= self.diverge_after)
            if episode.verdict == "shift":
                self._rebase()
                return self._shifted(episode) if self.report == "shift" else INACTIVE
        return self._finding(episode)

    # ------------------------------------------------------------ state

    def _remember(self, loss: float, grad: float | None, lr: float | None) -> None:
        self._window.add(loss)
        self._sigma_age += 1
        if grad is not None and grad > 0.0:
            self._grads.append(grad)
        if lr is not None:
            self._lrs.append(lr)

    def _rebase(self) -> None:
        """Start over from the new level, as an announced data change would."""
        self._episode = None
        self._window.clear()
        self._grads.clear()
        self._lrs.clear()
        self._sigma = None
        self._first = []

    def _maybe_open(self, step: int, loss: float) -> _Episode | None:
        if len(self._window) < self.min_history:
            return None
        level = self._window.median()
        if loss < level + self.min_rise * abs(level):
            return None  # the cheap test first: most steps end here
        if loss - level < self.min_range * (float(np.median(self._first)) - level):
            return None  # a negligible share of the run's progress, however many sigmas
        sigma, log = self._noise(level)
        centre = math.log(level) if log else level
        height = ((math.log(loss) if log else loss) - centre) / sigma
        if height < self.sigmas:
            return None
        back = self.recover_sigmas * sigma
        recover_below = level * math.exp(back) if log else level + back
        grad_level = float(np.median(self._grads)) if self._grads else None
        lr_level = float(np.median(self._lrs)) if self._lrs else None
        recent_lr = max(list(self._lrs)[-self.min_steps :], default=None)
        episode = _Episode(
            step,
            level,
            sigma,
            loss,
            height,
            recover_below,
            log,
            grad_level,
            lr_level,
            self.diverge_after,
        )
        if recent_lr is not None:  # a rate raised just before the jump (the loss lags a step)
            episode.lr_cause(recent_lr, self.lr_jump)
        return episode

    def _noise(self, level: float) -> tuple[float, bool]:
        """The window's noise scale, recomputed after every 8 new losses (it drifts slowly)."""
        if self._sigma is None or self._sigma_age >= 8:
            values = self._window.values()
            # Batch losses are skewed (noise is multiplicative): judge positive losses in log
            # space, where a 6σ excursion is as rare as the rule means it to be.
            log = bool(values[0] > 0.0)
            space = np.log(values) if log else values
            centre = math.log(level) if log else level
            sigma = MAD_TO_SIGMA * float(np.median(np.abs(space - centre)))
            floor = self.min_rel_sigma if log else self.min_rel_sigma * abs(level)
            self._sigma, self._sigma_age = (max(sigma, floor, 1e-12), log), 0
        return self._sigma

    def _read(self, ep: _Episode, final: bool) -> Verdict | None:
        """From ``decide`` losses on: does the run learn from the new level (a shift) or not?

        A fall the trend cannot resolve yet (slope t between -``learn_z`` and
        -``wait_z``: a slow relearning) keeps the reading open, judged again
        on every loss, until ``diverge_after`` losses (``final``).
        """
        if ep.cause is not None:
            return "stays"
        ep.loss_t = slope_t(ep.trend)
        ep.grad_t = slope_t(ep.grad_trend) if len(ep.grad_trend) >= 3 else None
        if (
            ep.grad_t is not None
            and ep.grad_t >= self.learn_z
            and _growth(ep.grad_trend) >= self.grad_excess
        ):
            return "stays"  # the gradient norm grows (steadily, and by grad_excess x): not learning
        if ep.loss_t <= -self.learn_z:
            return "shift"
        return None if ep.loss_t <= -self.wait_z and not final else "stays"

    # ------------------------------------------------------------ findings

    def _recovered(self, ep: _Episode) -> Finding:
        """A spike that came back: reported once, at its end, unless it was reported while up."""
        if self.report != "spike" or ep.reported or ep.longest < self.min_steps:
            return INACTIVE
        summary = (
            f"loss spike at steps {ep.start}-{ep.last_up}: up to {ep.peak:.4g} "
            f"(step {ep.peak_step}) "
            f"against its running level {ep.level:.4g}, {ep.height:.1f}σ at its first step; back "
            f"at its level by step {ep.latest_step} (skip those batches when resuming)"
        )
        return Finding(True, summary, self._evidence(ep))

    def _shifted(self, ep: _Episode) -> Finding:
        summary = (
            f"the loss moved to a new level at step {ep.start} "
            f"({ep.first:.4g} against {ep.level:.4g}) "
            f"and the run is learning again: falling over the {ep.seen} losses since (slope "
            f"t = {ep.loss_t:.1f}), the gradient norm not rising. A change of data or task? If it "
            "was planned, call mon.data_changed() there: the rules then start fresh baselines"
        )
        return Finding(True, summary, self._evidence(ep))

    def _finding(self, ep: _Episode) -> Finding:
        if ep.reported and self.report == "spike":
            return Finding(True, ep.summary, self._evidence(ep))  # one episode, one incident
        # Active only while the latest loss is still up: the alert resolves as the loss returns.
        if ep.recovered or ep.longest < self.min_steps:
            return INACTIVE
        if self.report == "divergence":
            if ep.steps < self.diverge_after:
                return INACTIVE
            summary = (
                f"loss has stayed above its level for {ep.steps} steps since step {ep.start}: now "
                f"{ep.latest:.4g} vs level {ep.level:.4g} "
                f"(peak {ep.peak:.4g} at step {ep.peak_step}); "
                "diverging, not a passing spike"
            )
        elif self.report == "spike" and (ep.cause is not None or ep.verdict == "stays"):
            why = (
                f"with {ep.cause}"
                if ep.cause is not None
                else f"not falling back over {ep.seen} losses"
            )
            summary = (
                f"loss spike at step {ep.start}: {ep.first:.4g} is {ep.height:.1f}σ above its "
                f"running level {ep.level:.4g} (median of the last {self.window} steps), {why}"
            )
        else:
            return INACTIVE
        ep.reported, ep.summary = True, summary
        return Finding(True, summary, self._evidence(ep))

    def _evidence(self, ep: _Episode) -> dict[str, object]:
        evidence = self._numbers(ep)
        if ep.start - 1 <= self._written <= ep.start:
            # nanoGPT re-initialised at iteration 200 spiked at 202, told "the batches at the
            # spike" first (benchmarks/nanogpt_trial.py, reinit_mid).
            evidence["lead_check"] = (
                f"the weights were written outside the optimizer before step {self._written} "
                "(a checkpoint loaded, model.apply(init) or reset_parameters() run again): "
                "not the batches"
            )
            evidence["onset_step"] = self._written
        return evidence

    def _numbers(self, ep: _Episode) -> dict[str, object]:
        return {
            "level": ep.level,
            "sigma": ep.sigma,
            "spike_step": ep.start,
            "spike_loss": ep.first,
            "height_sigmas": ep.height,
            "peak_loss": ep.peak,
            "peak_step": ep.peak_step,
            "peak_sigmas": ep.sigmas_of(ep.peak),
            "space": "log" if ep.log else "linear",
            "loss": ep.latest,
            "steps_above": ep.steps,
            "cause": ep.cause,
            "trend_t": ep.loss_t,
            "grad_trend_t": ep.grad_t,
            "window": self.window,
        }


class _Episode:
    """One jump, from its first loss until it recovers, is read as a shift, or is accepted."""

    __slots__ = (
        "start",
        "level",
        "sigma",
        "first",
        "height",
        "recover_below",
        "log",
        "peak",
        "peak_step",
        "latest",
        "latest_step",
        "last_up",
        "steps",
        "recovered",
        "run",
        "longest",
        "seen",
        "trend",
        "grad_trend",
        "grad_level",
        "lr_level",
        "cause",
        "verdict",
        "reported",
        "summary",
        "loss_t",
        "grad_t",
        "_up_losses",
        "_up_grads",
    )

    def __init__(
        self,
        start: int,
        level: float,
        sigma: float,
        loss: float,
        height: float,
        recover_below: float,
        log: bool,
        grad_level: float | None,
        lr_level: float | None,
        horizon: int,
    ) -> None:
        self.start, self.level, self.sigma, self.log = start, level, sigma, log
        self.first, self.height, self.recover_below = loss, height, recover_below
        self.peak, self.peak_step, self.latest, self.latest_step, self.last_up = (
            loss,
            start,
            loss,
            start,
            start,
        )
        self.steps, self.recovered, self.run, self.longest, self.seen = 1, 0, 1, 1, 1
        # The losses (and gradient norms) of the jump, up to the reading's horizon.
        self.trend: deque[float] = deque([math.log(loss) if log else loss], maxlen=horizon)
        self.grad_trend: deque[float] = deque(maxlen=horizon)
        self.grad_level, self.lr_level = grad_level, lr_level
        self.cause: str | None = None
        self.verdict: Verdict | None = None
        self.reported = False
        self.summary = ""
        self.loss_t: float | None = None
        self.grad_t: float | None = None
        self._up_losses: list[float] = [loss]  # the losses and grad norms up, for the cause test
        self._up_grads: list[float] = []

    def sigmas_of(self, loss: float) -> float:
        """How many noise scales ``loss`` sits above the level."""
        if self.log:
            return (math.log(loss) - math.log(self.level)) / self.sigma if loss > 0 else -math.inf
        return (loss - self.level) / self.sigma

    def add(self, step: int, loss: float) -> None:
        self.latest, self.latest_step = loss, step
        self.seen += 1
        if len(self.trend) < (self.trend.maxlen or 0):
            self.trend.append(math.log(loss) if self.log and loss > 0 else loss)
        if loss > self.peak:
            self.peak, self.peak_step = loss, step
        if loss <= self.recover_below:
            self.recovered += 1
            self.run = 0
        else:
            self.recovered = 0
            self.steps += 1
            self.run += 1
            self.longest = max(self.longest, self.run)
            self.last_up = step
            if len(self._up_losses) < (self.trend.maxlen or 0):
                self._up_losses.append(loss)

    def observe_cause(self, owner: LossSpikeDetector, grad: float | None, lr: float | None) -> None:
        """Look for an optimizer-side cause while the jump is young (see the module docstring)."""
        if self.cause is not None or self.seen > owner.diverge_after:
            return
        if lr is not None:
            self.lr_cause(lr, owner.lr_jump)
        if grad is None or grad <= 0.0:
            return
        if len(self.grad_trend) < (self.grad_trend.maxlen or 0):
            self.grad_trend.append(math.log(grad))
        if self.recovered == 0:
            self._up_grads.append(grad)
        if (
            self.log
            and self.grad_level
            and len(self._up_grads) >= owner.min_steps
            and len(self._up_losses) >= owner.min_steps
        ):
            loss_rise = math.log(float(np.median(self._up_losses)) / self.level)
            grad_rise = math.log(float(np.median(self._up_grads)) / self.grad_level)
            if grad_rise > owner.grad_excess * max(loss_rise, 0.0) and grad_rise > math.log(
                owner.grad_excess
            ):
                self.cause = (
                    f"the gradient norm up {math.exp(grad_rise):.3g}x while the loss rose "
                    f"{math.exp(loss_rise):.3g}x (a Jacobian that grew, not a harder batch)"
                )

    def lr_cause(self, lr: float, factor: float) -> None:
        """A learning rate ``factor`` x the run's recent one is the cause, not the data."""
        if self.cause is None and self.lr_level and lr >= factor * self.lr_level:
            self.cause = (
                f"the learning rate at {lr:.3g}, {lr / self.lr_level:.3g}x its recent "
                f"{self.lr_level:.3g} (the optimizer, not the data)"
            )


def _growth(logs: deque[float]) -> float:
    """The factor a straight line fitted to ``logs`` (natural logs) rises by across them."""
    slope, _ = fit_line(np.arange(len(logs), dtype=np.float64), np.asarray(logs, dtype=np.float64))
    return math.exp(slope * (len(logs) - 1))
