"""One job cannot bury another's page: eviction order and round-robin delivery.

Issue 15, finding 3.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gradwatch.collector.outbox_store import Outbox


def pending_ids(outbox: Outbox) -> set[str]:
    return {row.id for row in outbox.due("s", now=1e9, limit=10_000)}


def test_a_critical_is_never_evicted_by_other_jobs_warnings() -> None:
    outbox = Outbox(max_pending=3)
    outbox.put("s", "real:firing", "{}", now=0.0, job="real", severity="critical")
    dropped = sum(
        outbox.put(
            "s", f"w{i}:firing", "{}", now=1.0 + i, job=f"noise-{i % 5}", severity="warning"
        )[1]
        for i in range(50)
    )
    assert dropped == 48 and "real:firing" in pending_ids(outbox)
    outbox.close()


def test_a_flooding_job_evicts_its_own_rows_first() -> None:
    outbox = Outbox(max_pending=10)
    outbox.put("s", "real:firing", "{}", now=0.0, job="real", severity="critical")
    for i in range(1000):  # forged NaN alerts of one job, all critical
        outbox.put("s", f"f{i}:firing", "{}", now=1.0 + i, job="forged", severity="critical")
    kept = pending_ids(outbox)
    assert len(kept) == 10 and "real:firing" in kept
    # Within the flooding job the oldest go first: its newest nine are kept.
    assert kept - {"real:firing"} == {f"f{i}:firing" for i in range(991, 1000)}
    outbox.close()


def test_delivery_is_critical_first_then_round_robin_across_jobs() -> None:
    outbox = Outbox(max_pending=10_000)
    for i in range(2625):  # finding 3: a real alert behind 2,625 forged ones
        outbox.put(
            "s", f"f{i}:firing", "{}", now=float(i), job=f"forged-{i % 3}", severity="critical"
        )
    outbox.put("s", "info:firing", "{}", now=0.5, job="real", severity="info")
    outbox.put("s", "real:firing", "{}", now=3000.0, job="real", severity="critical")
    first = [row.id for row in outbox.due("s", now=1e9, limit=4)]
    assert "real:firing" in first  # one row per job per round, not after the whole backlog
    assert "info:firing" not in first
    outbox.close()


def test_an_outbox_file_of_an_older_version_gains_the_new_columns(tmp_path: Path) -> None:
    path = tmp_path / "outbox.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE outbox (sink TEXT NOT NULL, id TEXT NOT NULL, body TEXT NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL, next_attempt_at REAL NOT NULL, updated_at REAL NOT NULL,
            PRIMARY KEY (sink, id)) WITHOUT ROWID;
        INSERT INTO outbox (sink, id, body, created_at, next_attempt_at, updated_at)
            VALUES ('s', 'old:firing', '{}', 0, 0, 0);
    """)
    db.close()
    outbox = Outbox(path)
    assert pending_ids(outbox) == {"old:firing"}  # kept, as a warning of job ''
    assert outbox.put("s", "new:firing", "{}", now=1.0, job="j", severity="critical") == (True, 0)
    outbox.close()


def test_under_curve_one_key_is_one_share_of_the_outbox() -> None:
    from gradwatch.collector.limits import Admission, Bounds
    from gradwatch.wire import Heartbeat

    admission = Admission(Bounds(), rss=lambda: 0)
    for i in range(50):
        admission.admit(Heartbeat(f"k-{i}", 0, 1, "i", 0.0, 0, 0), key="MANYJOBS")
    admission.admit(Heartbeat("other", 0, 1, "i", 0.0, 0, 0), key="TEAM2")
    outbox = Outbox(max_pending=10)
    outbox.put(
        "s", "team2:firing", "{}", now=0.0, job=admission.sender_of("other"), severity="critical"
    )
    for i in range(50):  # fifty jobs of one key: one sharing unit, evicting its own rows
        outbox.put(
            "s",
            f"k{i}:firing",
            "{}",
            now=1.0 + i,
            job=admission.sender_of(f"k-{i}"),
            severity="critical",
        )
    assert "team2:firing" in pending_ids(outbox)
    assert admission.sender_of("k-3") == "MANYJOBS" and admission.sender_of("nokey") == "nokey"
    outbox.close()
