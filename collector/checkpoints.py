"""Durable bookkeeping of the checkpoints each job reported, for rollbacks.

A rollback must name the last checkpoint saved **before** the incident began:
the newest one may already hold poisoned weights (DESIGN, Actions). The agent
reports every save (``mon.checkpoint_saved(step, path)``, a ``checkpoint``
event); this store keeps them per job in SQLite so a collector restart still
knows where to roll back to.

What it keeps is a hint, not a trust anchor: anyone who can reach the ingest
socket (in the dev profile, anyone) can report a checkpoint, so the agent
accepts a rollback only to a checkpoint it recorded itself
(``gradwatch.agent.checkpoints``). Still, the store is bounded and
append-only: an entry, once written, is never replaced (a second report of the
same ``(job, step, rank)`` is refused and counted), at most ``max_per_job``
entries per job and ``max_rows`` in all are kept, and entries older than
``max_age_s`` are pruned.

Example::

    >>> from gradwatch.collector.checkpoints import CheckpointStore
    >>> store = CheckpointStore(None)          # in memory; a Path for a file
    >>> for step in (100, 200, 300):
    ...     store.add("run-42", step, f"ckpt/{step}.pt", time=0.0)
    >>> store.last_good("run-42", before_step=250).path   # the incident began at step 250
    'ckpt/200.pt'
    >>> store.close()
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

# A job reporting a checkpoint every few steps for weeks must not grow the file
# without bound; a rollback never reaches further back than this many saves.
MAX_PER_JOB = 100
MAX_ROWS = 100_000  # every job together (a name bomb of one save per job)
MAX_AGE_S = 7 * 24 * 3600.0  # a week: older saves are pruned at the next report

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    job   TEXT    NOT NULL,
    step  INTEGER NOT NULL,
    path  TEXT    NOT NULL,
    time  REAL    NOT NULL,
    rank  INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, step, rank)
);
CREATE INDEX IF NOT EXISTS checkpoints_by_time ON checkpoints (time);
"""


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """One checkpoint a job reported: its step, path, when the collector heard of it, rank."""

    job: str
    step: int
    path: str
    time: float
    rank: int = 0


def connect(path: Path | None) -> sqlite3.Connection:
    """Open ``path`` (created if missing; ``None`` for memory) for use from several threads.

    WAL lets a reader (a scrape) proceed while the ingest thread writes; every
    use goes through the owner's lock, so sharing the connection is safe.
    """
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(
        ":memory:" if path is None else str(path),
        check_same_thread=False,
        isolation_level=None,
        timeout=5.0,
    )
    if path is not None:
        db.execute("PRAGMA journal_mode=WAL")
    return db


class CheckpointStore:
    """Checkpoints per job in the SQLite file at ``path`` (memory when ``None``); thread-safe."""

    def __init__(
        self,
        path: Path | None,
        db: sqlite3.Connection | None = None,
        lock: threading.Lock | None = None,
        *,
        max_per_job: int = MAX_PER_JOB,
        max_rows: int = MAX_ROWS,
        max_age_s: float = MAX_AGE_S,
    ) -> None:
        self._owns = db is None  # a shared connection is closed by its owner
        self._db = connect(path) if db is None else db
        self._lock = lock or threading.Lock()
        self.max_per_job, self.max_rows, self.max_age_s = max_per_job, max_rows, max_age_s
        with self._lock:
            self._db.executescript(SCHEMA)
            (self._rows,) = self._db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()

    def add(
        self, job: str, step: int, path: str, time: float, rank: int = 0, now: float | None = None
    ) -> bool:
        """Record a save; False (nothing changed) when ``(job, step, rank)`` is already known.

        Entries are immutable: a later report of the same key never replaces
        the first. ``now`` prunes entries whose ``time`` is older than
        ``max_age_s``: pass the collector's clock as both (an agent's clock
        could claim any time and dodge the pruning).
        """
        with self._lock:
            if now is not None:
                self._rows -= self._db.execute(
                    "DELETE FROM checkpoints WHERE time < ?", (now - self.max_age_s,)
                ).rowcount
            if self._rows >= self.max_rows:
                # Full of recent saves: the oldest go first, whichever job they belong to.
                self._rows -= self._db.execute(
                    "DELETE FROM checkpoints WHERE rowid IN (SELECT rowid FROM checkpoints "
                    "ORDER BY time LIMIT ?)",
                    (max(1, self.max_rows // 100),),
                ).rowcount
            added = (
                self._db.execute(
                    "INSERT OR IGNORE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                    (job, step, path, time, rank),
                ).rowcount
                == 1
            )
            if not added:
                return False
            self._rows += 1
            self._rows -= self._db.execute(
                "DELETE FROM checkpoints WHERE job = ? AND step NOT IN (SELECT DISTINCT step "
                "FROM checkpoints WHERE job = ? ORDER BY step DESC LIMIT ?)",
                (job, job, self.max_per_job),
            ).rowcount
            return True

    def rows(self) -> int:
        """Entries kept, every job together."""
        with self._lock:
            return int(self._rows)

    def last_good(self, job: str, before_step: int, margin: int = 0) -> SavedCheckpoint | None:
        """The newest checkpoint of ``job`` with ``step < before_step - margin``, or ``None``.

        ``before_step`` is the alert's ``step``: where its condition first held.
        When ranks saved the same step, rank 0's wins (it is the one usually written).
        """
        with self._lock:
            row = self._db.execute(
                "SELECT job, step, path, time, rank FROM checkpoints WHERE job = ? AND step < ? "
                "ORDER BY step DESC, rank ASC LIMIT 1",
                (job, before_step - margin),
            ).fetchone()
        return None if row is None else SavedCheckpoint(*row)

    def of(self, job: str) -> list[SavedCheckpoint]:
        """Every checkpoint kept for ``job``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT job, step, path, time, rank FROM checkpoints WHERE job = ? "
                "ORDER BY step, rank",
                (job,),
            ).fetchall()
        return [SavedCheckpoint(*row) for row in rows]

    def close(self) -> None:
        if self._owns:
            with self._lock:
                self._db.close()
