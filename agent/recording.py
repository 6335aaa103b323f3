"""The per-step path: the hooks the agent leaves, and how each step is recorded.

On every training step, on the training thread, and without reading a device
value on the host:

* the optimizer's step pre-hook (process-wide, so a re-created optimizer is
  followed: agent/recovery.py) writes every layer's gradient norm into the
  open device row with one fused read (agent/gradients.py);
* forward pre/post hooks on the model time the step's phases (waiting for
  data, forward) on the host clock, in a job of several ranks (the phase clock:
  ``AgentConfig.phase_clock``);
* ``Monitor.log`` commits the row (:meth:`StepRecorder._commit`): device
  scalars copied into it, Python numbers into a host list, and on cadence
  steps the statistics work of agent/cadence.py and agent/weightstats.py.

Every hook is :class:`~gradwatch.agent.hooks.Detached`, so a pickled or copied
model or optimizer carries an inert one.

Example::

    >>> import torch, gradwatch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> mon = gradwatch.watch(model, opt, job="doc", endpoint="tcp://127.0.0.1:1",
    ...                       rank=0, world=2)
    >>> len(model._forward_pre_hooks), len(model._forward_hooks)  # the phase clock
    (1, 1)
    >>> mon.close(); len(model._forward_pre_hooks)
    0
"""

from __future__ import annotations

import logging
import numbers
import time
from dataclasses import replace
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradwatch.agent.activations import ActHooks
from gradwatch.agent.acttargets import is_compiled
from gradwatch.agent.closures import read_after_first_call
from gradwatch.agent.failsafe import describe
from gradwatch.agent.fence import WriteFence
from gradwatch.agent.gradients import GradReader
from gradwatch.agent.hooks import Detached, hook_module
from gradwatch.agent.layout import HostValue, Later
from gradwatch.agent.recovery import Follower, Notice, recover
from gradwatch.agent.rowplan import RowPlan
from gradwatch.agent.sampling import Sampler
from gradwatch.agent.steps import user_step
from gradwatch.agent.weightstats import WeightStats
from gradwatch.wire import columns as wc
from gradwatch.wire.messages import WEIGHTS_WRITTEN

logger = logging.getLogger(__name__)

Scalar = torch.Tensor | float | int
# Checked by exact type first: an ABC isinstance costs a microsecond.
_NUMBERS = (float, int, bool)


class StepRecorder(Sampler):
    """The hooks and the per-step recording of a Monitor; see the module docstring."""

    def _attach(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Leave the hooks on ``model`` and ``optimizer``, and set up the cadence statistics."""
        # A pickled, saved or copied model leaves the module hooks out, and a copied
        # optimizer gets inert ones (agent/hooks.py): torch.save(model) and deepcopy
        # work as unwatched.
        if getattr(optimizer, "gradwatch_stand_in", False):
            # A framework callback's stand-in (integrations/_attach.py): it alone decides
            # when the gradients are read.
            self._hooks.append(optimizer.register_step_pre_hook(Detached(self._pre_hook)))
        elif not self._manual:
            # Process-wide, so an optimizer the loop re-creates mid-run (a new phase, a
            # resume) is followed too (agent/recovery.py: follows); none is on the optimizer.
            self._follow = Follower(self._reader.params, optimizer)
            self._hooks.append(register_optimizer_step_pre_hook(self._any_pre_hook))
        if not self._manual and type(self._reader) is GradReader and not self._reader.sharded:
            # Not sharded parameters, re-gathered into new storage every step; nor a
            # hand-written update, which writes them between its log() calls itself.
            self._fence = WriteFence(self._reader.params, self._reader.names)
        if self.config.phase_clock:
            # The phase clock (AgentConfig.phase_clock). compile_safe: a model compiled
            # after watch() traces these hooks, and they return before the clock read
            # (which would be frozen into the graph). Not torch.compiler.disable: its
            # wrapper switches dynamo's frame hook on every call (~15 us a step per hook
            # in the loop) and changed nothing here, since the traced hook returns first.
            # First of the pre-hooks: FSDP's own (registered earlier) all-gathers the
            # parameters, which waits for the slowest rank; that wait is not "data".
            self._hooks.append(
                hook_module(model, Detached(self._forward_began, compile_safe=True), prepend=True)
            )
            self._hooks.append(
                hook_module(model, Detached(self._forward_ended, compile_safe=True), after=True)
            )
        self._ratio_columns = tuple(wc.update_ratio(n) for n in self._reader.names)
        # A rank that sends no layers sends no cadence statistics either: its
        # reporter's (same model, same update) stand for it.
        if self.config.activation_stats and self.config.stats_every and self._scratch is None:
            self._acts = ActHooks.attach(
                model,
                self._device,
                on_error=self._acts_failed,
                max_modules=self.config.max_act_modules,
                inputs=dict(self.config.activation_modules),
            )
            if self._acts is None and is_compiled(model):
                self._degrade(
                    Notice(
                        "activation statistics",
                        "the model is compiled (torch.compile); forward hooks would recompile it",
                        optional=True,
                    )
                )
        if self.config.stats_every and self._scratch is None:
            self._wstats = self._weight_stats()
        if self._wstats is not None:
            # The plan of a sample a full gap from the next and its views, made here
            # and not on a training step (agent/spreadplan.py: cached by gap).
            self._wstats.prepare(self._spread_plan(self._wstats, self.config.stats_every))
            self._next_sample(self._wstats)  # the first step may be a cadence step

    def _weight_stats(self) -> WeightStats | None:
        """Cadence weight statistics over the reader's parameters (after a recovery, the
        ones it still reads: its ``weights_reader``), or None where they cannot be read."""
        weights = getattr(self._reader, "weights_reader", self._reader)
        return WeightStats(weights) if isinstance(weights, GradReader) else None

    def _renumber(self, step: Any) -> None:
        """Make the step being logged number ``step`` (log(step=...)); see agent/steps.py."""
        number = user_step(step)
        if number is None:
            self._warn_once(
                "log_step",
                f"log(step=<{type(step).__name__}>) needs a "
                "non-negative Python int (the loop's own counter); the agent "
                "counts on by itself",
            )
            return
        if number <= self._step and self._counters.steps_logged:
            # The loop rewound (a resume, or a rollback done by hand): what was
            # logged goes out first, under the old incarnation.
            self._buffer.flush()
            self._reincarnate(f"log(step={number})")
        self._step = number - 1

    def _pre_hook(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[Any, Any] | None:
        if self._off:
            # Not removed here: torch is iterating its hook dict, and removing an entry
            # would raise into the loop when another hook follows ours. log()/close() do it.
            return None
        if len(args) > 1 or kwargs:
            # step(closure): unless the loop computed the gradients before the step (SAM),
            # they are the closure's to compute, so they are read when its first call
            # returns (still before any update; agent/closures.py).
            self._closure_step = True
            if not self._grad_mark.fresh(self._reader.params):
                wrapped = read_after_first_call(
                    args, kwargs, lambda: self._pre_hook(optimizer, (optimizer,), {})
                )
                if wrapped is not None:
                    return wrapped
        self._in_hook = True
        try:
            if self._fence is not None and self._fence.crossed():
                self._weights_written()
            if self._open:
                # Two optimizer steps without a log(): the first still counts.
                self._commit({}, 0.0)
            self._read_grads()
            self._step_lrs = [group["lr"] for group in optimizer.param_groups]
            self._open = True
            # Every line here runs on a cache the backward pass just emptied, where
            # a call costs microseconds: _before_update only when it has work.
            if (
                self._stats_now
                or self._cadence.forced
                or self._root.training is not self._was_training
            ):
                self._before_update()
        except Exception as exc:
            self._fail("reading gradient norms in the optimizer step pre-hook", exc)
        finally:
            self._in_hook = False
        return None

    def _weights_written(self) -> None:
        """Tell the collector the weights were written outside the optimizer before this
        step's update (agent/fence.py); the rules read what the loss does next."""
        names = self._fence.written() if self._fence is not None else ()
        self._event(WEIGHTS_WRITTEN, self._step + 1, {"params": ", ".join(names)[:1024]})

    def _any_pre_hook(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[Any, Any] | None:
        # Any optimizer's step in the process: one identity test for the watched one.
        if optimizer is not self._optimizer:
            if self._open or self._off or not self._follow.adopts(optimizer):
                return None  # another model's optimizer, or one stepping inside ours (a wrapper)
            self._optimizer = optimizer
            logger.info(
                "gradwatch: following a new optimizer (%s) that updates the watched parameters",
                type(optimizer).__name__,
            )
        return self._pre_hook(optimizer, args, kwargs)

    def _before_update(self) -> None:
        """What must be seen before the parameters change: the pre-hook's, or (no optimizer)
        the end of log(), where the next hand-written update has not happened yet."""
        if self._root.training is not self._was_training:
            self._was_training = self._root.training  # model.eval() left on, or back
            self._cadence.force_next()
        if self._cadence.take_forced():
            self._stats_now = True  # forced during this step: it is a cadence step
        ws = self._wstats
        if self._stats_now and self.config.update_ratios and ws is not None:
            # A cadence step's update ratios, of the groups its part measures (every
            # layer for a sample measured whole); without an optimizer the after-gather
            # comes a forward and backward pass later, so no views are kept for it.
            part = self._carried_part()
            if part is None or part.ratios is not None:
                ws.sample_before(
                    keep_views=not self._manual, group=None if part is None else part.ratios
                )

    def _read_grads(self) -> None:
        """Read this step's gradient norms into the open row; after a failure caused by a
        change of the model (dtype, sparse gradients, device), carry on without what
        cannot be read (agent/recovery.py) and tell the collector."""
        if self._initial_unread:
            # No phase clock saw a forward: the first gradient read is the first moment
            # before any update (and after any checkpoint the loop loaded), too.
            self._initial_unread = False
            self._read_initial()
        scratch = self._scratch
        self._norms = None
        row = self._buffer.current_layers if scratch is None else scratch
        try:
            reader = self._reader
            if (
                scratch is None
                and self._scales is None
                and type(reader) is GradReader
                and reader.deferrable
            ):
                # On CPU the norms are final once read: the shipper stacks them into
                # the batch (agent/layout.py: fill_norms), which spares this thread the
                # stack, ~40 us a step on a cache the backward pass emptied.
                self._norms = reader.norms()
                if self._norms is not None:
                    return
            reader.read_into(row)
        except Exception:
            fixed = recover(self._reader)
            if fixed is None:
                raise
            self._reader, notice = fixed
            if self._wstats is not None:  # it reads the weights through the old reader
                self._wstats = self._weight_stats()
            if notice is not None:
                self._degrade(notice)
            if scratch is not None and scratch.numel() != len(self._reader.names):
                row = self._scratch = torch.empty(len(self._reader.names), device=self._device)
            self._reader.read_into(row)
        if self._scales is not None and self._scales.numel() == row.numel():
            row.mul_(self._scales)
        elif scratch is not None:
            # A rank that sends no layers still says whether any gradient is NaN/Inf.
            self._buffer.cell(self._nonfinite_slot).copy_(torch.isfinite(row).all().logical_not())

    def _settle_norms(self) -> None:
        """Put a pending read's norms into the open row now, for code that works on it."""
        if self._norms is not None:
            torch.stack(self._norms, out=self._buffer.current_layers)
            self._norms = None

    def _forward_began(self, module: torch.nn.Module, args: Any) -> None:
        # Evaluation forwards between steps are not part of the step: in eval mode, or
        # without autograd (an evaluation that leaves the model in train mode, as
        # pytorch/examples' time_sequence_prediction does); nothing trains without it.
        if self._off or not module.training or not torch.is_grad_enabled():
            return
        now = time.perf_counter()
        if not self._began:
            self._began = True
            self._data_s = now - self._since
            if self._initial_unread:
                self._initial_unread = False
                self._read_initial()
                now = time.perf_counter()  # that read is not the forward's time
        self._forward_t0 = now

    def _read_initial(self) -> None:
        """The run's first training forward (the phase clock's) or first gradient read,
        both before any update (and after any checkpoint the loop loaded): when its step
        carries the first sample, that sample's weight norms are read now, the weights the
        run started from (agent/weightstats.py: read_initial)."""
        ws = self._wstats
        if ws is None or ws.started or not self._stats_now:
            return
        try:
            ws.read_initial()
        except Exception as exc:  # optional: the first sample reads them after its update
            logger.debug("gradwatch: the initial weight norms were not read: %s", exc)

    def _forward_ended(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._forward_t0 is not None:
            self._forward_s += time.perf_counter() - self._forward_t0
            self._forward_t0 = None

    def _commit(self, scalars: dict[str, Scalar], skipped: float) -> None:
        lrs, self._step_lrs = self._step_lrs, None
        plan = self._plan
        host_row = None
        if plan is not None:  # the usual step: slots decided once (agent/rowplan.py)
            host_row = plan.row(
                scalars,
                skipped,
                lrs,
                len(self._optimizer.param_groups),
                self._began,
                self._data_s,
                self._forward_s,
                self._buffer,
            )
        if host_row is None:
            host_row = self._general_row(scalars, skipped, lrs)
        buffer = self._buffer
        self._step += 1
        now = time.time()
        buffer.commit(self._step, now, host_row, self._norms)
        self._norms = None
        self._began, self._data_s, self._forward_s = False, 0.0, 0.0
        self._since = time.perf_counter()
        self._counters.steps_logged += 1
        if self._fence is not None:
            self._fence.close()  # the weights as this step's update left them
        if self._wstats is not None and (self._stats_now or self._wstats.waiting):
            try:
                self._cadence_work(now)
            except Exception as exc:  # an optional statistic: the steps go on without it
                self._wstats = None
                self._cadence.every = 0
                self.config = replace(self.config, stats_every=0)
                if self._acts is not None:
                    self._acts.disarm()
                    self._acts = None
                self._degrade(
                    Notice(
                        "cadence statistics (weight norms, update ratios, activations)",
                        f"reading them failed: {type(exc).__name__}: {exc}",
                        optional=True,
                    )
                )
        ws, cadence, acts = self._wstats, self._cadence, self._acts
        # Most steps: no sample in progress, none due, no hooks to remove; nothing to
        # decide (each call costs microseconds on this cold cache).
        if ws is not None and (
            ws.waiting
            or cadence.forced
            or self._step + 1 >= cadence.next_step
            or (acts is not None and acts.armed)
        ):
            self._next_sample(ws)

    def _general_row(
        self, scalars: dict[str, Scalar], skipped: float, lrs: list[Any] | None
    ) -> list[HostValue]:
        """Any step's host row, device values copied into the open row, slots assigned
        to new columns; then the plan for the next steps that log the same way."""
        dev: list[tuple[int, torch.Tensor]] = []
        columns = self._columns
        host: list[tuple[int, HostValue]] = [(columns.host_slot(wc.SKIPPED), skipped)]
        if self._began:
            data, forward = self._phase_columns
            host.append((columns.host_slot(data), self._data_s))
            host.append((columns.host_slot(forward), self._forward_s))
        for name, value in scalars.items():
            column = self._column_of.get(name) or self._name_column(name)
            self._route(column, value, dev, host)
        # Without an optimizer the rate is known only if the loop logs ``lr``.
        groups = [] if self._manual else self._optimizer.param_groups
        if len(groups) != len(self._lr_columns):
            self._lr_columns = [wc.lr(g) for g in range(len(groups))]
        if lrs is None or len(lrs) != len(groups):
            lrs = [g["lr"] for g in groups]  # param groups added between the step and log()
        for column, lr in zip(self._lr_columns, lrs, strict=True):
            if type(lr) is float:  # the usual rate: straight to its host slot
                host.append((columns.host_slot(column), lr))
            else:
                self._route(column, lr, dev, host)
        if self._scaler is not None:
            # The scale as a device tensor; get_scale() would sync.
            scale = getattr(self._scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                self._route(wc.LOSS_SCALE, scale, dev, host)
        buffer = self._buffer
        if columns.dirty:
            buffer.relayout()
        for slot, tensor in dev:
            buffer.cell(slot).copy_(tensor)
        host_row: list[HostValue] = [None] * columns.host_width
        for slot, cell_value in host:
            host_row[slot] = cell_value
        self._plan = (
            None
            if self._manual
            else RowPlan.make(
                columns,
                tuple(scalars),
                tuple(self._column_of[name] for name in scalars),
                tuple(self._lr_columns),
                self._phase_columns,
                wc.SKIPPED,
                wc.LOSS_SCALE,
                self._scaler,
                self._by_reference,
                self._device,
            )
        )
        return host_row

    def _route(
        self,
        column: str,
        value: Any,
        dev: list[tuple[int, torch.Tensor]],
        host: list[tuple[int, HostValue]],
    ) -> None:
        """Send a value to its device slot (tensors) or host slot (numbers)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self._warn_once(
                    column,
                    f"{column!r} is {describe(value)}; only "
                    "one-element tensors are logged, so it was skipped",
                )
                return
            # An autograd result (the loss of this step's forward) is not written in
            # place by the loop: on CPU the shipper reads it (agent/layout.py: Later),
            # which spares this thread a tensor copy per step.
            fresh = self._by_reference and value.grad_fn is not None
            value = value.detach()
            if value.dim():
                value = value.reshape(())
            if fresh:
                host.append((self._columns.host_slot(column), Later(value, value._version)))
            elif value.device == self._device:
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
            self._warn_once(
                column,
                f"{column!r} is {describe(value)}; log tensors or numbers, so it was skipped",
            )

    def _name_column(self, name: str) -> str:
        column = self._column_of[name] = wc.scalar(name)
        return column
