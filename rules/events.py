"""One-step extreme events: one batch whose loss or gradient norm is far outside the run's range.

PaLM (Chowdhery et al. 2022, section 5.1) and OLMo handle loss spikes by
restarting from a checkpoint before the spike and *skipping the batches*
around it: the useful alert names the step, at once, rather than waiting to
see whether the loss stays up (the persistence rules, LossSpike and
LossDiverging, do that). One corrupt batch (garbage tokens, a mislabelled
shard, an exploding sample) shows as exactly this: a loss or a total gradient
norm orders of magnitude outside everything the run produced recently, for
one step.

"Far outside" is judged against the run's own recent distribution, per
signal, with two invariants that ordinary noise does not meet together: the
value is ``factor`` times the median of the last ``window`` values (two
orders of magnitude by default) *and* ``over_max`` times the largest of them
(an order of magnitude beyond anything seen recently). Both come from the
calibration corpus's label for a broken gradient event (B3: a grad norm over
100x the median and 10x the maximum of the prior 50); on the 39 healthy real
runs the largest one-step excursions are 8.6x the median loss (3.9x the
window's maximum) and 30x the median grad norm (1.7x the maximum).

A GradScaler's overflow skip (non-finite gradients by design) is not an
event. Extreme values never enter the windows, so one event does not hide
the next.

Example::

    det = ExtremeStepDetector()
    finding = det.observe(step)
    if finding is not None and finding.active:
        print(finding.evidence["event_step"], finding.evidence["signals"])
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Any, Literal

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.loss import SortedWindow, finite_loss, total_grad_norm
from gradwatch.rules.step import Step

EventReport = Literal["event", "repeated"]


class _Signal:
    """The recent values of one signal, and the test of a new one against them.

    Besides the window, the largest value of each block of ``size`` values over the last
    ``history`` (0: none kept): an extreme must also be the largest value the signal took
    in that span, or the run produces such values routinely (a batch of 4 near
    convergence: a few per 500 steps at 100x the median) and none is an event.
    """

    __slots__ = ("_block", "_block_max", "_filled", "_peaks", "name", "window")

    def __init__(self, name: str, size: int, history: int = 0) -> None:
        self.name = name
        self.window = SortedWindow(size)
        self._block = size
        self._peaks: deque[float] = deque(maxlen=max(0, history // size))
        self._block_max = 0.0
        self._filled = 0

    def judge(
        self, value: float, min_history: int, factor: float, over_max: float
    ) -> dict[str, Any] | None:
        """Evidence when ``value`` is extreme; otherwise remember it and return None."""
        if len(self.window) >= min_history and value > 0.0:
            median, peak = self.window.median(), self.window.values()[-1]
            if (
                median > 0.0
                and value >= factor * median
                and value >= over_max * peak
                and value > max(self._peaks, default=0.0)
            ):
                return {
                    "signal": self.name,
                    "value": value,
                    "median": median,
                    "window_max": peak,
                    "times_median": value / median,
                    "times_max": value / peak,
                    "window": len(self.window),
                }
        if value >= 0.0:
            self.window.add(value)
            self._remember(value)
        return None

    def _remember(self, value: float) -> None:
        if self._peaks.maxlen == 0:
            return
        self._block_max = max(self._block_max, value)
        self._filled += 1
        if self._filled == self._block:
            self._peaks.append(self._block_max)
            self._block_max, self._filled = 0.0, 0


class ExtremeStepDetector:
    """Active on a step whose loss or total grad norm is extreme (``report="event"``), or
    while ``repeats`` such steps fell within the last ``within`` steps (``report="repeated"``).

    An event is active for the one step it happened on, so each event is one
    incident whose alert names its step; a step that carries neither signal
    gives no verdict.
    """

    @validated_params
    def __init__(
        self,
        *,
        report: EventReport = "event",
        window: Annotated[int, Field(ge=8)] = 50,
        min_history: Annotated[int, Field(ge=4)] = 20,
        factor: Annotated[float, Field(gt=1.0)] = 100.0,
        over_max: Annotated[float, Field(ge=1.0)] = 10.0,
        repeats: Annotated[int, Field(ge=2)] = 3,
        within: Annotated[int, Field(ge=1)] = 1000,
        history: Annotated[int, Field(ge=0)] = 0,
    ) -> None:
        if min_history > window:
            raise ValueError(f"min_history ({min_history}) must not exceed window ({window})")
        self.report, self.min_history, self.factor, self.over_max = (
            report,
            min_history,
            factor,
            over_max,
        )
        self.repeats, self.within = repeats, within
        self._loss = _Signal("loss", window, history)
        self._signed = False  # a loss below zero was seen: only grad norms are judged
        # A logged total (pre-clip, e.g. the HF Trainer's at logging steps) and the one the
        # optimizer saw (post-clip) are different quantities: on the live HF path both arrive,
        # and a pre-clip 50 against a window of clipped norms would read as an event.
        self._norm = _Signal("grad_norm", window, history)
        self._seen_norm = _Signal("grad_norm", window, history)
        self._events: deque[int] = deque(maxlen=repeats)

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None when it carried neither a loss nor a grad norm."""
        if is_amp_skip(step):
            return None  # an overflow the GradScaler skipped: designed behaviour
        loss, norm = finite_loss(step), total_grad_norm(step)
        if loss is not None and loss < 0.0:
            self._signed = True  # a signed objective (RL): its loss has no range to leave
        if self._signed:
            loss = None
        if loss is None and norm is None:
            return None
        norms = self._norm if step.grad_norm_logged else self._seen_norm
        found = [
            e
            for signal, value in ((self._loss, loss), (norms, norm))
            if value is not None
            and (e := signal.judge(value, self.min_history, self.factor, self.over_max)) is not None
        ]
        if found:
            self._events.append(step.step)
        if self.report == "event":
            return self._event(step.step, found) if found else INACTIVE
        return self._repeated(step.step)

    def loss_not_supervised(self) -> None:
        """The job's loss is no supervised loss (a loss below zero on this rank, or the job's
        declaration; rules/engine.py): from now on only the grad norm is judged. A DQN's
        TD loss jumps 250-670x its running median in bursts while it learns (CleanRL's
        dqn.py on CartPole: 45 pages on a run that solves it)."""
        self._signed = True

    def _event(self, at: int, found: list[dict[str, Any]]) -> Finding:
        what = "; ".join(
            f"{e['signal']} {e['value']:.4g} is {e['times_median']:.0f}x its running median "
            f"{e['median']:.4g} and {e['times_max']:.1f}x the largest of its last {e['window']}"
            for e in found
        )
        summary = (
            f"one-step extreme at step {at}: {what}; a corrupt or extreme batch? "
            f"skip the batch of step {at} if you resume from a checkpoint"
        )
        evidence = {
            "event_step": at,
            "signals": [e["signal"] for e in found],
            **{f"{e['signal']}_{k}": v for e in found for k, v in e.items() if k != "signal"},
        }
        return Finding(True, summary, evidence)

    def _repeated(self, at: int) -> Finding:
        recent = [s for s in self._events if at - s < self.within]
        if len(recent) < self.repeats:
            return INACTIVE
        steps = ", ".join(str(s) for s in recent)
        summary = (
            f"{len(recent)} one-step extremes within {self.within} steps (steps {steps}): "
            "the data or the optimizer state keeps producing extreme steps"
        )
        return Finding(True, summary, {"event_steps": recent, "within": self.within})
