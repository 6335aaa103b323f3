"""Durable bookkeeping of the checkpoints each job reported, for rollbacks.

A rollback must name the last checkpoint saved **before** the incident began:
the newest one may already hold poisoned weights (DESIGN, Actions). The agent
reports every save (``mon.checkpoint_saved(step, path)``, a ``checkpoint``
event); this store keeps them per job in SQLite so a collector restart still
knows where to roll back to.

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
MAX_PER_JOB = 1000

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    job   TEXT    NOT NULL,
    step  INTEGER NOT NULL,
    path  TEXT    NOT NULL,
    time  REAL    NOT NULL,
    rank  INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, step, rank)
);
"""


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """One checkpoint a job reported: its step, path, agent time and rank."""

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
    db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False,
                         isolation_level=None, timeout=5.0)
    if path is not None:
        db.execute("PRAGMA journal_mode=WAL")
    return db


class CheckpointStore:
    """Checkpoints per job in the SQLite file at ``path`` (memory when ``None``); thread-safe."""

    def __init__(self, path: Path | None, db: sqlite3.Connection | None = None,
                 lock: threading.Lock | None = None) -> None:
        self._owns = db is None  # a shared connection is closed by its owner
        self._db = connect(path) if db is None else db
        self._lock = lock or threading.Lock()
        with self._lock:
            self._db.executescript(SCHEMA)

    def add(self, job: str, step: int, path: str, time: float, rank: int = 0) -> None:
        """Record a save; a second report of the same (job, step, rank) replaces the first."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                             (job, step, path, time, rank))
            self._db.execute(
                "DELETE FROM checkpoints WHERE job = ? AND step NOT IN (SELECT step FROM "
                "checkpoints WHERE job = ? ORDER BY step DESC LIMIT ?)", (job, job, MAX_PER_JOB))

    def last_good(self, job: str, before_step: int, margin: int = 0) -> SavedCheckpoint | None:
        """The newest checkpoint of ``job`` with ``step < before_step - margin``, or ``None``.

        ``before_step`` is the alert's ``step``: where its condition first held.
        When ranks saved the same step, rank 0's wins (it is the one usually written).
        """
        with self._lock:
            row = self._db.execute(
                "SELECT job, step, path, time, rank FROM checkpoints WHERE job = ? AND step < ? "
                "ORDER BY step DESC, rank ASC LIMIT 1", (job, before_step - margin)).fetchone()
        return None if row is None else SavedCheckpoint(*row)

    def of(self, job: str) -> list[SavedCheckpoint]:
        """Every checkpoint kept for ``job``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT job, step, path, time, rank FROM checkpoints WHERE job = ? "
                "ORDER BY step, rank", (job,)).fetchall()
        return [SavedCheckpoint(*row) for row in rows]

    def close(self) -> None:
        if self._owns:
            with self._lock:
                self._db.close()
