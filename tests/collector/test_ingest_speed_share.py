"""The fair share does not starve a large job that is alone (issue 17, 16,384 ranks).

A 16,384-rank job is one sender: alone, it may use the whole ingest thread and
runs up no debt, so once another sender shows up it gets its share at once.
Under contention a sender over its share is still refused
(tests/collector/test_bounds.py).
"""

from __future__ import annotations

from gradwatch.collector.limits import Admission, Bounds


def test_a_sender_alone_may_use_the_whole_thread() -> None:
    now = [0.0]
    admission = Admission(
        Bounds(ingest_share=0.5, ingest_burst_seconds=0.2), clock=lambda: now[0], rss=lambda: 0
    )
    for _ in range(5):  # 0.9 s of the last second: contended, but nobody else sends
        admission.charge("big-job", 0.18, rows=10)
        assert admission.allow("big-job", rows=10)
    assert admission.utilisation() > 0.5
    assert admission.refused()["share"] == 0


def test_a_sender_alone_runs_up_no_debt_and_gets_its_share_once_another_comes() -> None:
    now = [0.0]
    admission = Admission(
        Bounds(ingest_share=0.5, ingest_burst_seconds=0.2), clock=lambda: now[0], rss=lambda: 0
    )
    for _ in range(100):  # ten seconds alone at 90% of the thread
        now[0] += 0.1
        assert admission.allow("big-job", rows=10)
        admission.charge("big-job", 0.09, rows=10)
    assert admission.allow("light")  # another sender: the shares apply from now on
    assert not admission.allow("big-job", rows=10)  # no tokens left: refused, counted
    assert admission.refused()["share"] == 1
    # Alone it ran up no debt: 0.4 s later its share (0.25 s a second) covers a
    # batch (0.09 s) again, while the thread is still contended; with the ~4 s of
    # debt it would have had to pay back first, it would wait ~16 s.
    now[0] += 0.4
    assert admission.utilisation() > 0.5
    assert admission.allow("big-job", rows=10)
