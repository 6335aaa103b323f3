"""What every detector is: fed its inputs one at a time, it says whether its condition holds now.

A detector implements any subset of five inputs, and the engine routes by
what it has: ``observe(step)`` (every step of one rank), ``observe_stats(stats)``
(cadence statistics of one rank), ``observe_eval(ev)`` (evaluations),
``observe_liveness(liveness)`` (every rank's progress, about once a second),
and ``observe_notice(notice)`` (the agent switched a part of itself off).
A detector with ``observe_liveness`` is per job, not per rank, and receives
nothing else; it names the rank it is about in ``Finding.rank``.

An input method returns a :class:`Finding`, or None for "taken into account,
no new verdict" (a generalization-gap detector reads train losses as context
but judges only on evals), which leaves the alert's lifecycle untouched. A
detector must return None for a record that does not carry the signal it
judges (a step without a loss, for a loss rule): a rule's ``for:`` counts
observations of its signal, and repeating the last verdict on an unmeasured
step would count steps instead (on the Hugging Face path a loss arrives only
every ``logging_steps``).

A detector only judges; holding a condition for a while, deduplicating and
resolving is the lifecycle's job (:mod:`gradwatch.rules.lifecycle`). Detectors
keep bounded state (deques with ``maxlen``, fixed-size numpy arrays) and do
O(layers) work per step, because the collector runs one per (job, rank, rule).

Example::

    det = NonFiniteDetector()
    finding = det.observe(step)
    if finding.active:
        print(finding.summary, dict(finding.evidence))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from pydantic import ConfigDict, validate_call

from gradwatch.rules.step import Eval, Liveness, Stats, Step

if TYPE_CHECKING:  # agent_health imports this module
    from gradwatch.rules.agent_health import AgentNotice

_DTYPE_NAMES = {
    float(np.finfo(np.float16).max): "float16",
    3.3895313892515355e38: "bfloat16",
    float(np.finfo(np.float32).max): "float32",
    float(np.finfo(np.float64).max): "float64",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's verdict on the latest input, with the numbers behind it.

    ``rank``: for a job-wide (liveness) detector, the rank the finding is
    about; the alert carries it. None for per-rank detectors.
    """

    active: bool
    summary: str = ""
    evidence: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    rank: int | None = None


INACTIVE = Finding(False)

# Decorates detector constructors: their annotated keyword args (``Annotated[int,
# Field(ge=6)]``) are the single declaration of each param's type and range, so a
# detector built in Python is checked exactly like one built from a rule file.
# Bad values raise pydantic.ValidationError, a ValueError.
validated_params = validate_call(config=ConfigDict(strict=True))


@runtime_checkable
class StepDetector(Protocol):
    """Judges steps; see the module docstring."""

    def observe(self, step: Step) -> Finding | None:
        """Take one step into account and say whether the condition holds now."""
        ...


@runtime_checkable
class StatsDetector(Protocol):
    """Judges cadence statistics (weight norms, update ratios, activations)."""

    def observe_stats(self, stats: Stats) -> Finding | None: ...


@runtime_checkable
class EvalDetector(Protocol):
    """Judges evaluations."""

    def observe_eval(self, ev: Eval) -> Finding | None: ...


@runtime_checkable
class LivenessDetector(Protocol):
    """Judges every rank's progress of one job; names the bad rank in ``Finding.rank``."""

    def observe_liveness(self, liveness: Sequence[Liveness]) -> Finding | None: ...


@runtime_checkable
class NoticeDetector(Protocol):
    """Judges the agent's own notices (a part of it switched off; rules/agent_health.py)."""

    def observe_notice(self, notice: AgentNotice) -> Finding | None: ...


# Any detector: one with at least one of the five inputs.
Detector = StepDetector | StatsDetector | EvalDetector | LivenessDetector | NoticeDetector

INPUTS: tuple[str, ...] = (
    "observe",
    "observe_stats",
    "observe_eval",
    "observe_liveness",
    "observe_notice",
)


def reads_supervised_loss(detector: object) -> bool:
    """Whether ``detector`` reads the loss's shape as a supervised loss's (class attribute
    ``SUPERVISED_LOSS = True``): bounded below by zero and falling from a trivial start.

    The engine stops feeding such a detector on a (job, rank) once a loss below zero
    arrives there, and resolves what it fired: a policy-gradient objective (a signed sum
    whose scale grows with the episode) crosses zero every few steps, and relative
    spikes, rises and plateaus of it mean nothing.
    """
    return bool(getattr(detector, "SUPERVISED_LOSS", False))


def inputs_of(detector: object) -> frozenset[str]:
    """Which of the four input methods ``detector`` implements."""
    return frozenset(name for name in INPUTS if callable(getattr(detector, name, None)))


def dtype_name(dtype_max: float) -> str:
    """Name the floating-point type whose largest finite value is ``dtype_max``, for summaries."""
    for value, name in _DTYPE_NAMES.items():
        if abs(dtype_max - value) <= 1e-6 * value:
            return name
    return f"dtype (max {dtype_max:.3g})"


def is_amp_skip(step: Step) -> bool:
    """True for a step a GradScaler skipped on overflow: normal, and recovered by the scaler.

    Such steps carry Inf/NaN gradients by design; judging them belongs to the
    loss-scale-collapse rule, and counting them elsewhere is a false alarm.
    """
    return step.skipped and step.loss_scale is not None
