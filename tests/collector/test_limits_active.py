"""The fair share's active-sender count is O(1) per message and counts what the scan did.

``Admission`` used to scan every sender's bucket (three times per message) to
count the active ones and to tell whether a sender is alone; it now keeps the
senders in order of their last message (issue 17). Over a random run, the
count and the "alone" answer must equal the old scan's, and ``decide`` (one
call, one lock) must answer as ``unit`` then ``allow`` did.
"""

from __future__ import annotations

import random

from gradwatch.collector.limits import ACTIVE_S, Admission, Bounds
from gradwatch.wire import Heartbeat


def _scan_active(admission: Admission, now: float) -> int:
    """The old O(senders) count, from the buckets themselves."""
    return max(1, sum(1 for b in admission._buckets.values() if now - b.last < ACTIVE_S))


def _scan_alone(admission: Admission, unit: str, now: float) -> bool:
    return not any(u != unit and now - b.last < ACTIVE_S for u, b in admission._buckets.items())


def test_active_senders_match_the_scan_over_a_random_run() -> None:
    now = [0.0]
    admission = Admission(
        Bounds(max_jobs=8, ingest_share=0.5, ingest_burst_seconds=0.2),
        clock=lambda: now[0],
        rss=lambda: 0,
    )
    rng = random.Random(17)
    units = [f"job{i}" for i in range(12)]  # more than max_jobs + 1: buckets get pruned
    checked = 0
    for _ in range(3000):
        now[0] += rng.choice([0.0, 0.001, 0.01, 0.3, 2.5, 6.0])
        unit = rng.choice(units)
        action = rng.random()
        if action < 0.5:
            admission.charge(unit, rng.uniform(0.0, 0.5), rows=rng.randint(0, 20))
        elif action < 0.9:
            admission.allow(unit, rows=rng.randint(0, 20))
        else:
            admission.forget(unit)
        with admission._lock:
            for probe in units:
                assert admission._alone(probe, now[0]) == _scan_alone(admission, probe, now[0])
            assert admission._active(now[0]) == _scan_active(admission, now[0])
        checked += 1
    assert checked == 3000
    assert admission.refused()["share"] > 0  # the run reached contention


def test_decide_answers_as_unit_then_allow() -> None:
    now = [0.0]

    def fresh() -> Admission:
        a = Admission(
            Bounds(ingest_share=0.5, ingest_burst_seconds=0.2),
            clock=lambda: now[0],
            rss=lambda: 0,
        )
        a.admit(Heartbeat("known", 0, 1, "i", 0.0, 0, 0))
        return a

    one, two = fresh(), fresh()
    rng = random.Random(3)
    answers = []
    for _ in range(500):
        now[0] += rng.choice([0.0, 0.05, 0.5])
        job = rng.choice(["known", "stranger", None])
        key = rng.choice(["", "", "k1"])
        rows = rng.randint(0, 20)
        decided = one.decide(job, key, rows)
        unit = two.unit(job, key)
        allowed = two.allow(unit, rows)
        assert decided == (unit if allowed else None)
        answers.append(decided)
        if decided is not None:
            seconds = rng.uniform(0.0, 0.3)
            one.charge(decided, seconds, rows)
            two.charge(unit, seconds, rows)
    assert one.refused() == two.refused()
    assert None in answers and "known" in answers  # both answers were exercised
