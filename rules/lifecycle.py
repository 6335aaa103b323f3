"""The alert state machine of one rule on one (job, rank), Prometheus-style.

inactive → pending (the condition holds) → firing (it held for ``for``) →
resolved (it stopped holding); pending → inactive if it clears before ``for``.
Time is injected (``clock``) and the machine *returns* transitions: sending
them is the collector's job. One incident yields exactly one firing and one
resolved transition however many steps it lasts, so receivers see no repeats.

``for`` counts either observations (an int) or seconds on the injected clock
(a duration string such as ``"30s"``, ``"5m"``, ``"1h30m"``). An observation is
one verdict of the rule's detector: the engine calls :meth:`AlertLifecycle.update`
only when the detector judged its own signal, and a detector returns None for
a record without that signal (a step logged without a loss, on the Hugging
Face path most steps), so such a record changes nothing here: ``for: 3`` on a
loss rule means three losses, however many steps lie between them.
Observations are counted rather than derived from step numbers, so a rollback
that sends step numbers backwards cannot stall or skip the machine.

Example::

    rule = AlertRule(name="NonFiniteGradients", category="numerical", severity="critical")
    machine = AlertLifecycle(rule, job="run-42", rank=0, clock=time.time)
    transition = machine.update(step=41, finding=finding)  # None, or Transition(...)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gradwatch.rules.alert import Alert, Category, LifecycleState, Severity, Transition
from gradwatch.rules.detector import Finding

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus-style duration: ``"30s"``, ``"5m"``, ``"1h30m"``, ``"250ms"``."""
    spec = text.strip()
    parts = _DURATION_PART.findall(spec)
    if not spec or "".join(n + u for n, u in parts) != spec:
        raise ValueError(f"{text!r} is not a duration; write e.g. '30s', '5m' or '1h30m'")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


@dataclass(frozen=True, slots=True)
class AlertRule:
    """What the lifecycle needs to know about a rule to build its alerts.

    ``for_steps``: the condition must hold on this many consecutive
    observations of the rule's signal (0 and 1 both fire on the first).
    ``for_seconds``, when set, replaces it with time on the injected clock.
    ``keep_firing_for``: observations the condition may be absent before the
    alert resolves (flapping guard).
    """

    name: str
    category: Category
    severity: Severity
    for_steps: int = 1
    for_seconds: float | None = None
    keep_firing_for: int = 0
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    diagnosis: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.for_steps < 0 or self.keep_firing_for < 0:
            raise ValueError("for_steps and keep_firing_for must be zero or more")
        if self.for_seconds is not None and self.for_seconds < 0:
            raise ValueError("for_seconds must be zero or more")


class AlertLifecycle:
    """State of one rule for one (job, rank); see the module docstring."""

    def __init__(
        self,
        rule: AlertRule,
        *,
        job: str,
        rank: int | None,
        clock: Callable[[], float],
        diagnose: Callable[[Alert], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.rule = rule
        self.job = job
        self.rank = rank
        self._clock = clock
        # Called once per incident, when it fires: the job's history then is what explains it.
        self._diagnose = diagnose
        self._state: LifecycleState = "inactive"
        self._start_step = 0
        self._started_at = 0.0
        self._held = 0  # consecutive observations the condition held
        self._quiet = 0  # consecutive observations it did not, while firing
        self._alert: Alert | None = None
        # The step of an incident opened by open_early() until a judged observation of
        # that step or later arrives; None otherwise.
        self._early: int | None = None
        # An incident the judged observations found at a step before the early-paged one:
        # another rank's report of an earlier bad step still in flight when the early page
        # went out. Its own alert (id, step, rank, evidence); it ends at the next judged
        # quiet step, or runs into the early incident's step and ends there.
        self._overtaken: Alert | None = None
        self._overtaken_quiet = 0  # its quiet observations in a row (keep_firing_for)

    @property
    def state(self) -> LifecycleState:
        """``"inactive"``, ``"pending"``, ``"firing"`` or ``"resolved"``."""
        return self._state

    @property
    def alert(self) -> Alert | None:
        """The alert of the current or latest incident; None before the first one fired."""
        return self._alert

    @property
    def overtaken(self) -> Alert | None:
        """An incident found at a step before an early-paged one's, while it fires."""
        return self._overtaken

    @property
    def fires_at_once(self) -> bool:
        """Whether one observation fires this rule (no ``for`` to wait out)."""
        return self.rule.for_seconds in (None, 0) and self.rule.for_steps <= 1

    def update(self, step: int, finding: Finding) -> Transition | None:
        """Advance on one observation of the rule's signal; return the transition to announce.

        The last of :meth:`advance`'s: the engine calls that, which after an early page
        can also announce an incident the early page overtook.
        """
        transitions = self.advance(step, finding)
        return transitions[-1] if transitions else None

    def advance(self, step: int, finding: Finding) -> list[Transition]:
        """Advance on one observation of the rule's signal; return the transitions to announce."""
        now = self._clock()
        if self._early is not None:
            return self._judged_after_early(step, finding, now)
        transition = (
            self._on_active(step, finding, now) if finding.active else self._on_inactive(now)
        )
        return [] if transition is None else [transition]

    def open_early(self, step: int, finding: Finding) -> Transition | None:
        """Fire now on one report's verdict, before the judged one (the collector's early page).

        For rules that fire on one observation (:attr:`fires_at_once`) and an
        active ``finding``; None when an incident is already firing. The incident
        is the one :meth:`update` would open at ``step`` (same ``step`` and rank,
        so the same alert id), and it stays provisional until an observation
        of ``step`` or later arrives: observations of earlier steps (still in
        flight when the early report overtook them) neither resolve nor re-fire
        it (an active one is an earlier incident of its own: ``advance``), and
        the first judged active one of ``step`` or later corrects its evidence
        without a second notification.
        """
        if not (finding.active and self.fires_at_once) or self._state == "firing":
            return None
        previous, now = self._state, self._clock()
        self._state, self._start_step, self._started_at = "firing", step, now
        self._held, self._quiet, self._early = 1, 0, step
        self._alert = self._build(finding)
        return Transition(self._alert, previous, "firing")

    def _judged_after_early(self, step: int, finding: Finding, now: float) -> list[Transition]:
        """``advance`` while an early-paged incident waits for its judged verdict."""
        alert = self._alert
        assert self._early is not None and alert is not None
        if step < self._early:
            # A step before the paged one, still in flight when the page went out: a quiet
            # one decides nothing for the paged incident, a bad one is an earlier incident.
            return self._judged_before_early(step, finding, now)
        out: list[Transition] = []
        if self._overtaken is not None:
            # The earlier incident ran on into the paged step: one condition, paged with
            # both onsets. The earlier ends here; the paged one carries on.
            continued = {**self._overtaken.evidence, "continued_as": alert.id}
            ended = replace(self._overtaken, evidence=MappingProxyType(continued))
            out.append(self._end_overtaken(ended, now))
        if finding.active:
            # The judged evidence (assembled across ranks) replaces the one report's.
            # The rank and step stay: they are the incident's identity (alert id,
            # Alertmanager labels); first_bad_rank says where assembly found it first.
            evidence = {**finding.evidence, "paged_early_from_rank": alert.rank}
            self._alert = replace(alert, evidence=MappingProxyType(evidence))
        self._early = None
        transition = None if finding.active else self._on_inactive(now)
        return out if transition is None else [*out, transition]

    def _judged_before_early(self, step: int, finding: Finding, now: float) -> list[Transition]:
        """A judged observation of a step before the early-paged one: an active one opens an
        incident of its own there (once), quiet ones end it as they would any incident
        (after ``keep_firing_for``). Its evidence is its own; the paged incident's stays
        the paged step's."""
        if finding.active:
            self._overtaken_quiet = 0
            if self._overtaken is not None:
                return []  # deduplicated, as any incident
            self._overtaken = self._build(finding, step, now)
            return [Transition(self._overtaken, "inactive", "firing")]
        if self._overtaken is None:
            return []
        self._overtaken_quiet += 1
        if self._overtaken_quiet <= self.rule.keep_firing_for:
            return []
        return [self._end_overtaken(self._overtaken, now)]

    def _end_overtaken(self, alert: Alert, now: float) -> Transition:
        self._overtaken = None
        return Transition(replace(alert, state="resolved", resolved_at=now), "firing", "resolved")

    def _on_active(self, step: int, finding: Finding, now: float) -> Transition | None:
        self._quiet = 0
        if self._state == "firing":
            return None  # deduplicated: one firing transition per incident
        previous = self._state
        if previous != "pending":
            self._state = "pending"
            self._start_step, self._started_at, self._held = step, now, 0
        self._held += 1
        if not self._held_long_enough(now):
            return None
        self._state = "firing"
        self._alert = self._build(finding)
        return Transition(self._alert, previous, "firing")

    def _on_inactive(self, now: float) -> Transition | None:
        if self._state == "pending":
            self._state = "inactive"  # cleared before `for`: nothing was announced
            return None
        if self._state != "firing" or self._alert is None:
            return None
        self._quiet += 1
        if self._quiet <= self.rule.keep_firing_for:
            return None
        return self._resolve(self._alert, now)

    def close(self) -> list[Transition]:
        """End the current incidents now (the job finished, or the rule stopped judging the
        rank: a loss not supervised): resolve what is firing, an overtaken one too."""
        now = self._clock()
        out = [] if self._overtaken is None else [self._end_overtaken(self._overtaken, now)]
        self._early = None
        if self._state == "pending":
            self._state = "inactive"
        if self._state != "firing" or self._alert is None:
            return out
        return [*out, self._resolve(self._alert, now)]

    def _resolve(self, alert: Alert, now: float) -> Transition:
        self._state = "resolved"
        self._alert = replace(alert, state="resolved", resolved_at=now)
        return Transition(self._alert, "firing", "resolved")

    def _held_long_enough(self, now: float) -> bool:
        if self.rule.for_seconds is not None:
            return now - self._started_at >= self.rule.for_seconds
        return self._held >= self.rule.for_steps

    def _build(
        self, finding: Finding, step: int | None = None, started_at: float | None = None
    ) -> Alert:
        """The alert of an incident starting at ``step`` (default: the current one's)."""
        rule = self.rule
        alert = Alert(
            rule=rule.name,
            category=rule.category,
            severity=rule.severity,
            job=self.job,
            state="firing",
            step=self._start_step if step is None else step,
            summary=finding.summary or rule.annotations.get("summary", rule.name),
            started_at=self._started_at if started_at is None else started_at,
            evidence=MappingProxyType(dict(finding.evidence)),
            diagnosis=rule.diagnosis,
            rank=finding.rank if finding.rank is not None else self.rank,
            labels=rule.labels,
            annotations=rule.annotations,
        )
        if self._diagnose is None:
            return alert
        return replace(alert, diagnosis=self._diagnose(alert))
