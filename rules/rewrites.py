"""Training progress lost in one step: the weights written outside the optimizer, the loss back up.

A run's weights change in one place, its optimizer's step. The agent tells the collector
when they were written anywhere else between two of its steps (agent/fence.py: a
checkpoint loaded, ``model.apply(init)`` or ``reset_parameters()`` run again, a cast, a
write that corrupts them; the ``weights_written`` event). Most such writes are harmless
(a resume of the latest checkpoint, restoring the best one, a move to another device), so
the event alone says nothing. What makes one a catastrophe is its effect: the loss goes
back up towards where the run started and the progress it had made is gone, in one
step, after days of training. To a loss rule that looks like nothing wrong: a jump to a
level the run already had, then a steady fall as it relearns, which is what a change of
data looks like (an MLP re-initialised at step 300 went from 0.65 back to its starting
1.38 and relearned by step 430: no rule fired).

:class:`RewrittenWeightsDetector` is active when, over the ``after`` losses since such
a write, the loss's median took back at least ``undo`` of the run's progress: of the drop
from its start (median of its first ``START`` losses) to its level before the write
(median of up to ``before`` losses). It resolves once the loss is back under that share.

Example::

    det = RewrittenWeightsDetector()
    det.weights_written(300)     # the engine, on the agent's event
    finding = det.observe(step)  # active once 16 losses since step 300 show the loss back up
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Annotated

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.loss import finite_loss
from gradwatch.rules.step import Step

START = 10  # the run's first losses: its starting level (as UpdatesTooSmall's)


class RewrittenWeightsDetector:
    """Active while the loss since a write of the weights outside the optimizer has taken
    back ``undo`` of the run's progress (module docstring)."""

    SUPERVISED_LOSS = True  # "progress" is a supervised loss's fall from a trivial start

    @validated_params
    def __init__(
        self,
        *,
        undo: Annotated[float, Field(gt=0.0, le=1.0)] = 0.25,
        before: Annotated[int, Field(ge=3)] = 32,
        after: Annotated[int, Field(ge=3)] = 16,
    ) -> None:
        self.undo, self.before, self.after = undo, before, after
        self._start: list[float] = []
        # Recent (step, loss): the losses before a write arrive in batches, possibly after
        # the agent's event, so the level before it is read at the first judgement.
        self._recent: deque[tuple[int, float]] = deque(maxlen=before + 4 * after)
        self._written: int | None = None
        self._level: float | None = None  # the level before the write, once read

    def weights_written(self, step: int) -> None:
        """The weights were written outside the optimizer before ``step``'s update."""
        if self._written is None or step > self._written:
            self._written, self._level = step, None

    def observe(self, step: Step) -> Finding | None:
        """Judge the losses since the latest write; None without a loss."""
        loss = finite_loss(step)
        if loss is None:
            return None
        if len(self._start) < START:
            self._start.append(loss)
        self._recent.append((step.step, loss))
        written = self._written
        if written is None:
            return INACTIVE
        since = [v for s, v in self._recent if s >= written]
        if len(since) < self.after:
            return INACTIVE
        if self._level is None:
            earlier = [v for s, v in self._recent if s < written][-self.before :]
            if len(earlier) < 3 or len(self._start) < START:
                self._written = None  # too little before it to tell what was lost
                return INACTIVE
            self._level = statistics.median(earlier)
        start = statistics.median(self._start)
        progress = start - self._level
        now = statistics.median(since[-self.after :])
        undone = (now - self._level) / progress if progress > 0.0 else 0.0
        if undone < self.undo:
            if len(since) >= 4 * self.after or now <= self._level:
                self._written = None  # relearned, or never lost: this write is judged
            return INACTIVE
        summary = (
            f"the weights were written outside the optimizer before step {written} (a "
            f"checkpoint loaded, a re-initialisation?) and the loss took back {undone:.0%} "
            f"of the run's progress: {self._level:.4g} before, {now:.4g} since (it started "
            f"at {start:.4g})"
        )
        evidence = {
            "written_step": written,
            "onset_step": written,  # a checkpoint from before it (Alert.onset), not the alert's
            "level_before": self._level,
            "level_since": now,
            "start_level": start,
            "undone": undone,
            "undo": self.undo,
            "step": step.step,
        }
        return Finding(True, summary, evidence)
