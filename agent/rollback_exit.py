"""Rollback commands on the training thread: taken at a step boundary, or an exit.

The shipper thread receives a verified rollback command (agent/commands.py)
and hands it over with one attribute store; the training thread takes it at
a step boundary, through :meth:`RollbackExit.pending_rollback` (the loop
rolls back itself, ``on_rollback="return"``) or, with ``on_rollback="exit"``,
``Monitor.log()`` writes the plan for the restarted process and raises
``SystemExit(ROLLBACK_EXIT_CODE)``. Either way the loop says where it resumed
with :meth:`RollbackExit.rollback_done`, and the monitor continues as a new
incarnation, so the collector sees rewound step numbers as a restart, not a
stall. See docs/rollback.md.

Example::

    >>> from gradwatch.agent.rollback_exit import RollbackExit
    >>> [name for name in ("pending_rollback", "wait_for_command", "rollback_done")
    ...  if callable(getattr(RollbackExit, name))]
    ['pending_rollback', 'wait_for_command', 'rollback_done']
"""

from __future__ import annotations

import logging
import numbers
import queue
import secrets

from gradwatch.agent.commands import (
    ROLLBACK_EXIT_CODE,
    Rollback,
    resume_file_path,
    write_resume_file,
)
from gradwatch.agent.failsafe import Failsafe
from gradwatch.agent.items import Reincarnate

logger = logging.getLogger(__name__)


class RollbackExit(Failsafe):
    """Takes rollback commands from the shipper thread; see the module docstring."""

    def close(self) -> None:
        """Ship what is buffered and stop (the Monitor's; the exit closes before it raises)."""
        raise NotImplementedError

    def pending_rollback(self) -> Rollback | None:
        """The rollback the collector asked for since the last call, or ``None``; cheap.

        Call it at a step boundary. Taking the command clears it: load
        ``cmd.checkpoint``, skip ``cmd.skip_batches`` batches, then call
        :meth:`rollback_done` with the checkpoint's step (see docs/rollback.md).
        """
        if self._pending is None:  # the per-step case: one attribute read
            return None
        with self._command_lock:
            cmd, self._pending = self._pending, None
            self._command_ready.clear()
        return cmd

    def wait_for_command(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for a rollback command; True if one is pending.

        For tests and loops that pause anyway (e.g. at an eval); never needed
        in a normal loop, which polls :meth:`pending_rollback` per step.
        """
        return self._command_ready.wait(timeout)

    def rollback_done(self, step: int) -> None:
        """Say the loop resumed from the checkpoint of ``step``: steps count on from there.

        Also removes the resume file (``on_rollback="exit"``'s plan) if there
        is one, continues as a new ``incarnation`` (the collector then sees the
        rewound steps as a restart, not a stall) and sends a ``note`` event.
        """
        if not isinstance(step, numbers.Integral):  # a tensor is not Integral either
            self._warn_once("rollback_done", "rollback_done(step) needs a Python int; ignored")
            return
        self._step = int(step)
        self._open = False
        if not self._off:
            self._reincarnate("rollback_done")
        try:
            resume_file_path(self.config.resume_file).unlink(missing_ok=True)
        except OSError as exc:
            self._warn_once(
                "resume_file",
                f"cannot remove the resume file: {exc}; delete it "
                "or the next restart resumes from the same plan",
            )
        self._event("note", self._step, {"note": "rollback_done"})

    def _reincarnate(self, why: str) -> None:
        """Continue as a new incarnation: rewound step numbers are then a restart, not a stall."""
        incarnation = secrets.token_hex(8)
        try:
            self._work.put_nowait(Reincarnate(incarnation))  # ordered after earlier steps
            self.incarnation = incarnation
        except queue.Full:
            self._warn_once(
                "reincarnate",
                f"{why}: the send queue is full, so the "
                "collector may briefly see the rewound steps as a stall",
            )

    def _on_command(self, rollback: Rollback) -> None:
        # Shipper thread; the training thread takes it at a step boundary.
        with self._command_lock:
            self._pending = rollback
            self._command_ready.set()

    def _exit_for_rollback(self) -> None:
        """Write the plan for the restarted process, then leave the loop with the exit code."""
        cmd = self.pending_rollback()
        assert cmd is not None
        where = resume_file_path(self.config.resume_file)
        try:
            write_resume_file(where, cmd)
        except OSError as exc:
            # Exiting without a plan would restart from the newest (maybe poisoned)
            # checkpoint: keep training and say so instead.
            self._warn_once(
                "resume_write",
                f"cannot write the resume file {where}: {exc}; "
                "the rollback was NOT done, training continues",
            )
            return
        logger.warning(
            "gradwatch: exiting with code %d for a rollback to %s (step %d); the "
            "restarted process reads %s with gradwatch.agent.resume_plan()",
            ROLLBACK_EXIT_CODE,
            cmd.checkpoint,
            cmd.step,
            where,
        )
        self.close()
        raise SystemExit(ROLLBACK_EXIT_CODE)
