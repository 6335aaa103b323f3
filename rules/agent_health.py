"""The agent's own health: parts of the monitoring that switched themselves off.

When the agent cannot measure something any more (the model moved to another
device after ``watch()``, a layer gets sparse gradients, an internal error
stopped it), it keeps the training loop running, switches that part off, and
sends a ``degraded`` event (contract C3): ``off`` names the part, ``reason``
says why and what to do, ``optional`` is true when only an optional
statistic (activations, cadence statistics) is off. Without it, a job would
simply go quiet on those signals and every rule reading them would be
silently blind.

The collector turns each event into an :class:`AgentNotice` and feeds it to
the engine's ``observe_notice`` input. :class:`AgentDegradedDetector` is
active from the first notice of its kind on (``scope`` "core": a core signal
or the whole agent is off; "optional": an optional statistic) and stays so
while the job runs: nothing comes back on until a new ``watch()``. The
alert's evidence lists every part that is off, with its reason.

Example::

    det = AgentDegradedDetector(scope="core")
    finding = det.observe_notice(AgentNotice("run-42", 0, 120, "gradient norms", "...", False))
    finding.summary  # 'monitoring degraded: gradient norms off since step 120 (...)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gradwatch.rules.detector import Finding, validated_params

MAX_PARTS = 16  # parts named in one alert's evidence; the agent has fewer
MAX_REASON_CHARS = 512


@dataclass(frozen=True, slots=True)
class AgentNotice:
    """One ``degraded`` event of one rank: ``off`` stopped at ``step`` because of ``reason``."""

    job: str
    rank: int
    step: int
    off: str
    reason: str
    optional: bool
    # Notices are per rank; the engine's per-rank key reads this.
    assembled: bool = False

    @classmethod
    def of_fields(
        cls, job: str, rank: int, step: int, fields: dict[str, object]
    ) -> AgentNotice | None:
        """The notice in an event's ``fields``, or None when they do not hold one."""
        off, reason = fields.get("off"), fields.get("reason", "")
        if not isinstance(off, str) or not off or not isinstance(reason, str):
            return None
        return cls(
            job,
            rank,
            step,
            off[:MAX_REASON_CHARS],
            reason[:MAX_REASON_CHARS],
            fields.get("optional") is True,
        )


class AgentDegradedDetector:
    """Active once any part of ``scope`` is off; see the module docstring."""

    @validated_params
    def __init__(self, *, scope: Literal["core", "optional"] = "core") -> None:
        self.scope = scope
        self._off: dict[str, tuple[int, str]] = {}  # part -> (step, reason)

    def observe_notice(self, notice: AgentNotice) -> Finding | None:
        """Take one notice into account; None for notices of the other scope."""
        if notice.optional != (self.scope == "optional"):
            return None
        if notice.off not in self._off and len(self._off) < MAX_PARTS:
            self._off[notice.off] = (notice.step, notice.reason)
        parts = [
            f"{off} off since step {step} ({reason})" for off, (step, reason) in self._off.items()
        ]
        return Finding(
            True,
            "monitoring degraded: " + "; ".join(parts),
            {
                "off": list(self._off),
                "reasons": {off: reason for off, (_, reason) in self._off.items()},
                "since_step": min(step for step, _ in self._off.values()),
            },
        )
