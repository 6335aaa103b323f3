"""The :class:`Monitor` that ``watch()`` returns: the agent's public face.

The training thread does three cheap things per step and nothing else: the
optimizer's step pre-hook writes every layer's gradient norm into the open
device row (one fused kernel), ``Monitor.log`` copies device scalars into
that row and keeps Python numbers in a host list, and every ``flush_every``
steps one asynchronous copy hands the rows to the shipper thread. Nothing
here reads a device value on the host. The step pre-hook is process-wide
(so a re-created optimizer is followed) and every hook left on the model
pickles and copies to a no-op (agent/hooks.py); without an optimizer the
gradients are read at ``log()`` (agent/manual.py). A model that changes under
the agent (dtype, sparse gradients, device) is handled by agent/recovery.py,
which tells the collector what it can no longer measure (contract C3).

The Monitor is one class chain, one job per module, each importing only the
one below: agent/failsafe.py (shared state, events, switching off),
agent/rollback_exit.py (rollback commands), agent/recording.py (the hooks and
the per-step recording), agent/takeover.py (sending per-layer norms or not, as
a takeover command says), and here the public methods; ``watch()``, which
builds the Monitor from the user's arguments, is in agent/watching.py.

Example::

    >>> import torch, gradwatch
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with gradwatch.watch(model, opt, job="doc", endpoint="tcp://127.0.0.1:1") as mon:
    ...     for _ in range(3):
    ...         loss = model(torch.randn(8, 4)).pow(2).mean()
    ...         loss.backward()
    ...         opt.step()
    ...         mon.log(loss=loss)
    ...         opt.zero_grad()
    >>> mon.step, mon.stats.steps_logged
    (3, 3)
"""

from __future__ import annotations

import logging
import numbers
import os
import secrets
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from gradwatch.agent import exit_flush
from gradwatch.agent.cadence import Cadence
from gradwatch.agent.census import ModelCensus, mode_matters, mode_modules
from gradwatch.agent.closures import GradMark
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.failsafe import MAX_NOTE_CHARS
from gradwatch.agent.gradients import GradReader
from gradwatch.agent.items import Counters
from gradwatch.agent.manual import ParamsOnly
from gradwatch.agent.recording import Scalar
from gradwatch.agent.recovery import NoticeBoard
from gradwatch.agent.shipper import Shipper
from gradwatch.agent.takeover import LayerSwitch
from gradwatch.agent.workqueue import WorkQueue
from gradwatch.wire import columns as wc
from gradwatch.wire.messages import CLOSED_NOTE, DATA_CHANGE

logger = logging.getLogger(__name__)

# BatchNorm and Dropout behave differently in training mode (preflight's wiring
# check); the agent itself reports only those whose mode changes the output
# (gradwatch.agent.census.mode_matters: not Dropout(p=0.0)).
MODE_SENSITIVE = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd)
# Names sent with one eval event: the header frame is capped at 64 KiB.
MAX_TRAIN_MODE_NAMES = 32
_NEVER = float("inf")  # NoticeBoard.next_s while nothing is switched off


@dataclass(frozen=True, slots=True)
class MonitorStats:
    """A snapshot of the agent's host-side counters.

    ``steps_dropped`` counts steps that never left the process (no free
    buffer, queue full, or no collector to take them); ``disabled`` says why
    the monitor switched itself off, or is ``None`` while it runs.
    """

    steps_logged: int
    steps_dropped: int
    steps_sent: int
    batches_sent: int
    heartbeats_sent: int
    events_sent: int
    events_dropped: int
    disabled: str | None
    stats_sent: int = 0
    stats_dropped: int = 0
    commands_accepted: int = 0
    commands_refused: int = 0
    # Steps of a batch holding a NaN or Inf that no collector took yet, kept to send
    # before any later step (agent/holdback.py): neither sent nor dropped while kept.
    steps_held: int = 0


class Monitor(LayerSwitch):
    """Watches one model and optimizer; create it with :func:`watch`.

    Its parts, one module each: the shared state, events and failure
    (agent/failsafe.py), rollback commands (agent/rollback_exit.py), the hooks
    and the per-step recording (agent/recording.py), takeovers of a silent
    reporter's layers (agent/takeover.py); the public methods here.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: AgentConfig,
        scaler: Any = None,
        enabled: bool = True,
    ) -> None:
        self.config = config
        self._counters = Counters()
        self._step = config.start_step - 1
        # No optimizer: parameters updated by hand, gradients read at log() (agent/manual.py).
        self._manual = optimizer is None
        self._skip_open = False  # mark_skipped(): the open step's update did not run
        self._notices = NoticeBoard(config.schema_every_s)
        self._open = False  # the pre-hook wrote this step's norms; log() not yet called
        # step(closure): the gradients as such a step ended, to tell the loop's own from
        # its leftovers at the next (agent/closures.py).
        self._closure_step = False
        self._grad_mark = GradMark()
        self._fence = None  # set by _attach where the optimizer is hooked (agent/fence.py)
        # The rates this step's update used, read in the pre-hook: loops (and Trainer
        # callbacks) often step the scheduler before log(), which would report the next.
        self._step_lrs = None
        self._plan = None  # the usual step's slots (agent/rowplan.py), made by the first step
        self._in_hook = False  # torch iterates its hook dict while our pre-hook runs
        self._closed = False
        self._disabled = None if enabled else "switched off by watch(enabled=False)"
        # One flag for the hot path: closed, switched off, or failed.
        self._off = not enabled
        self._fail_lock = threading.Lock()
        self._warned = set()
        self._hooks = []
        self._acts = None
        # Which steps carry cadence statistics (agent/cadence.py), whether the
        # running one does, and its weight statistics (agent/weightstats.py).
        self._cadence = Cadence(config.stats_every, config.early_stats)
        self._stats_now = False
        # The part of a spread sample the running step carries, and that sample's plan.
        self._spread_phase = None
        self._parts = ()
        self._stats_out = []  # cadence samples queued, until the shipper marks them shipped
        self._wstats = None
        # Set by the shipper thread (one attribute store), taken by the training thread.
        self._pending = None
        self._command_ready = threading.Event()
        self._command_lock = threading.Lock()
        if not enabled:
            return
        if optimizer is None:
            # A stand-in, not an Optimizer: the agent reads only its param_groups.
            optimizer = ParamsOnly(model)  # type: ignore[assignment]
        assert optimizer is not None
        self._reader = GradReader.attach(model, optimizer)
        # Found once: walking a large model's modules on every eval is wasted work.
        self._mode_sensitive = mode_modules(model)
        # Contract C2: the census rides on every cadence sample. The root's mode is
        # checked per step (one attribute read); a change forces the next sample.
        self._census = ModelCensus.attach(model, optimizer, config.supervised_loss)
        self._root = model
        self._was_training = True  # a model in eval mode at step 1 forces a sample there
        self._device = self._reader.device
        self._optimizer = optimizer
        self._scaler = scaler
        self._lr_columns = (
            [] if self._manual else [wc.lr(g) for g in range(len(optimizer.param_groups))]
        )
        base = [wc.LOSS, *self._lr_columns, wc.SKIPPED]
        self._base_columns = (*base, wc.LOSS_SCALE) if scaler is not None else tuple(base)
        self._column_of = {wc.LOSS: wc.LOSS}
        if self._manual:
            self._column_of["lr"] = wc.lr(0)  # the hand-written update's rate, if logged
        # Appended to, never woken: the shipper polls it (agent/workqueue.py).
        self._work = WorkQueue(config.pool_size + config.max_pending_events)
        # Per-layer norms or not (agent/topology.py), switched by a takeover (agent/takeover.py).
        self._use_mode(self._layer_mode(config.reports_layers, config.pool_size))
        self._other_mode = None
        self._want_layers = config.reports_layers
        self._no_takeover = False
        # On CPU the loss travels as a reference the shipper reads (agent/layout.py:
        # Later). Not on CUDA: a CUDA graph replay rewrites its outputs in place
        # without a version bump, and a read there must wait for the device.
        self._by_reference = self._device.type == "cpu"
        self._norms = None  # and its gradient norms the same way (agent/recording.py)
        self.incarnation = secrets.token_hex(8)
        # Step phases (host clock), for stragglers and hangs: whether a training
        # forward began since the last log(), when that log() ended, and the
        # seconds spent waiting for data and in forward passes this step.
        self._began = False
        self._initial_unread = True
        self._since = time.perf_counter()
        self._forward_t0 = None
        self._data_s = self._forward_s = 0.0
        self._phase_columns = (
            wc.scalar(wc.DATA_SECONDS_SCALAR),
            wc.scalar(wc.FORWARD_SECONDS_SCALAR),
        )
        self._shipper = Shipper(
            config,
            self.incarnation,
            self._work,
            self._buffer.pool,
            # Steps on the wire are >= 0; a run numbered from 0
            # (start_step=0) has logged "step -1" before its first.
            self._counters,
            last_step=lambda: max(self._step, 0),
            on_failure=self._fail,
            on_command=self._on_command if config.command_endpoint else None,
            on_takeover=self._on_takeover if config.command_endpoint else None,
            # Whether the next step's forward began: known only with the phase clock.
            started=(lambda: max(self._step + 1 if self._began else self._step, 0))
            if config.phase_clock
            else None,
        )
        self._shipper.start()
        self._attach(model, optimizer)
        # A loop that dies before its close() still ships its last steps (agent/exit_flush.py).
        exit_flush.track(self)

    # ------------------------------------------------------------ public

    @property
    def step(self) -> int:
        """The last logged step's number: steps count from 1, and 0 means none yet."""
        return self._step

    @property
    def stats(self) -> MonitorStats:
        c = self._counters
        shipper = getattr(self, "_shipper", None)
        accepted, refused = shipper.command_counts() if shipper is not None else (0, 0)
        return MonitorStats(
            steps_logged=c.steps_logged,
            steps_dropped=c.steps_dropped,
            steps_sent=c.steps_sent,
            batches_sent=c.batches_sent,
            heartbeats_sent=c.heartbeats_sent,
            events_sent=c.events_sent,
            events_dropped=c.events_dropped,
            disabled=self._disabled,
            stats_sent=c.stats_sent,
            stats_dropped=c.stats_dropped,
            commands_accepted=accepted,
            commands_refused=refused,
            steps_held=c.steps_held,
        )

    def log(self, step: int | None = None, **scalars: Scalar) -> None:
        """Record this step: ``loss`` plus any named scalars (tensors or numbers).

        Call once per step, after ``optimizer.step()`` and before
        ``zero_grad()``. Device tensors stay on the device; nothing here waits
        for the device or the network. If no optimizer step ran since the last
        ``log`` (GradScaler skipped it for an overflow), the gradients are read
        here instead and the step is marked ``skipped=1``. Watched without an
        optimizer, the gradients are always read here (agent/manual.py).

        ``step``: the loop's own number for this step (a Python int), so the
        collector names the steps the loop prints; later calls count on from
        it (agent/steps.py). Default: the last step + 1.
        """
        if self._off:
            self._drop_hooks()  # switched off from the shipper thread, or closed
            return
        try:
            if step is not None:
                self._renumber(step)
            skipped = 1.0 if self._skip_open else 0.0
            self._skip_open = False
            if not self._open:
                # The pre-hook did not run since the last log: the optimizer step
                # was skipped (AMP overflow), or there is no optimizer. The
                # gradients are still there.
                self._read_grads()
                skipped = 0.0 if self._manual else 1.0
            self._open = False
            if self._census.towers_due and "loss" in scalars:
                self._census.find_towers(scalars["loss"], self._reader.params)
            self._commit(scalars, skipped)
            if self._want_layers is not self._mode.reports:
                self._switch_layers()  # a takeover began or ended (agent/takeover.py)
            if self._manual:
                self._before_update()
            if self._closure_step:
                self._closure_step = False
                self._grad_mark.note(self._reader.params)
            if self._notices.next_s != _NEVER:  # something is off: resend it now and then
                self._resend_notices()
        except Exception as exc:
            self._fail("recording a step in Monitor.log()", exc)
        if self._pending is not None and self.config.on_rollback == "exit":
            self._exit_for_rollback()

    def read_gradients(self, unscale: torch.Tensor | None = None) -> None:
        """Read this step's gradient norms now, instead of in the optimizer's step pre-hook.

        For code that knows a better moment: before the loop clips (a framework
        callback at the end of backward), so the norms are the pre-clip ones.
        ``unscale``: the ``GradScaler``'s scale (its device tensor) when the
        gradients are still scaled; the norms are divided by it on the device.
        Called again before ``log()``, it reads again into the same step. No sync.
        """
        if self._off:
            return
        try:
            self._read_grads()
            if unscale is not None:
                self._settle_norms()
                self._buffer.current_layers.div_(unscale)
            self._step_lrs = [group["lr"] for group in self._optimizer.param_groups]
            if not self._open:
                self._open = True
                self._before_update()
        except Exception as exc:
            self._fail("reading gradient norms in Monitor.read_gradients()", exc)

    def mark_skipped(self) -> None:
        """The optimizer step whose gradients were read did not run (a GradScaler skipped it
        for an overflow): the next ``log()`` reports the step as skipped."""
        self._skip_open = True

    def log_eval(self, **values: Scalar) -> None:
        """Send an ``eval`` event (e.g. ``loss=val_loss``) at step ``self.step``.

        Call it while the model is still set up for evaluation. When the model
        has BatchNorm or Dropout modules, the event also names those left in
        training mode (``train_mode_modules``, at most ``MAX_TRAIN_MODE_NAMES``;
        ``module.training`` is a host flag, so this reads nothing on the device).
        """
        if self._off:
            return
        extra: dict[str, Any] = {}
        if self._mode_sensitive:
            training = [
                name
                for name, module in self._mode_sensitive
                if module.training and mode_matters(module)
            ]
            extra["train_mode_modules"] = training[:MAX_TRAIN_MODE_NAMES]
        # An evaluation before the first logged step of a run numbered from 0
        # (start_step=0, nanoGPT's iter_num) is at step 0, not -1: steps are >= 0.
        self._event("eval", max(self._step, 0), values, extra)

    def data_changed(self, note: str = "") -> None:
        """Announce a planned change of data or task before the next step (e.g. a new shard
        mix, curriculum stage, or the seed's switch from the memorization subset to the
        full set). The rules re-baseline from that step instead of calling the jump in
        loss a spike; ``note`` says what changed and is kept in the recorded trace.
        """
        self._event(DATA_CHANGE, self._step + 1, {"note": str(note)[:MAX_NOTE_CHARS]})
        self._cadence.restart(self._step + 1)  # dense statistics again from there
        self._cadence.force_next()

    def checkpoint_saved(self, step: int, path: str | os.PathLike[str]) -> None:
        """Tell the collector a checkpoint of ``step`` now exists at ``path``."""
        if not isinstance(step, numbers.Integral):  # a tensor is not Integral either
            # No repr of the value: printing a device tensor would sync.
            self._warn_once(
                "checkpoint_saved",
                f"checkpoint_saved(step=<{type(step).__name__}>) "
                "needs a Python int (use the loop's step counter); event not sent",
            )
            return
        self._event("checkpoint", int(step), {"path": os.fspath(path)})

    def close(self) -> None:
        """Ship what is buffered and stop, waiting at most ``config.close_timeout`` s."""
        self.close_for_exit(CLOSED_NOTE)

    def close_for_exit(self, note: str) -> None:
        """As close(), with ``note`` as the last message: ``closed``, or at interpreter exit
        or when the ``with`` block raised ``exited: <Type>: <message>`` (agent/exit_flush.py)."""
        exit_flush.untrack(self)
        if self._closed:
            return
        self._closed = True
        if not self._off:
            try:
                if self._open:
                    self._open = False
                    self._commit({}, 0.0)
                self._buffer.flush()
                if self._wstats is not None:
                    for done in self._wstats.finish():  # samples still waiting for norms
                        self._queue_stats(done)
            except Exception as exc:
                self._fail("flushing the last steps in Monitor.close()", exc)
            # After the last batch: the collector forgets a job soon once every rank closed;
            # any other note (the process died) leaves the rank to go silent, and page.
            self._event("note", self._step, {"note": note})
        self._off = True
        self._drop_hooks()
        if hasattr(self, "_shipper"):
            self._shipper.stop(self.config.close_timeout)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close_for_exit(exit_flush.exit_note(exc))
