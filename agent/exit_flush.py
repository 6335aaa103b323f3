"""Send the last steps when the process exits without ``Monitor.close()``.

The agent ships rows every ``flush_every`` steps, so up to that many steps sit in
its buffer at any moment. A loop that dies by an exception never reaches its
``mon.close()``, and those steps were lost with the process: exactly the steps
that show what killed it (a NaN loss the loop's own guard raised on, a gradient
explosion before an out-of-memory error). Measured before this module: a loop
that logged 25 steps and raised at step 25 delivered steps 1-20 only, not the
NaN of step 24.

At interpreter exit (``atexit``) every monitor still open is closed, which
flushes its buffer and waits for the shipper at most ``close_timeout`` seconds
(2 s by default), so an exit is never held longer. What the collector is told
depends on how the process ends:

* a normal end, ``sys.exit`` or ``KeyboardInterrupt``: the usual ``closed``
  note; the job finished or was stopped on purpose, and the collector forgets
  it without paging (before this module, a loop that ended without ``close()``
  went silent and paged ``RankSilent`` at the end of a healthy run). CPython
  does not show exit handlers the exit code, so ``sys.exit(1)`` outside a
  ``with`` block reads as a normal end; its last steps still go out, and what
  they hold (a NaN, an explosion) pages by itself;
* any other unhandled exception: a note ``exited: <Type>: <message>`` instead.
  It is not the ``closed`` note, so the collector still treats the ranks as
  gone silent and pages for a job that died (as it did before this module),
  now with its last steps and the reason in the trace.

A ``with watch(...) as mon:`` block that raises closes with the same note,
so a crash is reported the same way with or without the ``with``; there a
``SystemExit`` with a non-zero code counts as a failure too.

CPython records the unhandled exception in ``sys.last_value`` before it runs
the ``atexit`` handlers, whatever ``sys.excepthook`` a framework installed.
An exception left in ``sys.last_value`` before the monitor was created (an
interactive session, a debugger, a test runner) is not this run's. A process
killed by a signal (``SIGKILL``, the default ``SIGTERM``) runs no ``atexit``
handler: its buffered steps are lost as before. An exception that ends only a
worker thread is not seen. A forked child (a DataLoader worker) does not close
its parent's monitors.

Example::

    >>> import torch, gradwatch
    >>> from gradwatch.agent import exit_flush
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> mon = gradwatch.watch(model, opt, job="doc", endpoint="tcp://127.0.0.1:1")
    >>> mon in exit_flush.open_monitors()
    True
    >>> mon.close(); mon in exit_flush.open_monitors()
    False
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Protocol

from gradwatch.wire.messages import CLOSED_NOTE

logger = logging.getLogger(__name__)

# Longest reason sent in the exit note; the wire bounds notes too (failsafe.MAX_NOTE_CHARS).
MAX_REASON_CHARS = 200


class Closable(Protocol):
    """What this module needs of a Monitor."""

    def close_for_exit(self, note: str) -> None: ...


# Each open monitor, with the pid that made it and the id of the exception then in
# sys.last_value (an older one is not this run's).
_open: weakref.WeakKeyDictionary[Closable, tuple[int, int]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_installed_in: int | None = None  # the pid whose atexit handler is registered


def track(monitor: Closable) -> None:
    """Close ``monitor`` at interpreter exit if it is still open then."""
    global _installed_in
    with _lock:
        _open[monitor] = (os.getpid(), id(getattr(sys, "last_value", None)))
        if _installed_in != os.getpid():
            _installed_in = os.getpid()
            atexit.register(_close_all, os.getpid())


def untrack(monitor: Closable) -> None:
    """``monitor`` closed by itself: nothing to do for it at exit."""
    with _lock:
        _open.pop(monitor, None)


def open_monitors() -> list[Closable]:
    """The monitors that would be closed at exit now."""
    with _lock:
        return list(_open)


def _open_here() -> list[tuple[Closable, int]]:
    """This process's open monitors, each with the id of the exception it found."""
    pid = os.getpid()
    with _lock:
        return [(m, seen) for m, (made_in, seen) in _open.items() if made_in == pid]


def exit_note(unhandled: BaseException | None) -> str:
    """The note a monitor closed at exit sends, given the process's unhandled exception."""
    if unhandled is None or isinstance(unhandled, KeyboardInterrupt):
        return CLOSED_NOTE
    if isinstance(unhandled, SystemExit) and unhandled.code in (None, 0):
        return CLOSED_NOTE
    try:
        message = str(unhandled)
    except Exception:  # a broken __str__ must not stop the last steps going out
        message = "(its message could not be read)"
    return f"exited: {type(unhandled).__name__}: {message}"[:MAX_REASON_CHARS]


def _close_all(pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child that exits normally: the monitors are its parent's
    unhandled = getattr(sys, "last_value", None)
    for monitor, seen in _open_here():
        try:
            monitor.close_for_exit(exit_note(None if id(unhandled) == seen else unhandled))
        except Exception as exc:  # exiting anyway: say so, never raise at exit
            logger.warning(
                "gradwatch: could not send the last steps at exit (%s: %s); call "
                "mon.close() at the end of the loop (or use `with watch(...)`)",
                type(exc).__name__,
                exc,
            )
