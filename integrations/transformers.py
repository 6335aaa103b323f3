"""gradwatch for the Hugging Face ``transformers.Trainer``: one callback.

Example::

    from transformers import Trainer, TrainingArguments
    from gradwatch.integrations.transformers import GradwatchCallback

    args = TrainingArguments("out/run-42", logging_steps=10, logging_nan_inf_filter=False)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[GradwatchCallback(endpoint="tcp://collector:5555")])
    trainer.train()

What it sends, and when (Trainer events in the order they fire each step):

* ``on_train_begin``: ``gradwatch.watch`` on the Trainer's model (``self.model``,
  the unwrapped one under DDP) and its optimizer, unwrapped from Accelerate's
  ``AcceleratedOptimizer``: the gradients are read in the step pre-hook of
  the optimizer that really steps (after the Trainer clipped them). With
  gradient accumulation that optimizer steps once per real step, so gradwatch
  counts what the Trainer counts as ``global_step``. The monitor watches a
  ``StepProbe`` of it, which keeps the learning rates the step used (the
  Trainer steps its scheduler before the step is recorded). An fp16
  ``GradScaler`` held by the optimizer wrapper is passed as ``scaler``.
* ``on_optimizer_step``: a step the ``GradScaler`` skipped is recorded at once,
  while its gradients still exist (the Trainer zeroes them next).
* ``on_step_end`` / ``on_log``: other steps are recorded at ``on_step_end``;
  a step the Trainer is about to log waits for ``on_log`` and carries the
  Trainer's own ``loss`` (the mean over the steps since the last log) and
  ``grad_norm`` (the pre-clip total norm of this step). The Trainer has
  already read those on the host, so this adds no device sync.
* ``on_evaluate``: ``log_eval(loss=eval_loss, <other eval metrics>)``.
* ``on_save``: ``checkpoint_saved(global_step, output_dir/checkpoint-<step>)``.
* ``on_train_end``: close (flushes what is buffered).

A failure inside the callback is logged once and switches monitoring off;
it never raises into the Trainer.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gradwatch.agent import Monitor
from gradwatch.integrations._attach import Attachment

__all__ = ["GradwatchCallback"]

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
        # The optimizer stepped and the step is not recorded yet.
        self._open = False
        # The Trainer logs this step: record it at on_log, with its loss.
        self._await_log = False

    @property
    def monitor(self) -> Monitor | None:
        """The live monitor, or ``None`` before training, after it, or once switched off."""
        return self._attachment.monitor

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: torch.nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self._open = self._await_log = False
        if model is None or optimizer is None:
            missing = "model" if model is None else "optimizer"
            self._attachment.refuse(
                f"the Trainer passed no {missing} to on_train_begin, so there is nothing to "
                "watch; use the transformers version gradwatch[integrations] names")
            return
        job = self._attachment.job or args.run_name or Path(args.output_dir or ".").resolve().name
        self._attachment.attach(model, optimizer, job, scaler=getattr(optimizer, "scaler", None))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        # The last step waited for an on_log that never came: record it without a loss.
        self._record("recording a step at on_step_begin", {})

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                          control: TrainerControl, optimizer: Any = None, **kwargs: Any) -> None:
        # A step still open here was recorded by the monitor's own pre-hook.
        self._open = True
        # Accelerate knows this from a Python flag the GradScaler step set: no sync.
        if getattr(optimizer, "step_was_skipped", False) is True:
            self._record("recording a step the GradScaler skipped", {})

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        # DefaultFlowCallback runs first and has set should_log for this step.
        if self._open and control.should_log:
            self._await_log = True
        else:
            self._record("recording a step at on_step_end", {})

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not (self._await_log and logs and "loss" in logs):
            return  # eval or end-of-training logs, or a step already recorded
        scalars = {key: logs[key] for key in ("loss", "grad_norm") if _is_number(logs.get(key))}
        self._record("recording a logged step at on_log", scalars)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        values = _eval_values(metrics or {})
        if values:
            self._attachment.run("sending an eval", lambda mon: mon.log_eval(**values))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        step = state.global_step
        path = os.path.join(args.output_dir or ".", f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._attachment.run("reporting a checkpoint", lambda mon: mon.checkpoint_saved(step, path))

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._record("recording the last step", {})
        self._attachment.close()

    def _record(self, what: str, scalars: dict[str, Any]) -> None:
        """Record the open step, if any, with ``scalars``."""
        if not self._open:
            return
        self._open = self._await_log = False
        self._attachment.run(what, lambda mon: mon.log(**scalars))


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
