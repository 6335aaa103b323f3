"""``watch()`` and the :class:`Monitor` it returns: the agent's public face.

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
import queue
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradwatch.agent.activations import ActHooks, check_activation_modules, is_compiled
from gradwatch.agent.buffer import StepBuffer
from gradwatch.agent.cadence import Cadence
from gradwatch.agent.census import ModelCensus, mode_matters, mode_modules
from gradwatch.agent.commands import (
    ROLLBACK_EXIT_CODE,
    Rollback,
    command_settings,
    resume_file_path,
    write_resume_file,
)
from gradwatch.agent.config import (
    DEFAULT_ENDPOINT,
    AgentConfig,
    SetupError,
    resolve_rank_world,
)
from gradwatch.agent.gradients import GradReader
from gradwatch.agent.hooks import Detached
from gradwatch.agent.layout import Columns, HostValue
from gradwatch.agent.manual import ParamsOnly
from gradwatch.agent.recovery import Follower, Notice, NoticeBoard, Reader, recover
from gradwatch.agent.shipper import Counters, EventItem, Reincarnate, Shipper, StatsItem
from gradwatch.agent.steps import check_watch_args, user_step
from gradwatch.agent.topology import resolve_shards
from gradwatch.agent.weightstats import Round, WeightStats
from gradwatch.agent.workqueue import WorkQueue
from gradwatch.wire import columns as wc
from gradwatch.wire.messages import CLOSED_NOTE, DATA_CHANGE, DEGRADED

logger = logging.getLogger(__name__)

Scalar = torch.Tensor | float | int
# BatchNorm and Dropout behave differently in training mode (preflight's wiring
# check); the agent itself reports only those whose mode changes the output
# (gradwatch.agent.census.mode_matters: not Dropout(p=0.0)).
MODE_SENSITIVE = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd)
# Names sent with one eval event: the header frame is capped at 64 KiB.
MAX_TRAIN_MODE_NAMES = 32
MAX_NOTE_CHARS = 512  # a data_change note: a sentence, not a payload
# After an internal error, how long the shipper may take to send the last notice.
FAIL_SEND_S = 1.0
# Checked by exact type first: an ABC isinstance costs a microsecond.
_NUMBERS = (float, int, bool)


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


class Monitor:
    """Watches one model and optimizer; create it with :func:`watch`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: AgentConfig, scaler: Any = None, enabled: bool = True) -> None:
        self.config = config
        self._counters = Counters()
        self._step = config.start_step - 1
        # No optimizer: parameters updated by hand, gradients read at log() (agent/manual.py).
        self._manual = optimizer is None
        self._skip_open = False  # mark_skipped(): the open step's update did not run
        self._notices = NoticeBoard(config.schema_every_s)
        self._open = False  # the pre-hook wrote this step's norms; log() not yet called
        # The rates this step's update used, read in the pre-hook: loops (and Trainer
        # callbacks) often step the scheduler before log(), which would report the next.
        self._step_lrs: list[Any] | None = None
        self._in_hook = False  # torch iterates its hook dict while our pre-hook runs
        self._closed = False
        self._disabled: str | None = None if enabled else "switched off by watch(enabled=False)"
        # One flag for the hot path: closed, switched off, or failed.
        self._off = not enabled
        self._fail_lock = threading.Lock()
        self._warned: set[str] = set()
        self._hooks: list[Any] = []
        self._acts: ActHooks | None = None
        # Which steps carry cadence statistics (agent/cadence.py), whether the
        # running one does, and its weight statistics (agent/weightstats.py).
        self._cadence = Cadence(config.stats_every, config.early_stats)
        self._stats_now = False
        self._wstats: WeightStats | None = None
        # Set by the shipper thread (one attribute store), taken by the training thread.
        self._pending: Rollback | None = None
        self._command_ready = threading.Event()
        self._command_lock = threading.Lock()
        if not enabled:
            return
        if optimizer is None:
            optimizer = ParamsOnly(model)  # type: ignore[assignment]
        assert optimizer is not None
        self._reader: Reader = GradReader.attach(model, optimizer)
        # Found once: walking a large model's modules on every eval is wasted work.
        self._mode_sensitive = mode_modules(model)
        # Contract C2: the census rides on every cadence sample. The root's mode is
        # checked per step (one attribute read); a change forces the next sample.
        self._census = ModelCensus.attach(model, optimizer)
        self._root = model
        self._was_training = True  # a model in eval mode at step 1 forces a sample there
        self._device = self._reader.device
        self._optimizer = optimizer
        self._scaler = scaler
        self._lr_columns = [] if self._manual else [
            wc.lr(g) for g in range(len(optimizer.param_groups))]
        base = [wc.LOSS, *self._lr_columns, wc.SKIPPED]
        if scaler is not None:
            base.append(wc.LOSS_SCALE)
        self._columns = Columns(self._reader.names, base, config.device_columns)
        self._columns.layer_roles = self._census.roles(self._reader.params)
        self._column_of: dict[str, str] = {wc.LOSS: wc.LOSS}
        if self._manual:
            self._column_of["lr"] = wc.lr(0)  # the hand-written update's rate, if logged
        # Appended to, never woken: the shipper polls it (agent/workqueue.py).
        self._work = WorkQueue(config.pool_size + config.max_pending_events)
        self._buffer = StepBuffer(self._columns, self._device, config.flush_every,
                                  config.pool_size, self._work, self._counters)
        self.incarnation = secrets.token_hex(8)
        # Step phases (host clock), for stragglers and hangs: whether a training
        # forward began since the last log(), when that log() ended, and the
        # seconds spent waiting for data and in forward passes this step.
        self._began = False
        self._since = time.perf_counter()
        self._forward_t0: float | None = None
        self._data_s = self._forward_s = 0.0
        self._phase_columns = (wc.scalar(wc.DATA_SECONDS_SCALAR),
                               wc.scalar(wc.FORWARD_SECONDS_SCALAR))
        self._shipper = Shipper(config, self.incarnation, self._work, self._buffer.pool,
                                # Steps on the wire are >= 0; a run numbered from 0
                                # (start_step=0) has logged "step -1" before its first.
                                self._counters, last_step=lambda: max(self._step, 0),
                                on_failure=self._fail,
                                on_command=self._on_command if config.command_endpoint else None,
                                started=lambda: max(self._step + 1 if self._began
                                                    else self._step, 0))
        self._shipper.start()
        # Every hook is Detached: a pickled or copied model or optimizer gets an inert
        # one (agent/hooks.py), so torch.save(model) and deepcopy work as unwatched.
        if getattr(optimizer, "gradwatch_stand_in", False):
            # A framework callback's stand-in (integrations/_attach.py): it alone decides
            # when the gradients are read.
            self._hooks.append(optimizer.register_step_pre_hook(Detached(self._pre_hook)))
        elif not self._manual:
            # Process-wide, so an optimizer the loop re-creates mid-run (a new phase, a
            # resume) is followed too (agent/recovery.py: follows); none is on the optimizer.
            self._follow = Follower(self._reader.params, optimizer)
            self._hooks.append(register_optimizer_step_pre_hook(
                self._any_pre_hook))
        began, ended = self._forward_began, self._forward_ended
        if "torch._dynamo" in sys.modules:
            # A compiled model would trace these clock reads into its graph (and
            # break it there); disabled, they run eagerly at the graph's edge.
            began, ended = torch.compiler.disable(began), torch.compiler.disable(ended)
        # First of the pre-hooks: FSDP's own (registered earlier) all-gathers the
        # parameters, which waits for the slowest rank; that wait is not "data".
        self._hooks.append(model.register_forward_pre_hook(Detached(began, compile_safe=True),
                                                           prepend=True))
        self._hooks.append(model.register_forward_hook(Detached(ended, compile_safe=True)))
        self._ratio_columns = tuple(wc.update_ratio(n) for n in self._reader.names)
        if config.activation_stats and config.stats_every:
            self._acts = ActHooks.attach(model, self._device, on_error=self._acts_failed,
                                         max_modules=config.max_act_modules,
                                         inputs=dict(config.activation_modules))
            if self._acts is None and is_compiled(model):
                self._degrade(Notice("activation statistics", "the model is compiled "
                                     "(torch.compile); forward hooks would recompile it",
                                     optional=True))
        if config.stats_every:
            self._wstats = WeightStats(self._reader)
            self._stats_now = self._cadence.due(self._step + 1)
            if self._acts is not None and self._stats_now:
                self._acts.arm()  # the first step is a cadence step

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
            steps_logged=c.steps_logged, steps_dropped=c.steps_dropped,
            steps_sent=c.steps_sent, batches_sent=c.batches_sent, heartbeats_sent=c.heartbeats_sent,
            events_sent=c.events_sent, events_dropped=c.events_dropped,
            disabled=self._disabled, stats_sent=c.stats_sent, stats_dropped=c.stats_dropped,
            commands_accepted=accepted, commands_refused=refused)

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
            skipped, self._skip_open = float(self._skip_open), False
            if not self._open:
                # The pre-hook did not run since the last log: the optimizer step
                # was skipped (AMP overflow), or there is no optimizer. The
                # gradients are still there.
                self._read_grads()
                skipped = 0.0 if self._manual else 1.0
            self._open = False
            self._commit(scalars, skipped)
            if self._manual:
                self._before_update()
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
            training = [name for name, module in self._mode_sensitive
                        if module.training and mode_matters(module)]
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
        if isinstance(step, torch.Tensor) or not isinstance(step, numbers.Integral):
            # No repr of the value: printing a device tensor would sync.
            self._warn_once("checkpoint_saved", f"checkpoint_saved(step=<{type(step).__name__}>) "
                            "needs a Python int (use the loop's step counter); event not sent")
            return
        self._event("checkpoint", int(step), {"path": os.fspath(path)})

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
        if isinstance(step, torch.Tensor) or not isinstance(step, numbers.Integral):
            self._warn_once("rollback_done", "rollback_done(step) needs a Python int; ignored")
            return
        self._step = int(step)
        self._open = False
        if not self._off:
            self._reincarnate("rollback_done")
        try:
            resume_file_path(self.config.resume_file).unlink(missing_ok=True)
        except OSError as exc:
            self._warn_once("resume_file", f"cannot remove the resume file: {exc}; delete it "
                            "or the next restart resumes from the same plan")
        self._event("note", self._step, {"note": "rollback_done"})

    def _reincarnate(self, why: str) -> None:
        """Continue as a new incarnation: rewound step numbers are then a restart, not a stall."""
        incarnation = secrets.token_hex(8)
        try:
            self._work.put_nowait(Reincarnate(incarnation))  # ordered after earlier steps
            self.incarnation = incarnation
        except queue.Full:
            self._warn_once("reincarnate", f"{why}: the send queue is full, so the "
                            "collector may briefly see the rewound steps as a stall")

    def _renumber(self, step: Any) -> None:
        """Make the step being logged number ``step`` (log(step=...)); see agent/steps.py."""
        number = user_step(step)
        if number is None:
            self._warn_once("log_step", f"log(step=<{type(step).__name__}>) needs a "
                            "non-negative Python int (the loop's own counter); the agent "
                            "counts on by itself")
            return
        if number <= self._step and self._counters.steps_logged:
            # The loop rewound (a resume, or a rollback done by hand): what was
            # logged goes out first, under the old incarnation.
            self._buffer.flush()
            self._reincarnate(f"log(step={number})")
        self._step = number - 1

    def close(self) -> None:
        """Ship what is buffered and stop, waiting at most ``config.close_timeout`` s."""
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
            # After the last batch: the collector forgets a job soon once every rank closed.
            self._event("note", self._step, {"note": CLOSED_NOTE})
        self._off = True
        self._drop_hooks()
        if hasattr(self, "_shipper"):
            self._shipper.stop(self.config.close_timeout)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------ hot path

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._off:
            # Not removed here: torch is iterating its hook dict, and removing an entry
            # would raise into the loop when another hook follows ours. log()/close() do it.
            return
        self._in_hook = True
        try:
            if self._open:
                # Two optimizer steps without a log(): the first still counts.
                self._commit({}, 0.0)
            self._read_grads()
            self._step_lrs = [group["lr"] for group in optimizer.param_groups]
            self._open = True
            self._before_update()
        except Exception as exc:
            self._fail("reading gradient norms in the optimizer step pre-hook", exc)
        finally:
            self._in_hook = False

    def _any_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Any optimizer's step in the process: one identity test for the watched one.
        if optimizer is not self._optimizer:
            if self._open or self._off or not self._follow.adopts(optimizer):
                return  # another model's optimizer, or one stepping inside ours (a wrapper)
            self._optimizer = optimizer
            logger.info("gradwatch: following a new optimizer (%s) that updates the watched "
                        "parameters", type(optimizer).__name__)
        self._pre_hook(optimizer, args, kwargs)

    def _before_update(self) -> None:
        """What must be seen before the parameters change: the pre-hook's, or (no optimizer)
        the end of log(), where the next hand-written update has not happened yet."""
        if self._root.training is not self._was_training:
            self._was_training = self._root.training  # model.eval() left on, or back
            self._cadence.force_next()
        if self._cadence.take_forced():
            self._stats_now = True  # forced during this step: it is a cadence step
        if self._stats_now and self.config.update_ratios and self._wstats is not None:
            self._wstats.sample_before()  # a cadence step's update ratios

    def _read_grads(self) -> None:
        """Read this step's gradient norms into the open row; after a failure caused by a
        change of the model (dtype, sparse gradients, device), carry on without what
        cannot be read (agent/recovery.py) and tell the collector."""
        row = self._buffer.current_layers
        try:
            self._reader.read_into(row)
            return
        except Exception:
            fixed = recover(self._reader)
            if fixed is None:
                raise
        self._reader, notice = fixed
        if self._wstats is not None:  # it reads the weights through the old reader
            weights = getattr(self._reader, "weights_reader", self._reader)
            self._wstats = None if weights is None else WeightStats(weights)
        if notice is not None:
            self._degrade(notice)
        self._reader.read_into(row)

    def _forward_began(self, module: torch.nn.Module, args: Any) -> None:
        # Evaluation forwards between steps are not part of the step.
        if self._off or not module.training:
            return
        now = time.perf_counter()
        if not self._began:
            self._began = True
            self._data_s = now - self._since
        self._forward_t0 = now

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._forward_t0 is not None:
            self._forward_s += time.perf_counter() - self._forward_t0
            self._forward_t0 = None

    def _commit(self, scalars: dict[str, Scalar], skipped: float) -> None:
        dev: list[tuple[int, torch.Tensor]] = []
        host: list[tuple[int, HostValue]] = [(self._columns.host_slot(wc.SKIPPED), skipped)]
        if self._began:
            data, forward = self._phase_columns
            host.append((self._columns.host_slot(data), self._data_s))
            host.append((self._columns.host_slot(forward), self._forward_s))
        for name, value in scalars.items():
            column = self._column_of.get(name) or self._name_column(name)
            self._route(column, value, dev, host)
        # Without an optimizer the rate is known only if the loop logs ``lr``.
        groups = [] if self._manual else self._optimizer.param_groups
        if len(groups) != len(self._lr_columns):
            self._lr_columns = [wc.lr(g) for g in range(len(groups))]
        lrs = self._step_lrs if self._step_lrs is not None else [g["lr"] for g in groups]
        self._step_lrs = None
        if len(lrs) != len(groups):
            lrs = [g["lr"] for g in groups]  # param groups added between the step and log()
        for column, lr in zip(self._lr_columns, lrs, strict=True):
            self._route(column, lr, dev, host)
        if self._scaler is not None:
            # The scale as a device tensor; get_scale() would sync.
            scale = getattr(self._scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                self._route(wc.LOSS_SCALE, scale, dev, host)
        if self._columns.dirty:
            self._buffer.relayout()
        cell = self._buffer.cell
        for slot, tensor in dev:
            cell(slot).copy_(tensor)
        host_row: list[HostValue] = [None] * self._columns.host_width
        for slot, value in host:
            host_row[slot] = value
        self._step += 1
        now = time.time()
        self._buffer.commit(self._step, now, host_row)
        self._began, self._data_s, self._forward_s = False, 0.0, 0.0
        self._since = time.perf_counter()
        self._counters.steps_logged += 1
        if self._wstats is not None and (self._stats_now or self._wstats.busy):
            try:
                self._cadence_work(now)
            except Exception as exc:  # an optional statistic: the steps go on without it
                self._wstats = None
                self._cadence.every = 0
                self.config = replace(self.config, stats_every=0)
                if self._acts is not None:
                    self._acts.disarm()
                    self._acts = None
                self._degrade(Notice("cadence statistics (weight norms, update ratios, "
                                     "activations)", f"reading them failed: "
                                     f"{type(exc).__name__}: {exc}", optional=True))
        self._stats_now = self._cadence.due(self._step + 1)
        acts = self._acts
        if acts is not None:
            # Hooks live only for a cadence step's forward pass: armed now when
            # the next step is one, removed here at its log().
            acts.disarm()
            if self._stats_now:
                acts.arm()

    def _cadence_work(self, now: float) -> None:
        """A cadence step measures what only it can see (activations of its forward,
        update ratios of its update); its weight norms are read a slice per step
        (agent/weightstats.py), so no step pays them whole, and it ships once they are."""
        ws = self._wstats
        assert ws is not None
        if not self._stats_now:
            done = ws.advance()
        else:
            self._stats_now = False
            columns: tuple[str, ...] = ()
            parts: list[torch.Tensor] = []
            acts = self._acts
            if acts is not None:
                columns = acts.columns
                parts.append(acts.snapshot())
            if self.config.update_ratios:
                columns = (*columns, *self._ratio_columns)
                parts.append(ws.ratios())
            done = ws.begin(self._step, now, columns, parts)
        for sample in done:
            self._queue_stats(sample)

    def _queue_stats(self, done: Round) -> None:
        """Queue a complete sample's statistics without waiting for them."""
        values = done.norms
        assert values is not None
        if done.parts:
            values = torch.cat((*done.parts, values))
        values, ready = _to_host_async(values)
        try:
            self._work.put_nowait(StatsItem(done.step, done.time, self._reader.names, values,
                                            ready, done.columns, self._census.take()))
        except queue.Full:
            with self._counters.lock:
                self._counters.stats_dropped += 1

    def _route(self, column: str, value: Any, dev: list[tuple[int, torch.Tensor]],
               host: list[tuple[int, HostValue]]) -> None:
        """Send a value to its device slot (tensors) or host slot (numbers)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self._warn_once(column, f"{column!r} is {_describe(value)}; only "
                                "one-element tensors are logged, so it was skipped")
                return
            value = value.detach()
            if value.dim():
                value = value.reshape(())
            if value.device == self._device:
                dev.append((self._columns.device_slot(column), value))
            elif value.device.type == "cpu":
                # A CPU tensor next to a device buffer: read later by the
                # shipper; cloned since the loop may change it in place.
                host.append((self._columns.host_slot(column), value.clone()))
            else:
                moved = value.to(self._device, non_blocking=True)
                dev.append((self._columns.device_slot(column), moved))
        elif type(value) in _NUMBERS or isinstance(value, numbers.Real):
            host.append((self._columns.host_slot(column), value))
        else:
            self._warn_once(column, f"{column!r} is {_describe(value)}; log tensors "
                            "or numbers, so it was skipped")

    def _name_column(self, name: str) -> str:
        column = self._column_of[name] = wc.scalar(name)
        return column

    # ------------------------------------------------------------ events

    def _event(self, kind: str, step: int, values: dict[str, Any],
               extra: dict[str, Any] | None = None) -> None:
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

    def _event_item(self, kind: str, step: int, values: dict[str, Any],
                    extra: dict[str, Any]) -> EventItem:
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
                self._warn_once(f"{kind}:{key}", f"{kind} field {key!r} ({_describe(value)}) "
                                "is not a number, one-element tensor or string; skipped")
        if not tensors:
            return EventItem(kind, step, plain)
        on_device = [t.to(self._device, dtype=torch.float32, non_blocking=True)
                     for t in tensors.values()]
        stacked = torch.stack(on_device)
        stacked, ready = _to_host_async(stacked)
        return EventItem(kind, step, plain, tuple(tensors), stacked, ready)

    # ------------------------------------------------------------ commands

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
            self._warn_once("resume_write", f"cannot write the resume file {where}: {exc}; "
                            "the rollback was NOT done, training continues")
            return
        logger.warning("gradwatch: exiting with code %d for a rollback to %s (step %d); the "
                       "restarted process reads %s with gradwatch.agent.resume_plan()",
                       ROLLBACK_EXIT_CODE, cmd.checkpoint, cmd.step, where)
        self.close()
        raise SystemExit(ROLLBACK_EXIT_CODE)

    # ------------------------------------------------------------ failure

    def _fail(self, what: str, exc: BaseException) -> None:
        """Switch off for good, logging once; safe from either thread."""
        with self._fail_lock:
            if self._disabled is not None:
                return
            self._disabled = f"internal error while {what}: {type(exc).__name__}: {exc}"
            self._off = True
        if isinstance(exc, SetupError):  # the user's settings, not a gradwatch bug
            logger.error("gradwatch: %s: %s. Monitoring is switched off for this run; training "
                         "continues unaffected.", what, exc)
        else:
            logger.error(
                "gradwatch: internal error while %s (%s: %s). Monitoring is now switched off "
                "for this run; training continues unaffected. Please report this with the "
                "traceback below; watch(enabled=False) silences gradwatch entirely.",
                what, type(exc).__name__, exc, exc_info=exc)
        shipper = getattr(self, "_shipper", None)
        if shipper is not None and not shipper.on_its_thread():
            if not self._in_hook:  # inside the pre-hook, log()/close() remove the hooks
                self._drop_hooks()
            # Tell the collector (contract C3) and close this rank there, so the silence
            # that follows is not taken for a dead rank; the shipper gets a second to send
            # both, on a thread of its own: the training thread never waits for it.
            self._queue_notice(Notice("monitoring", self._disabled or what))
            self._queue_event_item(EventItem("note", self._step, {"note": CLOSED_NOTE}))
            threading.Thread(target=shipper.stop, args=(FAIL_SEND_S,), daemon=True,
                             name="gradwatch-stop").start()

    def _degrade(self, notice: Notice) -> None:
        """Switch one part off (the rest goes on): log once, and tell the collector."""
        if not self._notices.add(notice, time.monotonic(), self._counters.heartbeats_sent > 0):
            return
        level = logging.INFO if notice.optional else logging.WARNING
        logger.log(level, "gradwatch: %s switched off: %s. Training and the rest of the "
                   "monitoring continue; the collector raises AgentDegraded.", notice.off,
                   notice.reason)
        if not self._off:
            self._queue_notice(notice)

    def _queue_notice(self, notice: Notice) -> None:
        fields = {"off": notice.off, "reason": notice.reason[:MAX_NOTE_CHARS],
                  "optional": notice.optional}
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
        self._degrade(Notice("activation statistics",
                             f"{what} failed: {type(exc).__name__}: {exc}", optional=True))

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


def _describe(value: Any) -> str:
    """Name a value's type (and shape) without printing it: a device tensor's repr syncs."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
          job: str | None = None, endpoint: str = DEFAULT_ENDPOINT, *, rank: int | None = None,
          world: int | None = None, flush_every: int = 10, scaler: Any = None,
          heartbeat_every: float = 2.0, stats_every: int = 50, enabled: bool = True,
          activation_stats: bool = True, update_ratios: bool = True,
          activation_modules: Mapping[str, str] | None = None,
          command_endpoint: str | None = None, command_key: str | bytes | None = None,
          on_rollback: str = "return", resume_file: str | None = None,
          curve_server_public_key_file: str | None = None,
          curve_secret_key_file: str | None = None, shards: int | None = None,
          start_step: int = 1, early_stats: bool = True) -> Monitor:
    """Attach a :class:`Monitor` to ``model`` and ``optimizer``; see the module example.

    ``job`` (required) names the run. ``optimizer`` None: the loop updates the
    parameters by hand, and the gradients are read at each ``log()``
    (agent/manual.py). ``start_step``: the number of the first logged step (a
    resumed run: the step it continues at); ``log(step=...)`` also takes the
    loop's own numbers (agent/steps.py).

    ``rank``/``world`` default to torch.distributed's when it is initialised,
    else to the ``RANK``/``WORLD_SIZE`` environment variables, else 0/1. Pass
    the ``torch.amp.GradScaler`` as ``scaler`` to report the loss scale.
    Every ``stats_every`` steps (0: never; ``early_stats``: densely at the
    start and after ``data_changed``, backing off to that, agent/cadence.py)
    the parameters' own L2 norms are also shipped, as a separate
    cadence-statistics batch, with activation statistics of that step's
    forward pass (``activation_stats``; forward hooks armed for that forward
    only; ReLU/Tanh/Sigmoid/GELU/SiLU/Softmax-family modules, and with
    ``activation_modules`` (e.g. ``{"*.mlp.c_proj": "gelu"}``) the inputs of
    named modules, for activations called functionally: agent/activations.py;
    off for ``torch.compile``d models, with one warning) and each
    layer's update ratio ||dw||/||w|| (``update_ratios``; estimated on a fixed
    sample of at most 4,096 elements per tensor, agent/weightstats.py).
    Rollback commands (off by default; docs/rollback.md): ``command_endpoint``
    (else ``$GRADWATCH_COMMAND_ENDPOINT``) is the collector's command socket
    and ``command_key`` (else ``$GRADWATCH_COMMAND_KEY`` or the file named by
    ``$GRADWATCH_COMMAND_KEY_FILE``) its HMAC key. ``on_rollback="return"``
    hands commands to :meth:`Monitor.pending_rollback`; ``"exit"`` writes
    ``resume_file`` (default ``$GRADWATCH_RESUME_FILE`` or
    ``./.gradwatch-resume.json``) and raises ``SystemExit(ROLLBACK_EXIT_CODE)``
    from the next ``log()``.
    ``shards``: how many ranks one replica's gradients are split across, so
    the collector can assemble exact global norms (1 for DDP, the world size for
    FSDP/ZeRO); detected from DTensor/FSDP parameters when not given
    (agent/topology.py; ``$GRADWATCH_SHARDS`` overrides the detection).
    CurveZMQ (SECURITY.md): ``curve_server_public_key_file`` (the collector's
    ``NAME.key``) and ``curve_secret_key_file`` (this agent's ``NAME.key_secret``),
    else the ``GRADWATCH_CURVE_*`` environment variables.
    Raises ``TypeError`` (an argument of the wrong type, named) or ``ValueError``
    (a bad value) before training starts; after that, nothing the monitor does
    raises into the loop, except that deliberate ``SystemExit``.
    """
    check_watch_args(model, optimizer, job=job, endpoint=endpoint, rank=rank, world=world,
                     flush_every=flush_every, heartbeat_every=heartbeat_every,
                     stats_every=stats_every, enabled=enabled,
                     activation_stats=activation_stats, update_ratios=update_ratios,
                     command_endpoint=command_endpoint, command_key=command_key,
                     on_rollback=on_rollback, resume_file=resume_file,
                     curve_server_public_key_file=curve_server_public_key_file,
                     curve_secret_key_file=curve_secret_key_file, shards=shards,
                     start_step=start_step)
    assert job is not None  # checked above
    rank, world = resolve_rank_world(rank, world)
    shards = resolve_shards(model, world, shards)
    try:
        cmd_endpoint, cmd_key = command_settings(command_endpoint, command_key)
    except ValueError as exc:
        if command_endpoint is not None or command_key is not None:
            raise
        # Set up by the environment: a broken rollback setup must not stop training.
        logger.error("gradwatch: %s; rollback commands are off for this run", exc)
        cmd_endpoint, cmd_key = None, None
    config = AgentConfig(job=job, rank=rank, world=world, shards=shards, endpoint=endpoint,
                         flush_every=flush_every, heartbeat_every=heartbeat_every,
                         stats_every=stats_every, activation_stats=activation_stats,
                         activation_modules=check_activation_modules(activation_modules),
                         update_ratios=update_ratios, command_endpoint=cmd_endpoint,
                         command_key=cmd_key, on_rollback=on_rollback, resume_file=resume_file,
                         curve_server_public_key_file=curve_server_public_key_file,
                         curve_secret_key_file=curve_secret_key_file, start_step=start_step,
                         early_stats=early_stats)
    return Monitor(model, optimizer, config, scaler=scaler, enabled=enabled)


def _to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue a copy of CUDA ``values`` into pinned host memory, without waiting.

    Returns the host tensor and an event the shipper thread waits on before it
    reads it; CPU tensors come back as they are, with no event.
    """
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
