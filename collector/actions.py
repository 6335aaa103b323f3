"""Rule actions beyond notify: signed rollback commands, bounded by a restart budget.

When a rule whose ``actions`` include ``rollback`` starts firing, the
collector names the last checkpoint saved *before* the incident began (see
:mod:`gradwatch.collector.checkpoints`) and publishes a command to the job's
agents: ``{job, action, checkpoint, step, skip_batches, alert_id, rule,
issued_at, nonce}``, serialized as canonical JSON and signed with
HMAC-SHA256 under the shared command key. The agent refuses unsigned, badly
signed, stale (> 60 s) and replayed commands. Restarting a job is a
privileged act, so:

* with no command key configured, rollback is switched off (one warning at
  start) and never sent unauthenticated;
* each job has a budget (default 3 rollbacks per 6 h) and a cooldown
  (default 10 min), kept in SQLite next to the checkpoints so a collector
  restart does not reset them;
* a refused rollback is logged, counted and recorded (reasons: ``disabled``,
  ``no_checkpoint``, ``no_listener``, ``budget``, ``cooldown``, ``duplicate``);
  the alert itself still reaches every sink.

Every alert also gets ``last_good_checkpoint`` filled in (:meth:`Actions.annotate`).

A store that cannot be written (disk full, data dir read-only) never stops
ingest or alerting: the first failure is logged once, every one is counted
(``store_errors``); a checkpoint that cannot be stored is not known to later
rollbacks, and a rollback whose budget entry cannot be stored is refused
(``store_error``) rather than sent unaccounted.

Sending is injected (``send(frames)``): the server owns the ZeroMQ XPUB socket,
tests pass a list's ``append``. The key only authenticates; it does not
encrypt (CurveZMQ on the command socket comes with a later change).

Example::

    >>> from gradwatch.collector.actions import Actions, ActionSettings
    >>> sent = []
    >>> actions = Actions(ActionSettings(key=b"k" * 32), {"NaN": ("notify", "rollback")},
    ...                   send=sent.append, clock=lambda: 1000.0)
    >>> actions.checkpoints.add("run-1", 100, "ckpt/100.pt", time=0.0)
    >>> # for transition in engine.observe(step): actions.on_transition(transition)
    >>> actions.close()
"""

from __future__ import annotations

import logging
import secrets
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gradwatch.collector.checkpoints import CheckpointStore, SavedCheckpoint, connect
from gradwatch.collector.config import CollectorConfig, ConfigError
from gradwatch.collector.ingest import RateLimitedLog
from gradwatch.wire.commands import MIN_KEY_BYTES, encode_command

log = logging.getLogger(__name__)

COMMAND_VERSION = 1
# The agent's note when it refuses a signed rollback (gradwatch.agent.commands.REFUSED_NOTE;
# the collector does not import the agent) and the reasons it gives.
REFUSED_NOTE = "rollback_refused"
AGENT_REASONS = frozenset({"unvouched", "outside_root", "changed", "unreadable", "busy"})
ACTIONS_FILE = "actions.sqlite3"

BUDGET_SCHEMA = """
CREATE TABLE IF NOT EXISTS restarts (
    job      TEXT NOT NULL,
    time     REAL NOT NULL,
    alert_id TEXT NOT NULL,
    outcome  TEXT NOT NULL,   -- 'sent' or 'refused'
    reason   TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS restarts_by_job ON restarts (job, time);
"""


def check_key(key: bytes, where: str) -> bytes:
    """Return ``key`` if it is long enough to authenticate commands, else raise ``ConfigError``."""
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"the command key from {where} is {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "random bytes, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return key


@dataclass(frozen=True, slots=True)
class ActionSettings:
    """What the actions need from the collector config; ``key=None`` switches rollback off."""

    key: bytes | None = field(default=None, repr=False)
    skip_batches: int = 200
    margin_steps: int = 0
    max_rollbacks: int = 3
    window_s: float = 6 * 3600.0
    cooldown_s: float = 600.0
    path: Path | None = None
    max_checkpoints_per_job: int = 100
    max_checkpoint_rows: int = 100_000
    checkpoint_max_age_s: float = 7 * 24 * 3600.0


def action_settings(config: CollectorConfig) -> ActionSettings:
    """The actions' settings from ``config``; reads ``command_key_file`` if one is named.

    Raises ``ConfigError`` when the key file cannot be read or a key is too short.
    """
    key: bytes | None = None
    if config.command_key is not None:
        key = check_key(
            config.command_key.get_secret_value().encode("utf-8"),
            "GRADWATCH_COMMAND_KEY / command_key",
        )
    elif config.command_key_file is not None:
        try:
            raw = config.command_key_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"cannot read command_key_file {config.command_key_file}: "
                f"{exc.strerror or exc}; fix the path or unset it"
            ) from exc
        key = check_key(raw, str(config.command_key_file))
    return ActionSettings(
        key=key,
        skip_batches=config.rollback_skip_batches,
        margin_steps=config.rollback_margin_steps,
        max_rollbacks=config.rollback_budget,
        window_s=config.rollback_budget_window_s,
        cooldown_s=config.rollback_cooldown_s,
        path=None if config.data_dir is None else config.data_dir / ACTIONS_FILE,
        max_checkpoints_per_job=config.max_checkpoints_per_job,
        max_checkpoint_rows=config.max_checkpoint_rows,
        checkpoint_max_age_s=config.checkpoint_max_age_seconds,
    )


@dataclass(frozen=True, slots=True)
class ActionStats:
    """Counters read at scrape time; ``refused`` by reason."""

    sent: int
    refused: Mapping[str, int]
    enabled: bool
    agent_refused: Mapping[str, int] = field(default_factory=dict)
    checkpoints_refused: int = 0  # reports of a (job, step, rank) already known


class Budget:
    """Restarts per job: at most ``max_count`` per ``window_s`` and one per ``cooldown_s``.

    Every decision is a row in ``restarts``, so counts survive a restart of
    the process that keeps them. Thread-safe.
    """

    def __init__(
        self,
        db: sqlite3.Connection,
        max_count: int,
        window_s: float,
        cooldown_s: float,
        lock: threading.Lock | None = None,
    ) -> None:
        self._db = db
        self._lock = lock or threading.Lock()
        self.max_count, self.window_s, self.cooldown_s = max_count, window_s, cooldown_s
        with self._lock:
            self._db.executescript(BUDGET_SCHEMA)

    def refusal(self, job: str, alert_id: str, now: float) -> str | None:
        """Why a restart of ``job`` for ``alert_id`` must not happen now, or ``None``."""
        with self._lock:
            done = self._db.execute(
                "SELECT 1 FROM restarts WHERE job = ? AND alert_id = ? AND outcome = 'sent'",
                (job, alert_id),
            ).fetchone()
            recent = self._db.execute(
                "SELECT COUNT(*), MAX(time) FROM restarts WHERE job = ? AND outcome = 'sent' "
                "AND time > ?",
                (job, now - self.window_s),
            ).fetchone()
        if done is not None:
            return "duplicate"
        count, last = recent
        if count >= self.max_count:
            return "budget"
        if last is not None and now - last < self.cooldown_s:
            return "cooldown"
        return None

    def record(self, job: str, alert_id: str, now: float, reason: str | None) -> None:
        """Record a restart (``reason=None``) or a refusal with its reason."""
        outcome = "sent" if reason is None else "refused"
        with self._lock:
            self._db.execute(
                "INSERT INTO restarts VALUES (?, ?, ?, ?, ?)",
                (job, now, alert_id, outcome, reason or ""),
            )

    def jobs(self, now: float) -> list[str]:
        """Jobs with a restart inside the current window."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT job FROM restarts WHERE outcome = 'sent' AND time > ? "
                "ORDER BY job",
                (now - self.window_s,),
            ).fetchall()
        return [job for (job,) in rows]

    def used(self, job: str, now: float) -> int:
        """Restarts of ``job`` inside the current window."""
        with self._lock:
            (count,) = self._db.execute(
                "SELECT COUNT(*) FROM restarts WHERE job = ? AND outcome = 'sent' AND time > ?",
                (job, now - self.window_s),
            ).fetchone()
        return int(count)


class Actions:
    """Turns firing transitions of ``rollback`` rules into signed commands; see the module doc."""

    def __init__(
        self,
        settings: ActionSettings,
        rule_actions: Mapping[str, Iterable[str]],
        send: Callable[[list[bytes]], Any] | None,
        clock: Callable[[], float] = time.time,
        listening: Callable[[str], bool] | None = None,
    ) -> None:
        self.settings = settings
        self._rollback_rules = frozenset(
            name for name, acts in rule_actions.items() if "rollback" in acts
        )
        self._send = send
        self.clock = clock
        self._listening = listening
        self._db = connect(settings.path)
        # One lock for everything on the shared connection.
        self._db_lock = threading.Lock()
        self.checkpoints = CheckpointStore(
            None,
            db=self._db,
            lock=self._db_lock,
            max_per_job=settings.max_checkpoints_per_job,
            max_rows=settings.max_checkpoint_rows,
            max_age_s=settings.checkpoint_max_age_s,
        )
        self.budget = Budget(
            self._db,
            settings.max_rollbacks,
            settings.window_s,
            settings.cooldown_s,
            lock=self._db_lock,
        )
        self._lock = threading.Lock()
        self._sent = 0
        self._refused: Counter[str] = Counter()
        self._agent_refused: Counter[str] = Counter()
        self._overwrites = 0
        self._log = RateLimitedLog(log)
        self.store_errors = 0
        self.enabled = settings.key is not None and send is not None
        stops = sorted(name for name, acts in rule_actions.items() if "stop" in acts)
        if stops:
            log.warning(
                "rules %s ask for the 'stop' action, which this collector does not "
                "carry out yet; they notify only",
                ", ".join(stops),
            )
        if self._rollback_rules and not self.enabled:
            log.warning(
                "rollback is switched OFF: rules %s ask for it but no command key is configured; "
                "set GRADWATCH_COMMAND_KEY or command_key_file (the agents need the same key). "
                "These alerts still notify.",
                ", ".join(sorted(self._rollback_rules)),
            )

    def observe_event(self, event: Any) -> None:
        """Keep ``checkpoint`` events (a wire ``Event``) and agents' rollback refusals."""
        if event.kind == "note" and event.fields.get("note") == REFUSED_NOTE:
            self._agent_refusal(event)
            return
        if event.kind != "checkpoint":
            return
        path = event.fields.get("path")
        if isinstance(path, str) and path:
            now = self.clock()
            try:
                added = self.checkpoints.add(event.job, event.step, path, now, event.rank, now)
            except sqlite3.Error as exc:
                self._store_failed(f"checkpoint {path} of job {event.job!r}", exc)
                return
            if not added:
                with self._lock:
                    self._overwrites += 1
                self._log.warning(
                    "checkpoint_overwrite",
                    "refused a second report of the "
                    "checkpoint of job %r step %d rank %d (%s): entries are "
                    "immutable; if a sender other than the job reports its "
                    "checkpoints, use profile: production (SECURITY.md)",
                    event.job,
                    event.step,
                    event.rank,
                    path[:256],
                )

    def _agent_refusal(self, event: Any) -> None:
        """An agent refused a signed rollback (its checkpoint was not one it saved)."""
        fields = event.fields
        reason = str(fields.get("reason", "unknown"))[:32]
        if reason not in AGENT_REASONS:
            reason = "other"
        with self._lock:
            self._agent_refused[reason] += 1
        self._log.warning(
            "agent_refused",
            "the agent of job %r (rank %d) REFUSED "
            "the rollback to %r for alert %s: %s: %s. The checkpoint this "
            "collector was told of is not one the job saved: someone other than "
            "the job may be reporting to this collector (SECURITY.md)",
            event.job,
            event.rank,
            str(fields.get("checkpoint", ""))[:256],
            str(fields.get("alert_id", ""))[:64],
            reason,
            str(fields.get("detail", ""))[:256],
        )

    def annotate(self, transition: Any) -> Any:
        """``transition`` with its alert's ``last_good_checkpoint`` filled in where one is known.

        Every alert carries it (DESIGN's alert contract), so a receiver such as
        ``gradwatch restart-hook`` can restart from it. Never raises.
        """
        alert = transition.alert
        if alert.last_good_checkpoint is not None:
            return transition
        try:
            found = self.checkpoints.last_good(alert.job, alert.onset, self.settings.margin_steps)
            if found is None:
                return transition
            return replace(transition, alert=replace(alert, last_good_checkpoint=found.path))
        except Exception:  # the alert matters more than this detail: send it as it is
            log.exception(
                "filling last_good_checkpoint of alert %s failed; please report this "
                "as a gradwatch bug",
                alert.id,
            )
            return transition

    def on_transition(self, transition: Any) -> dict[str, Any] | None:
        """Act on one transition; return the command sent, or ``None``. Never raises."""
        alert = transition.alert
        if (
            transition.current != "firing"
            or transition.previous == "firing"
            or alert.rule not in self._rollback_rules
        ):
            return None
        try:
            return self._rollback(alert)
        except sqlite3.Error as exc:
            self._store_failed(f"the restart budget of job {alert.job!r}", exc)
            self._count_refused("store_error")
            return None
        except Exception:
            log.exception(
                "rollback for alert %s (%s, job %r) failed; please report this as a gradwatch bug",
                alert.id,
                alert.rule,
                alert.job,
            )
            self._count_refused("error")
            return None

    def stats(self) -> ActionStats:
        with self._lock:
            return ActionStats(
                self._sent,
                dict(self._refused),
                self.enabled,
                dict(self._agent_refused),
                self._overwrites,
            )

    def close(self) -> None:
        with self._db_lock:
            self._db.close()

    def _rollback(self, alert: Any) -> dict[str, Any] | None:
        now = self.clock()
        if not self.enabled:
            self._refuse(alert, now, "disabled", "no command key is configured")
            return None
        found = self.checkpoints.last_good(alert.job, alert.onset, self.settings.margin_steps)
        if found is None:
            self._refuse(
                alert, now, "no_checkpoint", f"no checkpoint was reported before step {alert.onset}"
            )
            return None
        if self._listening is not None and not self._listening(alert.job):
            self._refuse(
                alert,
                now,
                "no_listener",
                f"no agent of job {alert.job!r} is connected "
                "to the command socket (set GRADWATCH_COMMAND_ENDPOINT on the job)",
            )
            return None
        reason = self.budget.refusal(alert.job, alert.id, now)
        if reason is not None:
            used = self.budget.used(alert.job, now)
            self._refuse(
                alert,
                now,
                reason,
                f"{used}/{self.settings.max_rollbacks} rollbacks in the last "
                f"{self.settings.window_s:.0f}s, cooldown {self.settings.cooldown_s:.0f}s",
            )
            return None
        command = self._command(alert, found, now)
        assert self._send is not None and self.settings.key is not None
        # Recorded first: a restart the budget cannot keep track of is not sent.
        self.budget.record(alert.job, alert.id, now, None)
        self._send(encode_command(command, self.settings.key))
        with self._lock:
            self._sent += 1
        log.warning(
            "rollback sent to job %r for alert %s (%s at step %d): resume from %s "
            "(step %d), skip %d batches",
            alert.job,
            alert.id,
            alert.rule,
            alert.step,
            found.path,
            found.step,
            self.settings.skip_batches,
        )
        return command

    def _command(self, alert: Any, found: SavedCheckpoint, now: float) -> dict[str, Any]:
        return {
            "v": COMMAND_VERSION,
            "job": alert.job,
            "action": "rollback",
            "checkpoint": found.path,
            "step": found.step,
            "skip_batches": self.settings.skip_batches,
            "alert_id": alert.id,
            "rule": alert.rule,
            "issued_at": now,
            "nonce": secrets.token_hex(16),
        }

    def _refuse(self, alert: Any, now: float, reason: str, detail: str) -> None:
        log.warning(
            "rollback refused for job %r, alert %s (%s at step %d): %s: %s; the alert "
            "is still notified",
            alert.job,
            alert.id,
            alert.rule,
            alert.step,
            reason,
            detail,
        )
        self.budget.record(alert.job, alert.id, now, reason)
        self._count_refused(reason)

    def _store_failed(self, what: str, exc: sqlite3.Error) -> None:
        with self._lock:
            self.store_errors += 1
            first = self.store_errors == 1
        # Once: a full disk fails every write, and one clear line says all there is.
        log.log(
            logging.ERROR if first else logging.DEBUG,
            "cannot store %s in the actions store %s: %s. Ingest and alerts go on, but "
            "checkpoints reported meanwhile are unknown to rollbacks and rollbacks are "
            "refused; free disk space or fix the data dir's permissions, then restart "
            "the collector",
            what,
            self.settings.path or "(in memory)",
            exc,
        )

    def _count_refused(self, reason: str) -> None:
        with self._lock:
            self._refused[reason] += 1
