"""Commands from the collector (rollback, takeover): receive, authenticate, hand to the loop.

The collector publishes signed commands on a ZeroMQ XPUB socket; the agent's
shipper thread (never the training thread) polls a SUB socket subscribed to
its job, checks each command and leaves the accepted one for the loop, which
learns of it at a step boundary (``mon.pending_rollback()``), or, with
``on_rollback="exit"``, exits with :data:`ROLLBACK_EXIT_CODE` after writing a
resume file that :func:`resume_plan` reads in the restarted process.

A command is three frames: the job (the SUB topic), a canonical JSON body and
``v1=<hex HMAC-SHA256(key, body)>``. It is refused, and counted, when the
signature is missing or wrong, when ``issued_at`` is more than
:data:`MAX_AGE_S` seconds from the agent's clock, or when its ``nonce`` was
seen before. The key authenticates; it does not encrypt: with CurveZMQ keys
(``curve=``, as the PUSH socket uses) the channel is also encrypted and only
allow-listed agents may subscribe.

A signature says the collector sent the command, not that the checkpoint it
names is the job's own: the collector learns of checkpoints from its ingest
socket. So an authentic command is then checked against this process's
:class:`~gradwatch.agent.checkpoints.CheckpointLedger` (saves it vouched for,
with content digests, under the checkpoint root) before the loop sees it; a
refusal is logged, counted and reported to the collector as a
``rollback_refused`` note.

A ``takeover`` command (the job's silent ranks, agent/takeover.py) passes the
same signature, freshness and replay checks, and is also refused as
``superseded`` when issued before the newest one accepted; an accepted one is
handed to ``on_takeover``, which only changes whether this rank sends
per-layer norms.

Example (after a restart, before the loop)::

    >>> from gradwatch.agent import resume_plan
    >>> plan = resume_plan("/nonexistent/resume.json")   # None: start as usual
    >>> plan is None
    True
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import zmq

from gradwatch.agent.checkpoints import CheckpointLedger, checkpoint_root, full_hash_max_bytes
from gradwatch.agent.config import CurveKeys
from gradwatch.agent.takeover_command import Takeover, takeover_of
from gradwatch.wire.commands import (
    MAX_COMMAND_BYTES,
    MIN_KEY_BYTES,
    ROLLBACK,
    TAKEOVER,
    signature_ok,
)

logger = logging.getLogger(__name__)

# EX_TEMPFAIL (sysexits.h): "temporary failure, retry later", which is what a
# rollback is; distinct from 1 (a crash) so launchers can restart on it alone.
ROLLBACK_EXIT_CODE = 75
DEFAULT_RESUME_FILE = ".gradwatch-resume.json"
MAX_AGE_S = 60.0  # older (or further in the future) commands are refused as stale
ENV_ENDPOINT = "GRADWATCH_COMMAND_ENDPOINT"
ENV_KEY = "GRADWATCH_COMMAND_KEY"
ENV_KEY_FILE = "GRADWATCH_COMMAND_KEY_FILE"
ENV_RESUME_FILE = "GRADWATCH_RESUME_FILE"
# The "note" event that tells the collector a rollback was refused here.
REFUSED_NOTE = "rollback_refused"


@dataclass(frozen=True, slots=True)
class Rollback:
    """Resume from ``checkpoint`` (saved at ``step``) and skip the next ``skip_batches`` batches."""

    checkpoint: str
    step: int
    skip_batches: int
    alert_id: str
    rule: str = ""
    issued_at: float = 0.0


class CommandRefused(ValueError):
    """A command that failed a check; ``reason`` is one of the counted reasons."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def verify_command(
    frames: list[bytes], key: bytes, job: str, now: float, seen: dict[str, float]
) -> Rollback | Takeover | None:
    """Check one received command; ``None`` if it is for another job.

    ``seen`` maps nonces to their ``issued_at``; an accepted nonce is added.
    Raises :class:`CommandRefused` (reasons ``unsigned``, ``bad_signature``,
    ``stale``, ``replayed``, ``malformed``).
    """
    if len(frames) < 3 or not frames[2]:
        raise CommandRefused("unsigned", "the command carries no signature frame")
    body, signature = frames[1], frames[2]
    if len(body) > MAX_COMMAND_BYTES:
        raise CommandRefused("malformed", f"body of {len(body)} bytes")
    if not signature_ok(key, body, signature):
        raise CommandRefused("bad_signature", "the HMAC does not match this agent's command key")
    try:
        fields = json.loads(body)
        if fields.get("job") != job:
            return None  # a SUB topic is a prefix: "run-1" also hears "run-10"
        action = fields["action"]
        nonce = str(fields["nonce"])
        command: Rollback | Takeover
        if action == TAKEOVER:
            command = takeover_of(fields)
        else:
            command = Rollback(
                checkpoint=str(fields["checkpoint"]),
                step=int(fields["step"]),
                skip_batches=int(fields["skip_batches"]),
                alert_id=str(fields["alert_id"]),
                rule=str(fields.get("rule", "")),
                issued_at=float(fields["issued_at"]),
            )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CommandRefused("malformed", f"{type(exc).__name__}: {exc}") from None
    if action not in (ROLLBACK, TAKEOVER):
        raise CommandRefused("malformed", f"unknown action {action!r}")
    issued_at = command.issued_at
    if not math.isfinite(issued_at) or abs(now - issued_at) > MAX_AGE_S:
        raise CommandRefused(
            "stale",
            f"issued {now - issued_at:.0f}s from this agent's clock "
            f"(limit {MAX_AGE_S:.0f}s); check both hosts' clocks (NTP)",
        )
    if nonce in seen:
        raise CommandRefused("replayed", f"nonce {nonce} was already used")
    for old in [n for n, t in seen.items() if now - t > 2 * MAX_AGE_S]:
        del seen[old]  # too old to pass the freshness check again
    seen[nonce] = issued_at
    return command


class CommandReceiver:
    """The SUB socket and its checks; used only from the shipper thread after creation.

    ``poll()`` never raises: an internal error is logged once and the
    receiver switches itself off; training and metric shipping go on.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        job: str,
        key: bytes,
        on_command: Callable[[Rollback], None],
        clock: Callable[[], float] = time.time,
        curve: CurveKeys | None = None,
        report: Callable[[int, dict[str, Any]], None] | None = None,
        root: Path | None = None,
        on_takeover: Callable[[Takeover], None] | None = None,
    ) -> None:
        self._job, self._key, self._on_command, self._clock = job, key, on_command, clock
        self._on_takeover = on_takeover
        self._newest_takeover = -math.inf  # issued_at of the newest takeover accepted
        self._report = report  # sends a note event to the collector; shipper thread only
        self._seen: dict[str, float] = {}
        self.accepted = 0
        self.refused: dict[str, int] = {}
        self._lock = threading.Lock()
        # Refusals decided on the ledger's thread, reported from poll() (the socket's thread).
        self._refusals: list[tuple[Rollback, str, str]] = []
        self.ledger = CheckpointLedger(
            root or checkpoint_root(), self._vouched, self._unvouched, full_hash_max_bytes()
        )
        self._sock: zmq.Socket[Any] | None = context.socket(zmq.SUB)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_COMMAND_BYTES + 1024)
            self._sock.setsockopt(zmq.RCVHWM, 16)
            self._sock.setsockopt(zmq.SUBSCRIBE, job.encode("utf-8"))
            if curve is not None:
                curve.apply(self._sock)  # the collector's command socket is a CURVE server
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ValueError(
                f"cannot connect the command socket to {endpoint!r}: {exc}; "
                f"check {ENV_ENDPOINT} / command_endpoint"
            ) from exc

    def poll(self) -> None:
        """Handle every command waiting on the socket, without blocking."""
        sock = self._sock
        if sock is None:
            return
        try:
            self._report_refusals()
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                self._handle(frames)
        except Exception as exc:
            logger.error(
                "gradwatch: the command receiver failed (%s: %s); rollback commands "
                "are now ignored for this run, training and monitoring continue",
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            self.close()

    def close(self) -> None:
        self.ledger.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def vouch(self, step: int, path: object) -> None:
        """Record a checkpoint this process saved (hashed off this thread); never raises."""
        if isinstance(path, str) and path:
            self.ledger.record(step, path)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            command = verify_command(frames, self._key, self._job, self._clock(), self._seen)
            if isinstance(command, Takeover) and (
                self._on_takeover is None or command.issued_at < self._newest_takeover
            ):
                raise CommandRefused(
                    "superseded" if self._on_takeover is not None else "unsupported",
                    f"a takeover issued at {command.issued_at:.3f}, before the newest one "
                    "taken; the newer one stands"
                    if self._on_takeover is not None
                    else "this agent takes no takeover commands",
                )
        except CommandRefused as exc:
            with self._lock:
                self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            logger.warning("gradwatch: refused a command for job %r: %s", self._job, exc)
            return
        if command is None:
            return
        if isinstance(command, Takeover):
            self._newest_takeover = command.issued_at
            with self._lock:
                self.accepted += 1
            assert self._on_takeover is not None
            self._on_takeover(command)
            return
        self.ledger.check(command, command.checkpoint, command.step)

    def _vouched(self, item: object) -> None:
        # The ledger's thread: the checkpoint is one this process saved, unchanged.
        assert isinstance(item, Rollback)
        with self._lock:
            self.accepted += 1
        logger.warning(
            "gradwatch: rollback command accepted (alert %s, rule %s): resume from "
            "%s (step %d), skip %d batches",
            item.alert_id,
            item.rule,
            item.checkpoint,
            item.step,
            item.skip_batches,
        )
        self._on_command(item)

    def _unvouched(self, item: object, reason: str, detail: str) -> None:
        assert isinstance(item, Rollback)
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            self._refusals.append((item, reason, detail))
            del self._refusals[:-16]  # reported at the next poll; a flood keeps the newest
        logger.error(
            "gradwatch: REFUSED a signed rollback of job %r to %s (step %d, alert %s): "
            "%s: %s. Training continues from where it is; if this checkpoint is "
            "yours, report it with mon.checkpoint_saved(step, path) under %s",
            self._job,
            item.checkpoint,
            item.step,
            item.alert_id,
            reason,
            detail,
            self.ledger.root,
        )

    def _report_refusals(self) -> None:
        with self._lock:
            refusals, self._refusals = self._refusals, []
        if self._report is None:
            return
        for item, reason, detail in refusals:
            self._report(
                item.step,
                {
                    "note": REFUSED_NOTE,
                    "reason": reason,
                    "checkpoint": item.checkpoint[:512],
                    "alert_id": item.alert_id[:64],
                    "detail": detail[:512],
                },
            )


def command_settings(
    endpoint: str | None, key: str | bytes | None, env: Mapping[str, str] | None = None
) -> tuple[str | None, bytes | None]:
    """The command endpoint and key: explicit arguments, else the environment.

    The key comes from ``key``, else ``$GRADWATCH_COMMAND_KEY``, else the file
    named by ``$GRADWATCH_COMMAND_KEY_FILE`` (surrounding whitespace dropped).
    Raises ``ValueError`` when an endpoint is set but the key is missing,
    unreadable or shorter than 16 bytes: commands are never taken unsigned.
    """
    env = os.environ if env is None else env
    endpoint = endpoint or env.get(ENV_ENDPOINT) or None
    if endpoint is None:
        return None, None
    raw: str | bytes | None = key if key is not None else env.get(ENV_KEY) or None
    if raw is None and env.get(ENV_KEY_FILE):
        try:
            raw = Path(env[ENV_KEY_FILE]).read_bytes().strip()
        except OSError as exc:
            raise ValueError(
                f"cannot read the command key file {env[ENV_KEY_FILE]!r} "
                f"({ENV_KEY_FILE}): {exc.strerror or exc}"
            ) from exc
    if raw is None:
        raise ValueError(
            f"a command endpoint is set ({endpoint}) but no command key: set "
            f"{ENV_KEY} or {ENV_KEY_FILE} to the collector's command key, or "
            f"unset {ENV_ENDPOINT}"
        )
    secret = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(
            f"the command key is {len(secret)} bytes; it must be the collector's "
            f"key, at least {MIN_KEY_BYTES} bytes"
        )
    return endpoint, secret


def resume_file_path(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """``path``, else ``$GRADWATCH_RESUME_FILE``, else ``./.gradwatch-resume.json``."""
    env = os.environ if env is None else env
    return Path(path if path is not None else env.get(ENV_RESUME_FILE) or DEFAULT_RESUME_FILE)


def write_resume_file(path: Path, rollback: Rollback) -> None:
    """Write the plan whole, then rename: a restarted process never reads half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(asdict(rollback)), encoding="utf-8")
    os.replace(partial, path)


def resume_plan(path: str | os.PathLike[str] | None = None) -> Rollback | None:
    """After a restart: which checkpoint to load and how many batches to skip, or ``None``.

    Reads the file written when the agent exited for a rollback
    (``on_rollback="exit"``); ``path`` defaults as in :func:`resume_file_path`.
    The file stays until ``mon.rollback_done(step)`` removes it, so a crash
    before that resumes from the same plan. Raises ``ValueError`` when the
    file exists but cannot be read as a plan (delete it to start afresh).
    """
    where = resume_file_path(path)
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read the resume file {where}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
        return Rollback(
            checkpoint=str(data["checkpoint"]),
            step=int(data["step"]),
            skip_batches=int(data["skip_batches"]),
            alert_id=str(data["alert_id"]),
            rule=str(data.get("rule", "")),
            issued_at=float(data.get("issued_at", 0.0)),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"the resume file {where} is not a gradwatch resume plan ({exc}); "
            "delete it to start from your usual checkpoint"
        ) from exc
