"""gradwatch for the Hugging Face ``transformers.Trainer``: one callback.

Example::

    from transformers import Trainer, TrainingArguments
    from gradwatch.integrations.transformers import GradwatchCallback

    args = TrainingArguments("out/run-42", logging_steps=10, logging_nan_inf_filter=False)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[GradwatchCallback(endpoint="tcp://collector:5555")])
    trainer.train()  # or trainer.train(resume_from_checkpoint=True)

Every optimizer step reaches gradwatch with its loss and its pre-clip
gradient norms, numbered with the Trainer's ``global_step`` (so after
``resume_from_checkpoint`` the steps go on from the checkpoint's, and
checkpoints, alerts and rollbacks name the same numbers). What it reads, when:

* ``on_train_begin``: ``gradwatch.watch`` on the Trainer's model (``self.model``,
  the unwrapped one under DDP) and a ``StepProbe`` of its optimizer (unwrapped
  from Accelerate's ``AcceleratedOptimizer``), starting at ``global_step + 1``.
  It also puts a forward hook on the model.
* The forward hook (training forwards only): the model output's ``loss`` is
  added up on the device over the step's micro-batches, with no sync; the
  step's loss is their mean (their sum when the Trainer passed
  ``num_items_in_batch``, which already scales each one for accumulation).
  On the micro-batch that completes the step (Accelerate's
  ``sync_gradients``), it hooks that output so that, at the end of its
  backward pass (after DDP/FSDP finished reducing the gradients, and before
  the Trainer clips them), the per-layer gradient norms are read: so the
  per-layer norms and their total are the pre-clip ones on every step, one
  consistent series. With an fp16 ``GradScaler`` the norms of the
  still-scaled gradients are divided by its scale, on the device.
* ``on_optimizer_step``: a step the ``GradScaler`` skipped is recorded at once
  and marked skipped.
* ``on_step_end``: the step is recorded, with its loss.
* Fallback, when the model's outputs carry no ``loss`` (a custom
  ``compute_loss``, label smoothing) or no tensor to hook (or a compiled
  model): the norms are read in the step pre-hook of the optimizer that
  really steps (after clipping), and the loss is the Trainer's own, at
  ``logging_steps`` only (the mean since the last log). A warning says so at
  the first step.
* ``on_evaluate``: ``log_eval(loss=eval_loss, <other eval metrics>)``.
* ``on_save``: ``checkpoint_saved(global_step, output_dir/checkpoint-<step>)``.
* ``on_train_end``: close (flushes what is buffered).

A failure inside the callback is logged once and switches monitoring off;
it never raises into the Trainer.
"""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gradwatch.agent import Monitor
from gradwatch.agent.hooks import Detached, hook_module
from gradwatch.integrations._attach import Attachment

__all__ = ["GradwatchCallback"]

logger = logging.getLogger(__name__)

# Eval metrics that describe the eval's speed, not the model.
_THROUGHPUT = ("runtime", "samples_per_second", "steps_per_second", "epoch")


class GradwatchCallback(TrainerCallback):
    """Watch a ``transformers.Trainer`` run with gradwatch; see the module docstring.

    ``job`` defaults to ``args.run_name``, else the name of ``args.output_dir``.
    ``watch_kwargs`` go to :func:`gradwatch.watch` as they are (``endpoint``,
    ``flush_every``, ``stats_every``, ...).
    """

    def __init__(self, job: str | None = None, **watch_kwargs: Any) -> None:
        self._attachment = Attachment(job, watch_kwargs, "transformers Trainer")
        self._open = False  # the optimizer stepped and the step is not recorded yet
        self._await_log = False  # fallback: record this step at on_log, with its loss
        self._forward_hook: Any = None
        self._optimizer: Any = None
        self._scaler: Any = None
        # This step's loss, summed on the device over its micro-batches.
        self._loss_sum: torch.Tensor | None = None
        self._micro = 0
        self._loss_scaled = False  # num_items_in_batch: each micro-loss is already scaled
        self._every_step = False  # a loss came from the forward hook (not only on_log)
        self._warned = False

    @property
    def monitor(self) -> Monitor | None:
        """The live monitor, or ``None`` before training, after it, or once switched off."""
        return self._attachment.monitor

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        self._open = self._await_log = self._every_step = self._warned = False
        self._loss_sum, self._micro = None, 0
        if model is None or optimizer is None:
            missing = "model" if model is None else "optimizer"
            self._attachment.refuse(
                f"the Trainer passed no {missing} to on_train_begin, so there is nothing to "
                "watch; use the transformers version gradwatch[integrations] names"
            )
            return
        job = self._attachment.job or args.run_name or Path(args.output_dir or ".").resolve().name
        self._optimizer = optimizer
        self._scaler = getattr(optimizer, "scaler", None)
        self._attachment.attach(
            model, optimizer, job, scaler=self._scaler, start_step=state.global_step + 1
        )
        if self.monitor is not None:
            self._remove_forward_hook()
            self._forward_hook = hook_module(
                model, Detached(self._on_forward, compile_safe=True), after=True, with_kwargs=True
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The last step waited for an on_log that never came: record it without a loss.
        self._record("recording a step at on_step_begin", {}, state.global_step)
        self._loss_sum, self._micro = None, 0

    def on_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        self._open = True
        # Accelerate knows this from a Python flag the GradScaler step set: no sync.
        if getattr(optimizer, "step_was_skipped", False) is True:
            self._attachment.run("marking a skipped step", lambda mon: mon.mark_skipped())
            self._record(
                "recording a step the GradScaler skipped", self._step_loss(), state.global_step + 1
            )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._open and not self._every_step and not self._warned:
            self._warned = True
            logger.warning(
                "gradwatch: the model's training outputs carry no 'loss' gradwatch can read "
                "(a custom compute_loss, label smoothing, or a compiled model), so the loss "
                "reaches it only every logging_steps=%s steps; return the loss from the "
                "model's forward to get it on every step",
                args.logging_steps,
            )
        # DefaultFlowCallback runs first and has set should_log for this step.
        if self._open and not self._every_step and control.should_log:
            self._await_log = True
        else:
            self._record("recording a step at on_step_end", self._step_loss(), state.global_step)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not (self._await_log and logs and "loss" in logs):
            return  # eval or end-of-training logs, or a step already recorded
        scalars = {"loss": logs["loss"]} if _is_number(logs.get("loss")) else {}
        self._record("recording a logged step at on_log", scalars, state.global_step)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        values = _eval_values(metrics or {})
        if values:
            self._attachment.run("sending an eval", lambda mon: mon.log_eval(**values))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step
        path = os.path.join(args.output_dir or ".", f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._attachment.run("reporting a checkpoint", lambda mon: mon.checkpoint_saved(step, path))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._record("recording the last step", {}, state.global_step)
        self._remove_forward_hook()
        self._attachment.close()

    # ------------------------------------------------------------ internals

    def _record(self, what: str, scalars: dict[str, Any], step: int) -> None:
        """Record the open step, if any, as ``step`` with ``scalars``."""
        if not self._open:
            return
        self._open = self._await_log = False
        self._attachment.gradients_read = False
        self._attachment.run(what, lambda mon: mon.log(step=step, **scalars))

    def _step_loss(self) -> dict[str, torch.Tensor]:
        total, n = self._loss_sum, self._micro
        self._loss_sum, self._micro = None, 0
        if total is None:
            return {}
        # A device tensor: the shipper reads it later, the Trainer never waits.
        return {"loss": total if self._loss_scaled else total / n}

    def _on_forward(
        self, module: torch.nn.Module, args: Any, kwargs: Mapping[str, Any], output: Any
    ) -> None:
        # Inside the Trainer's forward: never raise (Attachment.run logs and switches off).
        if module.training and torch.is_grad_enabled() and self.monitor is not None:
            self._attachment.run(
                "reading the loss in a forward hook", lambda mon: self._take(kwargs, output)
            )

    def _take(self, kwargs: Mapping[str, Any], output: Any) -> None:
        loss = _loss_of(output)
        if loss is not None:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._micro += 1
            self._loss_scaled = "num_items_in_batch" in kwargs
            self._every_step = True
        anchor = loss if loss is not None and loss.requires_grad else _grad_tensor(output)
        # Accelerate sets sync_gradients before the micro-batch that completes the step.
        state = getattr(self._optimizer, "gradient_state", None)
        if anchor is not None and getattr(state, "sync_gradients", True):
            anchor.register_hook(self._backward_began)

    def _backward_began(self, grad: torch.Tensor) -> None:
        # Queued twice: the second runs after the callbacks DDP/FSDP queue during
        # this backward (their gradient reductions), still before the Trainer clips.
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._backward_ended))

    def _backward_ended(self) -> None:
        scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
        self._attachment.read_now(scale if isinstance(scale, torch.Tensor) else None)

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None


def _loss_of(output: Any) -> torch.Tensor | None:
    """The ``loss`` of a model output (a ``ModelOutput`` or a dict), if one is there."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    return None


def _grad_tensor(output: Any) -> torch.Tensor | None:
    """A tensor of the output that backward will pass through (the logits), if any."""
    values = (
        output.values()
        if isinstance(output, Mapping)
        else (output if isinstance(output, (tuple, list)) else (output,))
    )
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _eval_values(metrics: dict[str, Any]) -> dict[str, float]:
    """``eval_loss`` as ``loss``, other ``eval_*`` numbers without the prefix, speed left out."""
    if not _is_number(metrics.get("eval_loss")):
        return {}
    values: dict[str, float] = {}
    for key, value in metrics.items():
        name = key.removeprefix("eval_")
        if name not in _THROUGHPUT and _is_number(value):
            values[name] = value
    return values
