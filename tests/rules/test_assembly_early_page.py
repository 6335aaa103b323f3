"""An early page from one rank's report and the assembled verdict are one incident.

The real ``Assembler`` and ``Engine`` with the default rules: the engine pages a
rank's non-finite row (``observe_early``), and the steps the assembler completes
afterwards continue that incident (same alert id, no second firing) whatever
rank the assembly blames.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.alert import Transition
from gradwatch.rules.assembly import Assembler
from gradwatch.rules.rulefile import load_rules_text
from gradwatch.rules.step import Step

LAYERS = ("a", "b")
NAN = math.nan


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(step: int, rank: int, *, loss: float = 1.0, norm: float = 1.0, t: float = 0.0) -> Step:
    norms = np.array([norm, 0.5], np.float64)
    return Step(
        job="j",
        step=step,
        time=float(step) + t,
        rank=rank,
        loss=loss,
        grad_norm=float(np.sqrt(np.square(norms).sum())),
        layers=LAYERS,
        layer_norms=norms,
        lr=(0.1,),
        world=2,
        shards=2,
    )


class Job:
    """Two FSDP ranks through a real assembler into a real engine."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.clock = Clock()
        self.engine = engine or Engine(load_default_rules(), clock=self.clock)
        self.assembler = Assembler(5.0, self.clock)
        self.transitions: list[Transition] = []

    def add(self, step: Step) -> None:
        for whole in self.assembler.add(step):
            self.transitions += self.engine.observe(whole)

    def numerical(self) -> list[tuple[str, str, int | None, int]]:
        return [
            (t.alert.id, t.current, t.alert.rank, t.alert.step)
            for t in self.transitions
            if t.alert.category == "numerical"
        ]


def test_the_assembled_verdict_continues_the_early_page_without_paging_again() -> None:
    job = Job()
    for step in (1, 2):
        job.add(report(step, 0))
        job.add(report(step, 1))
    early = job.engine.observe_early(report(4, 1, loss=NAN, norm=NAN), whole=True)
    assert [(t.current, t.alert.rank, t.alert.step) for t in early] == [("firing", 1, 4)]
    page = early[0].alert
    assert page.evidence["first_bad_rank"] == 1
    # Step 3, clean, was still in flight: it is older than the paged step and decides nothing.
    job.add(report(3, 0))
    job.add(report(3, 1))
    job.add(report(4, 0))
    job.add(report(4, 1, loss=NAN, norm=NAN))
    assert job.numerical() == [], "no second firing, no resolve before the paged step"
    (firing,) = [a for a in job.engine.firing() if a.category == "numerical"]
    assert firing.id == page.id and firing.evidence["paged_early_from_rank"] == 1
    job.add(report(5, 0))
    job.add(report(5, 1))
    assert job.numerical() == [(page.id, "resolved", 1, 4)]


def test_a_different_first_bad_rank_in_assembly_corrects_the_evidence_not_the_incident() -> None:
    job = Job()
    job.add(report(1, 0))
    job.add(report(1, 1))
    # Rank 1's report arrives first, but rank 0 logged its NaN earlier (agent time).
    (early,) = job.engine.observe_early(report(2, 1, loss=NAN, t=0.5), whole=True)
    job.add(report(2, 1, loss=NAN, t=0.5))
    job.add(report(2, 0, loss=NAN, t=0.1))
    (firing,) = [a for a in job.engine.firing() if a.category == "numerical"]
    assert firing.id == early.alert.id and firing.rank == 1  # one incident, one identity
    assert firing.evidence["first_bad_rank"] == 0  # what assembly found
    assert job.numerical() == []
    job.add(report(3, 0))
    job.add(report(3, 1))
    assert job.numerical() == [(early.alert.id, "resolved", 1, 2)]


def test_rules_with_a_for_or_without_the_nonfinite_detector_never_page_early() -> None:
    rules = load_rules_text(
        """
groups:
  - name: g
    rules:
      - alert: NonFiniteTwice
        detector: nonfinite
        for: 2
        severity: critical
        category: numerical
"""
    )
    engine = Engine(rules, clock=Clock())
    assert engine.observe_early(report(2, 1, loss=NAN), whole=True) == []
    job = Job(engine)
    job.add(report(2, 0, loss=NAN))
    job.add(report(2, 1, loss=NAN))
    job.add(report(3, 0, loss=NAN))
    job.add(report(3, 1, loss=NAN))
    assert [t.current for t in job.transitions] == ["firing"]  # its `for` still counts


def test_a_rule_that_acts_on_the_job_pages_in_turn_not_early() -> None:
    # A rollback must see every message that arrived before the NaN's batch (the checkpoint
    # report it rolls back to above all), so its rule never pages ahead of them: the
    # default NaN rule, configured to roll back as operations.md shows.
    rules = [
        replace(r, actions=("notify", "rollback")) if r.detector == "nonfinite" else r
        for r in load_default_rules()
    ]
    engine = Engine(rules, clock=Clock())
    assert engine.observe_early(report(2, 1, loss=NAN), whole=False) == []
    job = Job(engine)
    job.add(report(2, 0, loss=NAN))
    job.add(report(2, 1, loss=NAN))
    assert job.numerical()[0][1] == "firing"  # in turn, as before


def test_a_finite_report_or_an_incident_already_firing_pages_nothing() -> None:
    job = Job()
    assert job.engine.observe_early(report(2, 1), whole=True) == []
    job.add(report(2, 0, loss=NAN))
    job.add(report(2, 1, loss=NAN))
    assert [t.current for t in job.transitions] == ["firing"]
    assert job.engine.observe_early(report(3, 1, loss=NAN), whole=True) == []


def test_a_rank_judged_alone_is_paged_on_its_own_slot_with_the_same_id() -> None:
    clock = Clock()
    engine = Engine(load_default_rules(), clock=clock)

    def alone(step: int, loss: float) -> Step:
        return Step(
            job="solo", step=step, time=float(step), rank=0, loss=loss, grad_norm=1.0, world=1
        )

    (early,) = engine.observe_early(alone(7, NAN), whole=False)
    later = engine.observe(alone(6, 1.0)) + engine.observe(alone(7, NAN))
    assert later == []
    (resolved,) = engine.observe(alone(8, 1.0))
    assert (resolved.current, resolved.alert.id) == ("resolved", early.alert.id)
    assert early.alert.rank == 0 and early.alert.step == 7


def test_an_earlier_nan_the_early_page_overtook_is_its_own_incident() -> None:
    # Rank 1's batch (a NaN at step 6) arrives before rank 0's (a NaN at step 4, clean
    # around it): the early page opened at 6 must not swallow the incident at 4, nor take
    # its evidence (collector_load.py lost one probe alert in three this way).
    job = Job()
    for step in (1, 2):
        job.add(report(step, 0))
        job.add(report(step, 1))
    (early,) = job.engine.observe_early(report(6, 1, loss=NAN, norm=NAN), whole=True)
    for step in range(3, 8):
        job.add(report(step, 0, loss=NAN if step == 4 else 1.0))
        job.add(report(step, 1, loss=NAN if step == 6 else 1.0, norm=NAN if step == 6 else 1.0))
        if step == 4:  # both fire now: what the collector's API lists
            firing = [a.step for a in job.engine.firing() if a.category == "numerical"]
            assert sorted(firing) == [4, 6]
    assert [(state, rank, step) for _, state, rank, step in job.numerical()] == [
        ("firing", 0, 4),  # judged in turn: the NaN the early page overtook
        ("resolved", 0, 4),  # step 5 is clean
        ("resolved", 1, 6),  # the early page's incident, ended by step 7
    ]
    earlier = job.transitions[0].alert
    assert earlier.id != early.alert.id and earlier.evidence["first_bad_rank"] == 0
    resolved_early = job.transitions[-1].alert
    assert resolved_early.id == early.alert.id and resolved_early.evidence["first_bad_rank"] == 1


def test_an_earlier_nan_running_into_the_early_pages_step_ends_with_it() -> None:
    # NaN from step 4 to step 6 on rank 0 (the early page came from rank 1's step 6): the
    # earlier incident is the same condition, paged with its true onset, and ends with it.
    job = Job()
    job.add(report(1, 0))
    job.add(report(1, 1))
    (early,) = job.engine.observe_early(report(6, 1, loss=NAN), whole=True)
    for step in range(2, 8):
        bad = 4 <= step <= 6
        job.add(report(step, 0, loss=NAN if bad else 1.0))
        job.add(report(step, 1, loss=NAN if step == 6 else 1.0))
    assert [(state, rank, step) for _, state, rank, step in job.numerical()] == [
        ("firing", 0, 4),
        ("resolved", 0, 4),
        ("resolved", 1, 6),
    ]
    assert job.transitions[1].alert.evidence["continued_as"] == early.alert.id


def test_a_job_forgotten_while_an_overtaken_nan_fires_resolves_both() -> None:
    job = Job()
    job.add(report(1, 0))
    job.add(report(1, 1))
    (early,) = job.engine.observe_early(report(4, 1, loss=NAN), whole=True)
    job.add(report(2, 0, loss=NAN))
    job.add(report(2, 1))
    (earlier,) = job.transitions
    ended = job.engine.forget("j")
    numerical = [(t.alert.id, t.current) for t in ended if t.alert.category == "numerical"]
    assert numerical == [(earlier.alert.id, "resolved"), (early.alert.id, "resolved")]
