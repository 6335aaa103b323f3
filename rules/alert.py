"""The alert record every sink is derived from, and the transitions that carry it.

An :class:`Alert` follows DESIGN's alert contract. One incident keeps one ``id``
from its firing to its resolve, so a receiver that sees the same alert twice
(a retried webhook, a collector restart resending its outbox) can drop the copy.

Example::

    alert = Alert(rule="NonFiniteGradients", category="numerical", severity="critical",
                  job="run-42", state="firing", step=41, summary="loss is nan",
                  started_at=1700000000.0)
    json.dumps(alert.to_dict(), allow_nan=False)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, get_args

import numpy as np

Severity = Literal["info", "warning", "critical"]
Category = Literal[
    "numerical",
    "exploding_gradients",
    "vanishing_gradients",
    "dead_pipeline",
    "loss_spike",
    "lr_too_high",
    "lr_too_low",
    "generalization_gap",
    "saturation",
    "dead_units",
    "weight_runaway",
    "update_ratio",
    "loss_scale_collapse",
    "eval_mode_wiring",
    "stalled",
    "straggler",
    "agent_health",
]
AlertState = Literal["firing", "resolved"]
LifecycleState = Literal["inactive", "pending", "firing", "resolved"]

SEVERITIES: tuple[str, ...] = get_args(Severity)
CATEGORIES: tuple[str, ...] = get_args(Category)


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


def alert_id(job: str, rule: str, rank: int | None, step: int) -> str:
    """Stable id of one incident: the same inputs give the same 16 hex digits.

    Built from what identifies an incident and nothing time-dependent, so a
    replay of a recorded trace produces the ids the live collector produced.
    """
    key = "\x1f".join((job, rule, "-" if rank is None else str(rank), str(step)))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Alert:
    """One incident of one rule on one job (and rank), firing or resolved.

    ``step`` is the step where the incident began (its condition first held),
    not the step where it crossed its ``for``. ``evidence`` holds the numbers
    that made it fire; ``diagnosis`` the verdict and the checks to run next.
    """

    rule: str
    category: Category
    severity: Severity
    job: str
    state: AlertState
    step: int
    summary: str
    started_at: float
    evidence: Mapping[str, Any] = field(default_factory=_empty)
    diagnosis: Mapping[str, Any] | None = None
    last_good_checkpoint: str | None = None
    rank: int | None = None
    labels: Mapping[str, str] = field(default_factory=_empty)
    annotations: Mapping[str, str] = field(default_factory=_empty)
    resolved_at: float | None = None
    id: str = field(default="")

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(
                f"unknown alert category {self.category!r}; expected one of {CATEGORIES}"
            )
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; expected one of {SEVERITIES}")
        if not self.id:
            # Frozen: the only way to fill a derived field is through object.__setattr__.
            object.__setattr__(self, "id", alert_id(self.job, self.rule, self.rank, self.step))

    @property
    def onset(self) -> int:
        """The step a rollback must go back before: ``step``, or earlier where the detector
        knows the damage came before its condition could be seen (evidence ``onset_step``:
        weights written outside the optimizer at step 300, seen in the loss by 315)."""
        early = self.evidence.get("onset_step")
        if isinstance(early, int) and not isinstance(early, bool) and 0 <= early < self.step:
            return early
        return self.step

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``json.dumps(d, allow_nan=False)`` always succeeds.

        Non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``
        because a NaN loss is exactly the evidence a numerical alert carries,
        and strict JSON has no literal for it.
        """
        return {
            "id": self.id,
            "rule": self.rule,
            "category": self.category,
            "severity": self.severity,
            "job": self.job,
            "rank": self.rank,
            "state": self.state,
            "step": self.step,
            "summary": self.summary,
            "evidence": json_safe(self.evidence),
            "diagnosis": None if self.diagnosis is None else json_safe(self.diagnosis),
            "last_good_checkpoint": self.last_good_checkpoint,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "started_at": json_safe(self.started_at),
            "resolved_at": json_safe(self.resolved_at),
        }


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of an alert's lifecycle state that a receiver should hear about."""

    alert: Alert
    previous: LifecycleState
    current: LifecycleState


def json_safe(value: Any) -> Any:
    """Convert evidence values (numpy scalars and arrays, tuples, non-finite floats) to JSON."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, np.ndarray):
        return [json_safe(v) for v in value.tolist()]
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    return str(value)


def _float(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x
