"""The monitor's state, its events, and how it fails: never into the training loop.

:class:`Failsafe` is the bottom of the monitor's class chain (failsafe →
rollback_exit → recording → monitor). It declares every attribute the chain
shares, so each part states what it reads, and holds what all of them need:

* events (``eval``, ``checkpoint``, notes): values checked here, device
  scalars stacked and copied to the host without waiting, queued for the
  shipper, counted as dropped when its queue is full;
* failure: an internal error switches the monitor off for good, logged once,
  the collector told (contract C3), and the hooks removed on the training
  thread; one optional part failing switches off only that part
  (:meth:`Failsafe._degrade`, an ``AgentDegraded`` notice resent while the
  collector has not heard it).

Example::

    >>> import torch
    >>> from gradwatch.agent.failsafe import describe
    >>> describe(torch.zeros(2, 3)), describe(1.5)
    ('a tensor of shape (2, 3)', 'a float')
"""

from __future__ import annotations

import logging
import numbers
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from gradwatch.agent.activations import ActHooks
from gradwatch.agent.buffer import StepBuffer
from gradwatch.agent.cadence import Cadence
from gradwatch.agent.census import ModelCensus
from gradwatch.agent.closures import GradMark
from gradwatch.agent.commands import Rollback
from gradwatch.agent.config import AgentConfig, SetupError
from gradwatch.agent.fence import WriteFence
from gradwatch.agent.hostpart import pinned_copy
from gradwatch.agent.items import Counters, EventItem, StatsItem
from gradwatch.agent.layout import Columns
from gradwatch.agent.recovery import Follower, Notice, NoticeBoard, Reader
from gradwatch.agent.rowplan import RowPlan
from gradwatch.agent.shipper import Shipper
from gradwatch.agent.spreadplan import Part
from gradwatch.agent.weightstats import WeightStats
from gradwatch.agent.workqueue import WorkQueue
from gradwatch.wire.messages import CLOSED_NOTE, DEGRADED

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)

MAX_NOTE_CHARS = 512  # a data_change note: a sentence, not a payload
# After an internal error, how long the shipper may take to send the last notice.
FAIL_SEND_S = 1.0


class Failsafe:
    """The monitor's shared state, events and failure handling; see the module docstring."""

    # Set in Monitor.__init__; a monitor made with enabled=False sets only the
    # first group, which is why some readers use getattr(self, name, None).
    config: AgentConfig
    incarnation: str
    _counters: Counters
    _step: int
    _manual: bool
    _skip_open: bool
    _notices: NoticeBoard
    _open: bool
    _step_lrs: list[Any] | None
    _in_hook: bool
    _closure_step: bool  # the open step was given a closure (agent/closures.py)
    _grad_mark: GradMark
    _closed: bool
    _disabled: str | None
    _off: bool
    _fail_lock: threading.Lock
    _warned: set[str]
    _hooks: list[RemovableHandle]
    _acts: ActHooks | None
    _cadence: Cadence
    _stats_now: bool
    _spread_phase: int | None
    _parts: tuple[Part, ...]
    _stats_out: list[StatsItem]
    _wstats: WeightStats | None
    _pending: Rollback | None
    _command_ready: threading.Event
    _command_lock: threading.Lock
    # Only while enabled:
    _reader: Reader
    _mode_sensitive: tuple[tuple[str, torch.nn.Module], ...]
    _census: ModelCensus
    _root: torch.nn.Module
    _was_training: bool
    _device: torch.device
    _by_reference: bool  # the loss may travel as a reference (agent/layout.py: Later)
    _optimizer: Any  # torch.optim.Optimizer, or a stand-in with its param_groups
    _scaler: Any
    _lr_columns: list[str]
    _columns: Columns
    _column_of: dict[str, str]
    # The usual step's slots (agent/rowplan.py), None until a step made them.
    _plan: RowPlan | None
    _work: WorkQueue
    _buffer: StepBuffer
    _shipper: Shipper
    _follow: Follower
    # The weights between the optimizer's steps (agent/fence.py); None where not watched.
    _fence: WriteFence | None
    _began: bool
    # The initial weights are still to be read: at the first training forward (the phase
    # clock's), else at the first gradient read, both before any update.
    _initial_unread: bool
    _since: float
    _forward_t0: float | None
    _data_s: float
    _forward_s: float
    _phase_columns: tuple[str, str]
    # A rank that sends no layers reads its norms into _scratch, for the
    # non-finite flag's device cell; _scales: per-layer factors (shared copies).
    _scratch: torch.Tensor | None
    _nonfinite_slot: int
    _scales: torch.Tensor | None
    # This step's gradient norms, read but not yet in the row (CPU: the shipper stacks them).
    _norms: tuple[torch.Tensor, ...] | None
    _ratio_columns: tuple[str, ...]

    def _event(
        self, kind: str, step: int, values: dict[str, Any], extra: dict[str, Any] | None = None
    ) -> None:
        """Queue an event of ``values`` (checked) and ``extra`` (the agent's own, sent as is)."""
        if self._off:
            return
        try:
            item = self._event_item(kind, step, values, extra or {})
            try:
                self._work.put_nowait(item)
            except queue.Full:
                with self._counters.lock:
                    self._counters.events_dropped += 1
        except Exception as exc:
            self._fail(f"queueing a {kind!r} event", exc)

    def _event_item(
        self, kind: str, step: int, values: dict[str, Any], extra: dict[str, Any]
    ) -> EventItem:
        plain: dict[str, Any] = dict(extra)
        tensors: dict[str, torch.Tensor] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                if value.device.type == "cpu" and self._device.type != "cpu":
                    # Read by the shipper; a pageable host-to-device copy could block.
                    plain[key] = value.detach().clone()
                else:
                    tensors[key] = value.detach().reshape(())
            elif isinstance(value, (str, bool, int)):
                plain[key] = value
            elif isinstance(value, numbers.Real):
                plain[key] = float(value)  # e.g. a numpy scalar, which JSON cannot encode
            else:
                self._warn_once(
                    f"{kind}:{key}",
                    f"{kind} field {key!r} ({describe(value)}) "
                    "is not a number, one-element tensor or string; skipped",
                )
        if not tensors:
            return EventItem(kind, step, plain)
        on_device = [
            t.to(self._device, dtype=torch.float32, non_blocking=True) for t in tensors.values()
        ]
        stacked = torch.stack(on_device)
        stacked, ready = to_host_async(stacked)
        return EventItem(kind, step, plain, tuple(tensors), stacked, ready)

    def _fail(self, what: str, exc: BaseException) -> None:
        """Switch off for good, logging once; safe from either thread."""
        with self._fail_lock:
            if self._disabled is not None:
                return
            self._disabled = f"internal error while {what}: {type(exc).__name__}: {exc}"
            self._off = True
        if isinstance(exc, SetupError):  # the user's settings, not a gradwatch bug
            logger.error(
                "gradwatch: %s: %s. Monitoring is switched off for this run; training "
                "continues unaffected.",
                what,
                exc,
            )
        else:
            logger.error(
                "gradwatch: internal error while %s (%s: %s). Monitoring is now switched off "
                "for this run; training continues unaffected. Please report this with the "
                "traceback below; watch(enabled=False) silences gradwatch entirely.",
                what,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        shipper = getattr(self, "_shipper", None)
        if shipper is not None and not shipper.on_its_thread():
            if not self._in_hook:  # inside the pre-hook, log()/close() remove the hooks
                self._drop_hooks()
            # Tell the collector (contract C3) and close this rank there, so the silence
            # that follows is not taken for a dead rank; the shipper gets a second to send
            # both, on a thread of its own: the training thread never waits for it.
            self._queue_notice(Notice("monitoring", self._disabled or what))
            self._queue_event_item(EventItem("note", self._step, {"note": CLOSED_NOTE}))
            threading.Thread(
                target=shipper.stop, args=(FAIL_SEND_S,), daemon=True, name="gradwatch-stop"
            ).start()

    def _degrade(self, notice: Notice) -> None:
        """Switch one part off (the rest goes on): log once, and tell the collector."""
        if not self._notices.add(notice, time.monotonic(), self._counters.heartbeats_sent > 0):
            return
        level = logging.INFO if notice.optional else logging.WARNING
        logger.log(
            level,
            "gradwatch: %s switched off: %s. Training and the rest of the "
            "monitoring continue; the collector raises %s.",
            notice.off,
            notice.reason,
            "AgentStatisticOff (info)" if notice.optional else "AgentDegraded",
        )
        if not self._off:
            self._queue_notice(notice)

    def _queue_notice(self, notice: Notice) -> None:
        fields = {
            "off": notice.off,
            "reason": notice.reason[:MAX_NOTE_CHARS],
            "optional": notice.optional,
        }
        self._queue_event_item(EventItem(DEGRADED, max(self._step, 0), fields))

    def _queue_event_item(self, item: EventItem) -> None:
        try:
            self._work.put_nowait(item)
        except queue.Full:
            with self._counters.lock:
                self._counters.events_dropped += 1

    def _resend_notices(self) -> None:
        # One float compare per step while nothing is off.
        # Read from the shipper's counter: a stale value only delays the resend by a step.
        for notice in self._notices.due(time.monotonic(), self._counters.heartbeats_sent > 0):
            self._queue_notice(notice)

    def _acts_failed(self, what: str, exc: BaseException) -> None:
        """Activation statistics failed (in a forward hook): switch off only them."""
        acts, self._acts = self._acts, None
        if acts is not None:
            acts.disarm()
        self._degrade(
            Notice(
                "activation statistics",
                f"{what} failed: {type(exc).__name__}: {exc}",
                optional=True,
            )
        )

    def _drop_hooks(self) -> None:
        # Removing a hook is only done on the training thread, which owns them.
        while self._hooks:
            self._hooks.pop().remove()
        if self._acts is not None:
            self._acts.disarm()
        if self._wstats is not None:
            self._wstats.drop()  # a cadence step's samples, if held

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("gradwatch: %s", message)


def describe(value: Any) -> str:
    """Name a value's type (and shape) without printing it: a device tensor's repr syncs."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue a copy of CUDA ``values`` into pinned host memory, without waiting.

    Returns the host tensor and an event the shipper thread waits on before it
    reads it; CPU tensors come back as they are, with no event.
    """
    if values.device.type != "cuda":
        return values, None
    return pinned_copy(values, torch.float32)
