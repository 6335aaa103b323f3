"""A durable outbox: every notification is stored before it is sent, then sent until it lands.

:class:`Outbox` is one SQLite table (``<data_dir>/outbox.sqlite3``, WAL; in
memory when there is no data dir) of ``(sink, id, body, state, attempts,
created_at, next_attempt_at)``. :class:`OutboxSink` is a :class:`Sink` over it:
``notify`` routes the transition and inserts a row (a local insert, never the
network); a worker thread takes due rows, sends them through a *channel* (which
formats the HTTP request: generic webhook, Slack, PagerDuty, Alertmanager) and
an injected transport, and marks each delivered, or reschedules it with
exponential backoff and jitter (``Retry-After`` honoured). A notification is
given up only when it is older than ``max_age`` (24 h by default), even when
the receiver rejects it (a 4xx is usually a misconfiguration someone fixes; it
is logged as a warning). On start the worker
resumes every pending row, so a collector killed with ``kill -9`` and started
again with the same data dir delivers what it had not. The id of a row is
``<alert id>:<state>``: the same notification is stored, and sent, once.

Bounded and fair between jobs: at most ``max_pending`` pending rows per sink.
Past that one row is dropped (counted and logged) per row stored, chosen in
this **eviction order**: (1) the lowest severity pending (``info`` before
``warning`` before ``critical``), so a critical alert is never evicted while a
warning or info is pending; (2) among those, a row of the job holding the most
of them (ties: the job whose oldest row is oldest), so a flood of one job's
notifications evicts its own rows, not another job's page; (3) within that
job, its oldest. The row being sent is never the one dropped. Many jobs of one
row each (a job-name flood) still evict the oldest first: the collector's
``max_jobs`` bound limits how many such jobs can alert at once.

"Job" here is the sharing unit: the alert's job, or under CurveZMQ the key
that reports it (the server sets ``share_of``), so one key with many jobs
holds one share. Sink bandwidth is shared the same way: due rows are sent
critical first, and
within one severity round-robin across jobs (each job's oldest due row, then
each job's second, ...), so a job with thousands of pending notifications
delays another job's alert by at most one row per job, not by its backlog.
Finished rows are kept for ``max_age`` (they remember what was sent) and then
pruned.

A full or unwritable disk does not stop alerting: the first failed write is
logged once as an error and counted (``errors``), the rows are copied into
memory and the outbox carries on there (``durable`` turns False), so alerts
are still delivered, but no longer survive a restart until the collector is
restarted on a writable data dir.

Example::

    from gradwatch.collector.outbox import Outbox, OutboxSink
    from gradwatch.collector.webhook import WebhookChannel

    outbox = Outbox.open(Path("/var/lib/gradwatch"))
    sink = OutboxSink("webhook-0", WebhookChannel("https://hooks.example.com/x"), outbox)
    sink.start()
    # for transition in engine.observe(step): sink.notify(transition)
    sink.close(timeout=5.0)
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gradwatch.collector.config import CollectorError
from gradwatch.collector.ingest import RateLimitedLog
from gradwatch.collector.routing import Router, TokenBucket
from gradwatch.collector.sinks import NOTIFY_STATES, SinkStats, alert_payload, idempotency_key
from gradwatch.collector.webhook import (
    HttpRequest,
    HttpResponse,
    RetryPolicy,
    Transport,
    is_retryable,
    retry_delay,
    urllib_transport,
)

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


class Channel(Protocol):
    """Formats one stored notification as the HTTP request of one kind of receiver."""

    target: str  # where it goes, safe to log (URLs masked)

    def request(
        self, notification_id: str, alert: Mapping[str, Any], now: float
    ) -> HttpRequest: ...


class OutboxSink:
    """A :class:`Sink` that stores every notification, then delivers it from a worker thread.

    ``router`` decides which alerts this sink sends and paces it (see
    :mod:`gradwatch.collector.routing`). The sink owns ``outbox`` and closes
    it; several sinks share one file through one ``Outbox`` each. A sink made
    without one gets its own in-memory outbox.
    """

    def __init__(
        self,
        name: str,
        channel: Channel,
        outbox: Outbox | None = None,
        *,
        transport: Transport = urllib_transport,
        router: Router | None = None,
        retry: RetryPolicy = DURABLE_RETRY,
        max_age: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self.channel = channel
        self.outbox = outbox if outbox is not None else Outbox()
        self.router = router or Router(name=name)
        self._transport = transport
        self._retry = retry
        self._max_age = max_age
        self._clock = clock
        self._jitter = jitter
        self._bucket = TokenBucket(self.router.policy.rate_per_minute)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._counts = {"delivered": 0, "failed": 0, "dropped": 0, "retries": 0}
        self._log = RateLimitedLog(log, every=100)  # a flood drops one row per alert stored
        # Whose share of the outbox an alert's job is: the job itself, or (set by the
        # server under CurveZMQ) the key it reports with.
        self.share_of: Callable[[str], str] = str
        self._next_prune = 0.0
        self._closed = False
        self._sending: str | None = None  # the row id the worker is sending now

    # ---------------------------------------------------------------- Sink API

    def start(self) -> None:
        if self._thread is None:
            resumed = self.outbox.resume(self.name, self._clock())
            if resumed:
                log.info(
                    "%s: resuming %d undelivered notification(s) from the outbox",
                    self.name,
                    resumed,
                )
            self._thread = threading.Thread(
                target=self._run, name=f"gradwatch-{self.name}", daemon=True
            )
            self._thread.start()

    def notify(self, transition: Any) -> None:
        """Store a firing or resolved transition this sink routes; never touches the network."""
        if transition.current not in NOTIFY_STATES or self._closing.is_set():
            return
        alert = transition.alert
        now = self._clock()
        if not self.router.admit(alert, now):
            return
        self._admitted(alert)
        body = json.dumps(alert_payload(alert), allow_nan=False, separators=(",", ":"))
        try:
            inserted, dropped = self.outbox.put(
                self.name,
                idempotency_key(alert),
                body,
                now,
                sending=self._sending,
                job=self.share_of(str(alert.job)),
                severity=str(alert.severity),
            )
        except sqlite3.Error as exc:
            log.error(
                "%s: cannot store alert %s in the outbox (%s); it is lost. Check the "
                "data dir's disk space and permissions",
                self.name,
                alert.rule,
                exc,
            )
            self._count("dropped")
            return
        if dropped:
            self._count("dropped", dropped)
            self._log.warning(
                "outbox_full",
                "%s: outbox full (%d pending), dropped %d "
                "notification(s), least severe of the job holding the most "
                "first (stored: %s of job %r); %s is down or too slow",
                self.name,
                self.outbox.max_pending,
                dropped,
                alert.rule,
                alert.job,
                self.channel.target,
            )
        if inserted:
            self._wake.set()

    def close(self, timeout: float) -> None:
        """Stop the worker within ``timeout``; what is pending stays in the outbox."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "%s: still sending after %.1fs at shutdown; giving up", self.name, timeout
                )
                return  # the worker still uses the outbox; the process is exiting anyway
        if self._closed:
            return
        self._closed = True
        left = self.outbox.pending(self.name)
        if left and self.outbox.durable:
            log.warning(
                "%s: %d notification(s) not yet delivered at shutdown; they are sent "
                "when the collector starts again with the same data dir",
                self.name,
                left,
            )
        elif left:
            self._count("dropped", left)
            log.warning(
                "%s: %d notification(s) not delivered at shutdown are lost (the outbox "
                "was in memory); set a writable data_dir to keep them across restarts",
                self.name,
                left,
            )
        self.outbox.close()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> SinkStats:
        with self._lock:
            return self._stats()

    def wait_for(self, predicate: Callable[[SinkStats], bool], timeout: float) -> SinkStats:
        """Block until ``predicate(stats())`` holds; return the stats or raise ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(stats := self._stats()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{self.name}: condition not met within {timeout}s; stats now {stats}"
                    )
                self._changed.wait(remaining)
            return stats

    def _stats(self) -> SinkStats:
        try:
            queued = self.outbox.pending(self.name)
        except sqlite3.Error:  # closed at shutdown: nothing is queued any more
            queued = 0
        return SinkStats(queued=queued, **self._counts)

    # ---------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            closing = self._closing.is_set()
            try:
                wait = self.deliver_due(final=closing)
            except Exception:  # a bug here must not stop delivery for good
                log.exception("%s: delivery pass failed; retrying", self.name)
                wait = 1.0
            if closing:
                return
            self._wake.wait(wait)
            self._wake.clear()

    def deliver_due(self, final: bool = False) -> float:
        """Send what is due now; return the seconds until more is due.

        The worker thread calls this in a loop; tests and embedders without a
        thread may call it directly. ``final``: one last pass at shutdown.
        """
        now = self._clock()
        for row in self.outbox.due(self.name, now):
            if self._closing.is_set() and not final:
                return 0.0
            wait = self._bucket.take()
            if wait > 0:
                return wait  # rate limited: the rest waits in the outbox
            self._attempt(row)
        if final:
            return 0.0
        now = self._clock()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            self.outbox.prune(now - self._max_age)
        wait = self._periodic(now)
        if self.outbox.due(self.name, now, limit=1):
            return 0.0
        when = self.outbox.next_due(self.name)
        if when is not None:
            wait = min(wait, max(0.0, when - now))
        return wait

    def _admitted(self, alert: Any) -> None:
        """Hook: ``alert`` passed this sink's routing (called on the notifying thread)."""

    def _periodic(self, now: float) -> float:
        """Extra work subclasses do on the worker thread; return seconds until it is due again."""
        return PRUNE_EVERY_S

    def _attempt(self, row: Pending) -> None:
        now = self._clock()
        response: HttpResponse | None = None
        self._sending = row.id
        try:
            request = self.channel.request(row.id, json.loads(row.body), now)
            response = self._transport(request)
            problem = f"HTTP {response.status}"
        except Exception as exc:  # any transport failure is a failed attempt
            problem = str(exc) or type(exc).__name__
        finally:
            self._sending = None
        now = self._clock()
        if response is not None and 200 <= response.status < 300:
            self.outbox.finish(row, "delivered", now)
            self._count("delivered")
            log.debug("%s: delivered %s", self.name, row.id)
            return
        age = now - row.created_at
        if age >= self._max_age:
            self.outbox.finish(row, "failed", now)
            self._count("failed")
            log.warning(
                "%s: gave up on notification %s after %d attempt(s) over %.0fs, last: "
                "%s; check that %s is up and accepts this request",
                self.name,
                row.id,
                row.attempts + 1,
                age,
                problem,
                self.channel.target,
            )
            return
        delay = retry_delay(self._retry, row.attempts + 1, response, now, self._jitter)
        self.outbox.reschedule(row, now + delay, now)
        self._count("retries")
        if row.attempts == 0 and not is_retryable(response):
            # A rejection is usually a receiver-side misconfiguration (route, token) that an
            # operator fixes within the max age: retried like an outage, but said loudly.
            log.warning(
                "%s: %s rejected notification %s with %s; retrying until it is %.0fs "
                "old. Check the URL, credentials and the receiver's logs",
                self.name,
                self.channel.target,
                row.id,
                problem,
                self._max_age,
            )
        else:
            log.debug("%s: %s for %s, retrying in %.2fs", self.name, problem, row.id, delay)

    def _count(self, outcome: str, n: int = 1) -> None:
        with self._changed:
            self._counts[outcome] += n
            self._changed.notify_all()
