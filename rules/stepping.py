"""Is the optimizer updating the parameters at all? (seed Stage 2's dead pipeline, caught early)

The loss-shape rule (``flat_start``) needs a few hundred steps to tell a dead
pipeline from noise. Two causes need no statistics, so they are caught within
a few steps:

* the optimizer never steps: the loop logs steps but ``optimizer.step()`` is
  not called (the agent marks such a step ``skipped``; a GradScaler's overflow
  skip is told apart by its loss scale and left to the loss-scale rule);
* every parameter group's learning rate is exactly zero, past the first step
  (a warm-up from zero is zero at step one only).

Example::

    det = OptimizerIdleDetector(steps=10)
    finding = det.observe(step)   # active after 10 such steps in a row
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.step import Step


class OptimizerIdleDetector:
    """Active while ``steps`` consecutive steps had no optimizer step or a zero learning rate."""

    @validated_params
    def __init__(self, *, steps: Annotated[int, Field(ge=2)] = 10) -> None:
        self.steps = steps
        self._run = 0
        self._since: int | None = None
        self._why = ""

    def observe(self, step: Step) -> Finding:
        """Judge one step; see the module docstring."""
        why = self._idle(step)
        if why is None:
            self._run, self._since = 0, None
            return INACTIVE
        if self._run == 0:
            self._since = step.step
        self._run += 1
        self._why = why
        if self._run < self.steps:
            return INACTIVE
        return Finding(
            True,
            f"{self._why} on {self._run} consecutive steps since step {self._since}",
            {"idle_steps": self._run, "since_step": self._since},
        )

    @staticmethod
    def _idle(step: Step) -> str | None:
        if step.skipped and not is_amp_skip(step):
            return "optimizer.step() did not run"
        if step.lr and step.step > 1 and all(lr == 0.0 for lr in step.lr):
            return "the learning rate is 0 in every parameter group"
        return None
