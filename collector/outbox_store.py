"""The outbox's store: one SQLite table of notifications, durable and bounded.

:class:`Outbox` is ``<data_dir>/outbox.sqlite3`` (WAL; in memory when there is
no data dir) of ``(sink, id, body, state, attempts, created_at,
next_attempt_at, job, severity)``. Several sinks share one file, each through
its own ``Outbox`` connection. What is stored, when it is evicted, in which
order it is due and how it falls back to memory on a failed write is
described in :mod:`gradwatch.collector.outbox`, whose :class:`OutboxSink`
delivers from it.

Example::

    from gradwatch.collector.outbox_store import Outbox

    outbox = Outbox.open(None)   # in memory; Outbox.open(Path("/var/lib/gradwatch")) on disk
    print(outbox.durable)        # False
    outbox.close()
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gradwatch.collector.config import CollectorError
from gradwatch.collector.webhook import RetryPolicy

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# SQLITE_BUSY and SQLITE_LOCKED: SQLite's stable result codes (the sqlite3 module names
# them only from Python 3.11, and the package supports 3.10).
_BUSY = (5, 6)

OUTBOX_FILE = "outbox.sqlite3"
DEFAULT_MAX_AGE_S = 24 * 3600.0
DEFAULT_MAX_PENDING = 10_000
DURABLE_RETRY = RetryPolicy(base_delay=1.0, max_delay=300.0, max_retry_after=3600.0)
BATCH = 32  # due rows taken per pass
PRUNE_EVERY_S = 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    sink TEXT NOT NULL,
    id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    next_attempt_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    job TEXT NOT NULL DEFAULT '',
    severity INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (sink, id)
) WITHOUT ROWID;
"""
# Created after the columns exist: an outbox file of an older version gains them first.
_INDEXES = """
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (sink, state, next_attempt_at);
CREATE INDEX IF NOT EXISTS outbox_fair ON outbox (sink, state, severity, job, created_at);
"""
_COLUMNS = {"job": "TEXT NOT NULL DEFAULT ''", "severity": "INTEGER NOT NULL DEFAULT 1"}
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}

# The victim when over max_pending: see the module doc's eviction order.
_VICTIM_JOB = """
SELECT job FROM outbox WHERE sink = ? AND state = 'pending' AND severity = ? AND id IS NOT ?
GROUP BY job ORDER BY COUNT(*) DESC, MIN(created_at) LIMIT 1
"""
_VICTIM = """
SELECT id FROM outbox WHERE sink = ? AND state = 'pending' AND severity = ? AND job = ?
AND id IS NOT ? ORDER BY created_at LIMIT 1
"""
# Due rows: critical first, then round-robin across jobs (n = the row's place in its job).
_DUE = """
SELECT sink, id, body, attempts, created_at, next_attempt_at FROM (
    SELECT *, ROW_NUMBER() OVER (PARTITION BY job ORDER BY severity DESC, next_attempt_at,
                                 created_at) AS n
    FROM outbox WHERE sink = ? AND state = 'pending' AND next_attempt_at <= ?)
ORDER BY severity DESC, n, next_attempt_at, created_at LIMIT ?
"""


class OutboxError(CollectorError):
    """The outbox file cannot be opened or written; the message says what to check."""


@dataclass(frozen=True, slots=True)
class Pending:
    """One notification waiting to be sent."""

    sink: str
    id: str
    body: str
    attempts: int
    created_at: float
    next_attempt_at: float


class Outbox:
    """The SQLite table behind every :class:`OutboxSink`; thread-safe."""

    def __init__(self, path: Path | None = None, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.path = path
        self.max_pending = max_pending
        self.errors = 0  # failed writes to the file; the first one moves the rows to memory
        self._in_memory = path is None
        self._lock = threading.Lock()
        try:
            # One connection shared under a lock: the ingest thread inserts, workers update.
            self._db = sqlite3.connect(
                ":memory:" if path is None else str(path),
                isolation_level=None,
                check_same_thread=False,
            )
            if path is not None:
                # WAL + NORMAL: a committed row survives the process being killed
                # (kill -9); only an OS crash may lose the last transactions.
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            _create(self._db)
        except sqlite3.Error as exc:
            raise OutboxError(
                f"cannot open the alert outbox {path}: {exc}; check that the "
                "data dir exists, is writable and is not on a network "
                "filesystem"
            ) from exc

    @classmethod
    def open(cls, data_dir: Path | None, *, max_pending: int = DEFAULT_MAX_PENDING) -> Outbox:
        """``<data_dir>/outbox.sqlite3`` (the dir is created), or in memory for None."""
        if data_dir is None:
            return cls(None, max_pending=max_pending)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutboxError(
                f"cannot create the data dir {data_dir}: {exc.strerror or exc}; "
                "choose a writable --data-dir"
            ) from exc
        return cls(data_dir / OUTBOX_FILE, max_pending=max_pending)

    @property
    def durable(self) -> bool:
        """True while rows are written to the file: they survive a restart."""
        return not self._in_memory

    def put(
        self,
        sink: str,
        notification_id: str,
        body: str,
        now: float,
        sending: str | None = None,
        job: str = "",
        severity: str = "warning",
    ) -> tuple[bool, int]:
        """Store a new notification: (inserted, how many pending rows were dropped).

        A notification already stored (pending or finished) is not stored again.
        Past ``max_pending``, rows are dropped in the module doc's eviction
        order (``job`` and ``severity`` decide it). ``sending``, the id being
        sent right now, is never the one dropped: it may well arrive, and must
        not be counted both dropped and delivered.
        """
        rank = SEVERITY_RANK.get(severity, 1)

        def insert() -> tuple[bool, int]:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO outbox (sink, id, body, created_at, next_attempt_at, "
                    "updated_at, job, severity) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (sink, notification_id, body, now, now, now, job, rank),
                )
                if cur.rowcount == 0:
                    return False, 0
                dropped = 0
                for _ in range(max(0, self._count(sink) - self.max_pending)):
                    if not self._drop_one(sink, sending, now):
                        break
                    dropped += 1
                return True, dropped

        return self._write(insert)

    def _drop_one(self, sink: str, sending: str | None, now: float) -> bool:
        (lowest,) = self._db.execute(
            "SELECT MIN(severity) FROM outbox WHERE sink = ? AND state = 'pending' AND id IS NOT ?",
            (sink, sending),
        ).fetchone()
        if lowest is None:
            return False
        (job,) = self._db.execute(_VICTIM_JOB, (sink, lowest, sending)).fetchone()
        row = self._db.execute(_VICTIM, (sink, lowest, job, sending)).fetchone()
        if row is None:
            return False
        self._db.execute(
            "UPDATE outbox SET state = 'dropped', updated_at = ? WHERE sink = ? AND id = ?",
            (now, sink, row[0]),
        )
        return True

    def due(self, sink: str, now: float, limit: int = BATCH) -> list[Pending]:
        """Pending rows of ``sink`` whose time has come: critical first, round-robin by job."""
        with self._lock:
            rows = self._db.execute(_DUE, (sink, now, limit)).fetchall()
        return [Pending(*row) for row in rows]

    def next_due(self, sink: str) -> float | None:
        """When the earliest pending row of ``sink`` is due; None when nothing is pending."""
        with self._lock:
            (when,) = self._db.execute(
                "SELECT MIN(next_attempt_at) FROM outbox WHERE sink = ? AND state = 'pending'",
                (sink,),
            ).fetchone()
        return when

    def reschedule(self, row: Pending, at: float, now: float) -> None:
        self._update(
            "UPDATE outbox SET attempts = attempts + 1, next_attempt_at = ?, "
            "updated_at = ? WHERE sink = ? AND id = ?",
            (at, now, row.sink, row.id),
        )

    def finish(self, row: Pending, state: str, now: float) -> None:
        """Mark ``row`` ``delivered`` or ``failed``; it stays (deduplication) until pruned."""
        self._update(
            "UPDATE outbox SET state = ?, attempts = attempts + 1, updated_at = ? "
            "WHERE sink = ? AND id = ?",
            (state, now, row.sink, row.id),
        )

    def resume(self, sink: str, now: float) -> int:
        """Make every pending row of ``sink`` due now (after a restart); return how many."""
        self._update(
            "UPDATE outbox SET next_attempt_at = ? WHERE sink = ? AND state = 'pending' "
            "AND next_attempt_at > ?",
            (now, sink, now),
        )
        return self.pending(sink)

    def pending(self, sink: str) -> int:
        with self._lock:
            return self._count(sink)

    def prune(self, before: float) -> int:
        """Forget finished rows last touched before ``before``; return how many."""
        return self._update(
            "DELETE FROM outbox WHERE state != 'pending' AND updated_at < ?", (before,)
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _count(self, sink: str) -> int:
        (count,) = self._db.execute(
            "SELECT COUNT(*) FROM outbox WHERE sink = ? AND state = 'pending'", (sink,)
        ).fetchone()
        return int(count)

    def _update(self, sql: str, params: tuple[Any, ...]) -> int:
        return self._write(lambda: self._db.execute(sql, params).rowcount)

    def _write(self, change: Callable[[], _T]) -> _T:
        """Run ``change`` under the lock; if the file refuses it, move to memory and rerun it."""
        with self._lock:
            try:
                return change()
            except sqlite3.Error as exc:
                if self._in_memory or getattr(exc, "sqlite_errorcode", None) in _BUSY:
                    raise  # another connection holds the file: not a broken disk
                self._move_to_memory(exc)
            return change()

    def _move_to_memory(self, exc: sqlite3.Error) -> None:
        """Copy what the file holds into memory and continue there (called under the lock).

        Losing durability beats losing alerts: a full disk or a data dir turned
        read-only must not silence the collector. Reading usually still works,
        so pending rows come along; if not, memory starts empty.
        """
        self.errors += 1
        self._in_memory = True
        memory = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        try:
            if self._db.in_transaction:
                self._db.rollback()
            self._db.backup(memory)
            copied = "its pending alerts were copied there"
        except sqlite3.Error as copy_exc:
            copied = f"its rows could not be read ({copy_exc}), so it starts empty"
        _create(memory)
        old, self._db = self._db, memory
        try:
            old.close()
        except sqlite3.Error:
            pass  # the file is what failed; memory is what matters now
        log.error(
            "cannot write the alert outbox %s: %s. The outbox now lives in memory and "
            "%s: alerts are still delivered, but lost if the collector stops before "
            "sending them. Free disk space or fix the data dir's permissions, then restart the "
            "collector to make the outbox durable again",
            self.path,
            exc,
            copied,
        )


def _create(db: sqlite3.Connection) -> None:
    """The table and indexes; an outbox file of an older version gains the new columns."""
    db.executescript(_SCHEMA)
    have = {row[1] for row in db.execute("PRAGMA table_info(outbox)")}
    for name, kind in _COLUMNS.items():
        if name not in have:
            db.execute(f"ALTER TABLE outbox ADD COLUMN {name} {kind}")
    db.executescript(_INDEXES)
