"""The rules engine: every rule's detector and alert lifecycle, per job and rank.

The same engine runs live in the collector and offline in ``gradwatch replay``:
it takes records, returns transitions, and does no I/O. Four inputs:

* :meth:`Engine.observe` -- one ``Step`` of one rank;
* :meth:`Engine.observe_stats` -- one cadence ``Stats`` sample of one rank;
* :meth:`Engine.observe_eval` -- one ``Eval``;
* :meth:`Engine.tick` -- every known rank's ``Liveness`` (the collector calls
  it about once a second);
* :meth:`Engine.observe_notice` -- an ``AgentNotice``: the agent switched a
  part of itself off (rules/agent_health.py).

A fifth, :meth:`Engine.data_changed`, is the job announcing a planned change
of data or task (the agent's ``mon.data_changed()``): from that step on, every
rank's step, stats and eval detectors start from fresh baselines, so a loss
that jumps because the task changed is not a spike. Alert lifecycles are kept:
an incident already firing resolves only when its fresh detector says so; and
:meth:`Engine.weights_written`, a rank's weights written outside its optimizer.

A loss below zero is no supervised loss (a policy-gradient objective, a signed
sum): from the first one on a (job, rank), the rules that read the loss's shape
as a supervised loss's (``SUPERVISED_LOSS`` detectors: spikes, rises, plateaus,
a loss above its start) are no longer fed there, and what they fired resolves.
The gradient, weight and non-finite rules go on as before. A job that declared
its loss no supervised one (``watch(supervised_loss=False)``, in its census) is
treated so on every rank. The census's towers (agent/towers.py) go to every
rank's detectors with an ``observe_towers`` method, and to the job's history.

Each rule's detector gets the inputs it implements (see
:mod:`gradwatch.rules.detector`). Detectors of steps, stats and evals are
created lazily per (job, rank, rule); liveness detectors per (job, rule). The
engine also keeps a bounded :class:`JobHistory` per job, fed by the job's
lowest-numbered reporting rank, from which the seed's decision tree diagnoses
every alert when it fires (:func:`gradwatch.rules.diagnosis.diagnose`).

Example::

    engine = Engine(load_default_rules(), clock=time.time)
    for step in steps:
        for transition in engine.observe(step):
            send(transition.alert.to_dict())
    engine.forget("run-42")
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gradwatch.rules.agent_health import AgentNotice
from gradwatch.rules.alert import Alert, Transition
from gradwatch.rules.detector import Finding, inputs_of, reads_supervised_loss
from gradwatch.rules.diagnosis import JobHistory, diagnose
from gradwatch.rules.lifecycle import AlertLifecycle, AlertRule
from gradwatch.rules.nonfinite import NonFiniteDetector
from gradwatch.rules.rulefile import RuleSpec
from gradwatch.rules.step import Eval, Liveness, Stats, Step, nonfinite_layers

_CHECK_SEPARATOR = re.compile(r"\s*(?:\n|;)\s*")

Record = Step | Stats | Eval | AgentNotice


def diagnosis_of(annotations: Mapping[str, str]) -> Mapping[str, Any] | None:
    """The rule's own verdict and checks from its ``diagnosis`` and ``next_checks`` annotations.

    ``next_checks`` is one string in the rule file; checks are separated by
    newlines or semicolons. The engine merges these checks into the decision
    tree's diagnosis of each alert.
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


@dataclass(slots=True)
class _Slot:
    """One rule's detector and lifecycle for one (job, rank), or one job."""

    detector: Any
    lifecycle: AlertLifecycle


@dataclass(slots=True)
class _RankState:
    """Slots of one (job, rank), split by the input each detector takes (a slot may be in many)."""

    all: list[_Slot]
    steps: list[_Slot]
    stats: list[_Slot]
    evals: list[_Slot]
    baseline_from: int = 0  # the announced data change these detectors were made after
    notices: list[_Slot] = field(default_factory=list)  # the agent's own health
    supervised: list[_Slot] = field(default_factory=list)  # step slots reading a supervised loss
    signed: bool = False  # a loss below zero arrived: the supervised slots were let go


@dataclass(slots=True)
class _JobState:
    history: JobHistory = field(default_factory=JobHistory)
    lead: int | None = None  # the rank whose records feed the history
    liveness: list[_Slot] | None = None
    data_changes: list[int] = field(default_factory=list)  # announced steps, ascending
    history_from: int = 0  # the announced data change the history was restarted at
    towers: tuple[tuple[str, ...], tuple[int, ...]] | None = None  # census: layers, towers
    unsupervised: bool = False  # the job declared its loss no supervised loss (census)


class Engine:
    """Evaluates rules over steps, stats, evals and liveness; see the module docstring."""

    def __init__(self, rules: Sequence[RuleSpec], clock: Callable[[], float] = time.time) -> None:
        names = [r.name for r in rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"rule names must be unique; repeated: {', '.join(duplicates)}")
        self.rules = tuple(rules)
        self._alert_rules = tuple(alert_rule(r) for r in self.rules)
        # Which inputs each rule's detector takes: probed once on a throwaway instance.
        self._inputs = tuple(inputs_of(r.make_detector()) for r in self.rules)
        for spec, inputs in zip(self.rules, self._inputs, strict=True):
            if not inputs:
                raise ValueError(
                    f"rule {spec.name!r}: detector {spec.detector!r} implements no input "
                    "(observe, observe_stats, observe_eval, observe_liveness or "
                    "observe_notice)"
                )
        self._rank_rules = [
            i for i, inputs in enumerate(self._inputs) if "observe_liveness" not in inputs
        ]
        self._job_rules = [
            i for i, inputs in enumerate(self._inputs) if "observe_liveness" in inputs
        ]
        # Positions in _rank_rules of the rules observe_early() may fire: the non-finite
        # detector without a ``for`` (a NaN is a one-step catastrophe, paged on arrival),
        # notifying only. An early page runs ahead of messages that arrived before its
        # batch; an action on the job (a rollback) must see them all first, above all
        # the checkpoint reports it rolls back to (CI: a rollback refused for
        # "no checkpoint" whose checkpoint event sat in the inbox), so such a rule pages
        # when its batch is handled in turn.
        self._early_rules = [
            position
            for position, i in enumerate(self._rank_rules)
            if isinstance(self.rules[i].make_detector(), NonFiniteDetector)
            and self._alert_rules[i].for_seconds in (None, 0)
            and self._alert_rules[i].for_steps <= 1
            and set(self.rules[i].actions) <= {"notify"}
        ]
        self._supervised = frozenset(
            i for i, r in enumerate(self.rules) if reads_supervised_loss(r.make_detector())
        )
        self._clock = clock
        self._ranks: dict[tuple[str, int | None], _RankState] = {}  # None: assembled records
        self._jobs: dict[str, _JobState] = {}

    # ------------------------------------------------------------ inputs

    def observe(self, step: Step) -> list[Transition]:
        """Feed one step to every rule that reads steps; return the transitions it caused."""
        job = self._job(step.job)
        if self._leads(job, step):
            self._rebase_history(job, step.step)
            job.history.observe_step(step)
        state = self._rank(step.job, _key(step), step.step)
        # -inf is the non-finite rule's: only a finite loss below zero says "signed".
        if step.loss is not None and -math.inf < step.loss < 0.0 and not state.signed:
            return self._let_go_of_loss(state) + self._run(state.steps, "observe", step, step.step)
        return self._run(state.steps, "observe", step, step.step)

    def observe_early(self, step: Step, whole: bool) -> list[Transition]:
        """Page a non-finite value in one rank's report now, before its step is judged.

        ``step`` is one rank's row; ``whole``: its job is judged as a whole (the
        assembled step will follow). Only rules with the non-finite detector that
        fire on one observation take part; each judges the row with a fresh
        detector (the rule's own keeps judging the records :meth:`observe` gets)
        and, if active, opens the incident on the slot the judged record will
        reach: the job's assembled slot when ``whole`` (the alert names this
        rank, as the assembled step's blame would when it went bad here first),
        else the rank's. The judged record then continues that incident: same
        alert id, no second firing (``AlertLifecycle.open_early``).
        """
        if not self._early_rules:
            return []
        state = self._rank(step.job, None if whole else step.rank, step.step)
        transitions: list[Transition] = []
        for position in self._early_rules:
            slot = state.all[position]
            detector = self.rules[self._rank_rules[position]].make_detector()
            finding = detector.observe(step) if isinstance(detector, NonFiniteDetector) else None
            if finding is None or not finding.active:
                continue
            if whole:
                finding = _blamed(finding, _own_blame(step))
            transition = slot.lifecycle.open_early(step.step, finding)
            if transition is not None:
                transitions.append(transition)
        return transitions

    def observe_stats(self, stats: Stats) -> list[Transition]:
        """Feed one cadence sample to every rule that reads stats."""
        job = self._job(stats.job)
        if self._leads(job, stats):
            self._rebase_history(job, stats.step)
            job.history.observe_stats(stats)
        state = self._rank(stats.job, _key(stats), stats.step)
        transitions = [] if stats.census is None else self._take_census(job, stats)
        return transitions + self._run(state.stats, "observe_stats", stats, stats.step)

    def _take_census(self, job: _JobState, stats: Stats) -> list[Transition]:
        """What a census says of the whole job: its towers, and a loss declared unsupervised."""
        census = stats.census
        assert census is not None
        towers = (stats.layers, census.towers) if census.towers else None
        new_towers = towers is not None and towers != job.towers
        declared = not census.supervised_loss and not job.unsupervised
        if not (new_towers or declared):
            return []  # every cadence sample carries a census: most say nothing new
        states = [state for (name, _), state in self._ranks.items() if name == stats.job]
        if towers is not None and new_towers:
            job.towers = towers
            job.history.observe_towers(*towers)
            for state in states:
                _tell(state, "observe_towers", *towers)
        if not declared:
            return []
        job.unsupervised = job.history.unsupervised = True
        return [t for state in states if not state.signed for t in self._let_go_of_loss(state)]

    def observe_eval(self, ev: Eval) -> list[Transition]:
        """Feed one evaluation to every rule that reads evals."""
        job = self._job(ev.job)
        if self._leads(job, ev):
            self._rebase_history(job, ev.step)
            job.history.observe_eval(ev)
        state = self._rank(ev.job, _key(ev), ev.step)
        return self._run(state.evals, "observe_eval", ev, ev.step)

    def observe_notice(self, notice: AgentNotice) -> list[Transition]:
        """Feed one agent notice (a part of the monitoring switched itself off, contract C3)."""
        state = self._rank(notice.job, notice.rank, notice.step)
        return self._run(state.notices, "observe_notice", notice, notice.step)

    def data_changed(self, job: str, step: int) -> None:
        """The job changed its data or task on purpose at ``step``: re-baseline from there.

        Applied per rank when that rank's first record at or after ``step``
        arrives, so rows of the old data still in flight (ranks ship in
        batches) do not leak into the new baselines. Returns nothing: a
        re-baseline only ever resolves alerts later, through the detectors.
        """
        changes = self._job(job).data_changes
        if step not in changes:
            changes.append(step)
            changes.sort()

    def weights_written(self, job: str, rank: int, step: int) -> None:
        """``rank``'s weights were written outside its optimizer before ``step``'s update
        (agent/fence.py): its detectors and the job's assembled ones judge what follows."""
        for key in ((job, rank), (job, None)):
            if (state := self._ranks.get(key)) is not None:
                _tell(state, "weights_written", step)

    def tick(self, liveness: Sequence[Liveness]) -> list[Transition]:
        """Feed every known rank's progress (of any jobs) to the liveness rules, per job."""
        if not self._job_rules:
            return []
        by_job: dict[str, list[Liveness]] = {}
        for live in liveness:
            by_job.setdefault(live.job, []).append(live)
        transitions: list[Transition] = []
        for name, lives in by_job.items():
            job = self._job(name)
            if job.liveness is None:
                job.liveness = [self._slot(i, name, None, job) for i in self._job_rules]
            latest = max(live.last_step for live in lives)
            for slot in job.liveness:
                finding = slot.detector.observe_liveness(lives)
                if finding is not None:
                    # The step the finding is about: a stall names the step stuck in progress.
                    about = finding.evidence.get(
                        "stuck_step", finding.evidence.get("last_step", latest)
                    )
                    step = about if finding.active else latest
                    transitions += slot.lifecycle.advance(int(step), finding)
        return transitions

    def feed(self, record: Record) -> list[Transition]:
        """:meth:`observe`, :meth:`observe_stats` or :meth:`observe_eval`, by the record's type."""
        if isinstance(record, Step):
            return self.observe(record)
        if isinstance(record, Stats):
            return self.observe_stats(record)
        if isinstance(record, Eval):
            return self.observe_eval(record)
        if isinstance(record, AgentNotice):
            return self.observe_notice(record)
        raise TypeError(f"expected a Step, Stats, Eval or AgentNotice, not {type(record).__name__}")

    # ------------------------------------------------------------ state

    def firing(self) -> list[Alert]:
        """Alerts firing now, across jobs and ranks."""
        alerts = [
            slot.lifecycle.alert
            for slot in self._slots()
            if slot.lifecycle.state == "firing" and slot.lifecycle.alert is not None
        ]
        return alerts + [a for slot in self._slots() if (a := slot.lifecycle.overtaken)]

    def forget(self, job: str) -> list[Transition]:
        """Drop a finished job's state; its still-firing alerts come back resolved.

        Resolving them here means no receiver is left holding an alert that
        will never be resolved, as Prometheus does when a series disappears.
        """
        slots = [
            slot
            for key in [k for k in self._ranks if k[0] == job]
            for slot in self._ranks.pop(key).all
        ]
        state = self._jobs.pop(job, None)
        if state is not None and state.liveness:
            slots += state.liveness
        return [t for slot in slots for t in slot.lifecycle.close()]

    def jobs(self) -> list[str]:
        """Jobs the engine holds state for."""
        return sorted({job for job, _ in self._ranks} | set(self._jobs))

    def history(self, job: str) -> JobHistory | None:
        """The diagnosis history of ``job`` (read it from the thread that feeds the engine)."""
        state = self._jobs.get(job)
        return None if state is None else state.history

    # ------------------------------------------------------------ internals

    def _slots(self) -> list[_Slot]:
        slots = [slot for state in self._ranks.values() for slot in state.all]
        return slots + [slot for job in self._jobs.values() for slot in job.liveness or ()]

    def _job(self, name: str) -> _JobState:
        state = self._jobs.get(name)
        if state is None:
            state = self._jobs[name] = _JobState()
        return state

    @staticmethod
    def _rebase_history(job: _JobState, at_step: int) -> None:
        # Trends across a planned change compare two tasks: the diagnosis starts over.
        due = _latest_change(job.data_changes, job.history_from, at_step)
        if due is not None:
            job.history_from = due
            job.history = JobHistory()
            job.history.unsupervised = job.unsupervised
            if job.towers is not None:  # the model is the same: its towers too
                job.history.observe_towers(*job.towers)

    @staticmethod
    def _leads(job: _JobState, record: Record) -> bool:
        # An assembled record speaks for the whole job (lead -1) and outranks any rank's.
        rank = -1 if record.assembled else record.rank
        if job.lead is None or rank < job.lead:
            job.lead = rank
        return rank == job.lead

    def _rank(self, job: str, rank: int | None, at_step: int) -> _RankState:
        state = self._ranks.get((job, rank))
        owner = self._job(job)
        if state is None:
            slots = {i: self._slot(i, job, rank, owner) for i in self._rank_rules}
            state = _RankState(
                all=list(slots.values()),
                steps=[s for i, s in slots.items() if "observe" in self._inputs[i]],
                stats=[s for i, s in slots.items() if "observe_stats" in self._inputs[i]],
                evals=[s for i, s in slots.items() if "observe_eval" in self._inputs[i]],
                notices=[s for i, s in slots.items() if "observe_notice" in self._inputs[i]],
                supervised=[s for i, s in slots.items() if i in self._supervised],
            )
            self._ranks[(job, rank)] = state
            if owner.unsupervised:
                self._let_go_of_loss(state)  # nothing fired yet: no transitions
            if owner.towers is not None:
                _tell(state, "observe_towers", *owner.towers)
        due = _latest_change(owner.data_changes, state.baseline_from, at_step)
        if due is not None:
            state.baseline_from = due
            for slot, index in zip(state.all, self._rank_rules, strict=True):
                slot.detector = self.rules[index].make_detector()
            if owner.towers is not None:
                _tell(state, "observe_towers", *owner.towers)
            if state.signed:
                _tell(state, "loss_not_supervised")
        return state

    def _slot(self, index: int, job: str, rank: int | None, owner: _JobState) -> _Slot:
        # rank None: a job-wide slot (liveness rules, and rules over assembled records).
        spec, rule = self.rules[index], self._alert_rules[index]
        checks = tuple(rule.diagnosis["next_checks"]) if rule.diagnosis is not None else ()

        def explain(alert: Alert) -> Mapping[str, Any]:
            return diagnose(owner.history, alert, checks)  # read late: a data change renews it

        lifecycle = AlertLifecycle(rule, job=job, rank=rank, clock=self._clock, diagnose=explain)
        return _Slot(spec.make_detector(), lifecycle)

    def _run(self, slots: list[_Slot], method: str, record: Record, step: int) -> list[Transition]:
        transitions: list[Transition] = []
        blame = record.blame if isinstance(record, Step) else None
        for slot in slots:
            finding = getattr(slot.detector, method)(record)
            if finding is not None:
                if blame and finding.active and finding.rank is None:
                    finding = _blamed(finding, blame)
                transitions += slot.lifecycle.advance(step, finding)
        return transitions

    def _let_go_of_loss(self, state: _RankState) -> list[Transition]:
        """A loss below zero: stop the supervised-loss rules here and resolve what they fired."""
        state.signed = True
        _tell(state, "loss_not_supervised")
        let_go = {id(slot) for slot in state.supervised}
        state.steps = [slot for slot in state.steps if id(slot) not in let_go]
        # Ended now: no later observation comes to outlast a rule's keep_firing_for.
        return [t for slot in state.supervised for t in slot.lifecycle.close()]


def _tell(state: _RankState, method: str, *args: Any) -> None:
    """Call ``method`` on the detectors of ``state`` that have it (``observe_towers``,
    ``loss_not_supervised``: what a census says of the whole job); the others ignore it."""
    for slot in state.all:
        tell = getattr(slot.detector, method, None)
        if tell is not None:
            tell(*args)


def _key(record: Record) -> int | None:
    """The engine's per-rank key: None for an assembled (job-wide) record."""
    return None if record.assembled else record.rank


def _blamed(finding: Finding, blame: Mapping[str, int]) -> Finding:
    """Name the rank where the finding's first non-finite layer (or the loss) went bad first."""
    named = finding.evidence.get("first_nonfinite") or ()
    where = next((name for name in named if name in blame), "loss" if "loss" in blame else None)
    rank = blame[where] if where is not None else min(blame.values())
    evidence = {**finding.evidence, "first_bad_rank": rank}
    summary = f"{finding.summary} (first on rank {rank}" + (f", {where})" if where else ")")
    return replace(finding, rank=rank, summary=summary, evidence=evidence)


def _own_blame(step: Step) -> dict[str, int]:
    """The blame one rank's row gives: its non-finite layers and loss, all on its rank."""
    blame = dict.fromkeys(nonfinite_layers(step), step.rank)
    if step.loss is not None and not math.isfinite(step.loss):
        blame["loss"] = step.rank
    return blame or {"grad_norm": step.rank}


def _latest_change(changes: list[int], applied: int, at_step: int) -> int | None:
    """The newest announced change after ``applied`` that ``at_step`` has reached, if any."""
    due = [s for s in changes if applied < s <= at_step]
    return due[-1] if due else None
