"""The rules engine: every rule's detector and alert lifecycle, per job and rank.

The same engine runs live in the collector and offline in ``gradwatch replay``:
it takes steps, returns transitions, and does no I/O. A detector and a
lifecycle are created lazily for each (job, rank, rule) the first time a step
of that job and rank arrives, and dropped with :meth:`Engine.forget`.

Example::

    engine = Engine(load_default_rules(), clock=time.time)
    for step in steps:
        for transition in engine.observe(step):
            send(transition.alert.to_dict())
    engine.forget("run-42")
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from gradwatch.rules.alert import Alert, Transition
from gradwatch.rules.detector import Detector
from gradwatch.rules.lifecycle import AlertLifecycle, AlertRule
from gradwatch.rules.rulefile import RuleSpec
from gradwatch.rules.step import Step

_CHECK_SEPARATOR = re.compile(r"\s*(?:\n|;)\s*")


def diagnosis_of(annotations: Mapping[str, str]) -> Mapping[str, Any] | None:
    """The alert's diagnosis from a rule's ``diagnosis`` and ``next_checks`` annotations.

    ``next_checks`` is one string in the rule file; checks are separated by
    newlines or semicolons. The seed's full decision tree replaces this later.
    """
    verdict = annotations.get("diagnosis")
    if verdict is None:
        return None
    checks = [c for c in _CHECK_SEPARATOR.split(annotations.get("next_checks", "").strip()) if c]
    return MappingProxyType({"verdict": verdict.strip(), "next_checks": tuple(checks)})


def alert_rule(spec: RuleSpec) -> AlertRule:
    """What the lifecycle needs from a rule spec."""
    return AlertRule(
        name=spec.name,
        category=spec.category,
        severity=spec.severity,
        for_steps=spec.for_steps,
        for_seconds=spec.for_seconds,
        keep_firing_for=spec.keep_firing_for,
        labels=spec.labels,
        annotations=spec.annotations,
        diagnosis=diagnosis_of(spec.annotations),
    )


class Engine:
    """Evaluates rules over steps; see the module docstring."""

    def __init__(self, rules: Sequence[RuleSpec], clock: Callable[[], float] = time.time) -> None:
        names = [r.name for r in rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"rule names must be unique; repeated: {', '.join(duplicates)}")
        self.rules = tuple(rules)
        self._alert_rules = tuple(alert_rule(r) for r in self.rules)
        self._clock = clock
        # (job, rank) -> one (detector, lifecycle) per rule, in rule order.
        self._state: dict[tuple[str, int], list[tuple[Detector, AlertLifecycle]]] = {}

    def observe(self, step: Step) -> list[Transition]:
        """Feed one step to every rule; return the transitions it caused (usually none)."""
        per_rule = self._state.get((step.job, step.rank))
        if per_rule is None:
            per_rule = self._start(step.job, step.rank)
        transitions = []
        for detector, lifecycle in per_rule:
            transition = lifecycle.update(step.step, detector.observe(step))
            if transition is not None:
                transitions.append(transition)
        return transitions

    def firing(self) -> list[Alert]:
        """Alerts firing now, across jobs and ranks."""
        return [
            lifecycle.alert
            for per_rule in self._state.values()
            for _, lifecycle in per_rule
            if lifecycle.state == "firing" and lifecycle.alert is not None
        ]

    def forget(self, job: str) -> list[Transition]:
        """Drop a finished job's state; its still-firing alerts come back resolved.

        Resolving them here means no receiver is left holding an alert that
        will never be resolved, as Prometheus does when a series disappears.
        """
        transitions = []
        for key in [k for k in self._state if k[0] == job]:
            for _, lifecycle in self._state.pop(key):
                transition = lifecycle.close()
                if transition is not None:
                    transitions.append(transition)
        return transitions

    def jobs(self) -> list[str]:
        """Jobs the engine holds state for."""
        return sorted({job for job, _ in self._state})

    def _start(self, job: str, rank: int) -> list[tuple[Detector, AlertLifecycle]]:
        per_rule = [
            (spec.make_detector(), AlertLifecycle(rule, job=job, rank=rank, clock=self._clock))
            for spec, rule in zip(self.rules, self._alert_rules, strict=True)
        ]
        self._state[(job, rank)] = per_rule
        return per_rule

