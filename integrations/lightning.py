"""gradwatch for the Lightning ``Trainer``: one callback.

Supports the ``lightning`` package (``lightning.pytorch``), and the older
standalone ``pytorch_lightning`` where only that one is installed; the
callback must come from the same package as the Trainer it is given to.

Example::

    import lightning.pytorch as pl
    from gradwatch.integrations.lightning import GradwatchCallback

    callback = GradwatchCallback(job="run-42", endpoint="tcp://collector:5555")
    trainer = pl.Trainer(max_epochs=3, gradient_clip_val=1.0, callbacks=[callback])
    trainer.fit(module, train_loader, val_loader)

What it sends, and when:

* ``on_fit_start`` (the first hook at which the optimizers exist):
  ``gradwatch.watch(pl_module, trainer.optimizers[0])``. With several
  optimizers only the first is watched (its parameters are the layers).
  Under DDP ``pl_module`` is the unwrapped module. ``trainer.scaler`` (16-bit
  AMP) is passed as ``scaler``.
* ``on_before_optimizer_step``: the per-layer gradient norms are read here,
  after backward and before Lightning clips. Lightning runs forward and
  backward as a closure *inside* ``optimizer.step()``, so the agent's usual
  step pre-hook on it would see the previous step's gradients. The monitor
  therefore watches a stand-in (``StepProbe``: the real optimizer's
  parameters, a ``step()`` that only copies its parameter groups) that is
  stepped at the right moment; it also keeps the learning rates the step
  used, before Lightning's scheduler moves them. With a ``GradScaler``
  (16-bit AMP) Lightning runs the closure, unscales and clips before
  ``scaler.step``, so the stand-in is stepped from the real optimizer's own
  pre-hook instead: a step the scaler skips is then reported as skipped, the
  norms are post-clip, and when ``gradient_clip_val`` is set the pre-clip
  total is computed here on the device and sent as ``grad_norm``.
* ``on_train_batch_end``: once per optimizer step (``trainer.global_step``
  advanced), ``log(step=trainer.global_step, loss=..., grad_norm=...)``: the
  steps are the Trainer's, across a resume from ``ckpt_path`` too. The loss is ``outputs["loss"]``
  as a device tensor; with gradient accumulation, the sum of the micro-batch
  losses Lightning divided by ``accumulate_grad_batches``, i.e. their mean.
  Learning rates come from the optimizer's ``param_groups`` as copied when
  the gradients were read.
* ``on_validation_epoch_end``: ``log_eval(loss=trainer.callback_metrics["val_loss"])``
  (the key is ``val_loss_key``), skipped during the sanity check.
* ``on_save_checkpoint``: the checkpoint's file is written only after the hook,
  so it is reported at the callback's next hook, with the path the
  ``ModelCheckpoint`` callback saved to. A checkpoint saved by calling
  ``trainer.save_checkpoint`` directly has no path the callback can see:
  report it with ``callback.monitor.checkpoint_saved(step, path)``.
* ``on_fit_end`` / ``teardown`` / ``on_exception``: close.

A failure inside the callback is logged once and switches monitoring off;
it never raises into the Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # only the standalone package is installed
    try:
        # The standalone package's classes, the same API under another module name:
        # the names are typed by the first import (mypy cannot unify the two).
        from pytorch_lightning import (  # type: ignore[assignment]
            Callback,
            LightningModule,
            Trainer,
        )
    except ImportError as exc:
        raise ImportError(
            "gradwatch.integrations.lightning needs Lightning; install it with "
            "pip install 'gradwatch[lightning]' (or pip install lightning)"
        ) from exc

from gradwatch.agent import Monitor
from gradwatch.integrations._attach import Attachment, unwrap_optimizer

__all__ = ["GradwatchCallback"]

logger = logging.getLogger(__name__)


class GradwatchCallback(Callback):
    """Watch a Lightning ``Trainer.fit`` with gradwatch; see the module docstring.

    ``job`` defaults to the LightningModule's class name. ``val_loss_key`` is
    the ``self.log`` name of the validation loss. ``watch_kwargs`` go to
    :func:`gradwatch.watch` as they are (``endpoint``, ``flush_every``, ...).
    """

    def __init__(
        self, job: str | None = None, val_loss_key: str = "val_loss", **watch_kwargs: Any
    ) -> None:
        self._attachment = Attachment(job, watch_kwargs, "Lightning")
        self._val_loss_key = val_loss_key
        self._logged_step = 0  # trainer.global_step when the last step was recorded
        self._loss: torch.Tensor | None = None  # summed over this step's micro-batches
        self._grad_norm: torch.Tensor | None = None  # pre-clip, when Lightning clips
        self._checkpoint_step: int | None = None  # saved, its path not known yet
        self._amp = False  # a GradScaler: the probe follows the real optimizer's steps
        self._reported: set[tuple[int, str]] = set()
        self._warned_no_val_loss = False

    @property
    def monitor(self) -> Monitor | None:
        """The live monitor, or ``None`` before fit, after it, or once switched off."""
        return self._attachment.monitor

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logged_step = trainer.global_step
        self._loss = self._grad_norm = self._checkpoint_step = None
        optimizers = trainer.optimizers
        if not optimizers:
            self._attachment.refuse(
                "the Trainer has no optimizer at on_fit_start, so there is "
                "nothing to watch (configure_optimizers returned none)"
            )
            return
        job = self._attachment.job or type(pl_module).__name__
        scaler = trainer.scaler
        self._amp = scaler is not None
        self._attachment.attach(
            pl_module,
            optimizers[0],
            job,
            scaler=scaler,
            follow_real_steps=self._amp,
            start_step=trainer.global_step + 1,
        )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A resume (fit(ckpt_path=...)) restores global_step after on_fit_start.
        self._logged_step = trainer.global_step

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Any
    ) -> None:
        probe = self._attachment.probe
        if probe is None or unwrap_optimizer(optimizer) is not probe.real:
            return  # not watching, or another optimizer's step (manual optimization)
        if not self._amp:
            self._attachment.read_gradients()
        elif trainer.gradient_clip_val:
            # The scaler path reads post-clip norms; keep the pre-clip total.
            self._attachment.run(
                "measuring the pre-clip gradient norm",
                lambda mon: self._measure_grad_norm(optimizer),
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._report_checkpoint(trainer)
        self._attachment.run(
            "recording a step at on_train_batch_end",
            lambda mon: self._record(mon, trainer, pl_module, outputs),
        )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report_checkpoint(trainer)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report_checkpoint(trainer)
        if trainer.sanity_checking or self.monitor is None:
            return
        value = trainer.callback_metrics.get(self._val_loss_key)
        if value is None:
            if not self._warned_no_val_loss:
                self._warned_no_val_loss = True
                logger.warning(
                    "gradwatch: no %r in trainer.callback_metrics at the end of validation, so no "
                    "eval is sent; log it with self.log(%r, loss) in validation_step, or pass "
                    "val_loss_key= to GradwatchCallback",
                    self._val_loss_key,
                    self._val_loss_key,
                )
            return
        self._attachment.run("sending an eval", lambda mon: mon.log_eval(loss=value))

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._checkpoint_step = trainer.global_step

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish(trainer)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._finish(trainer)

    # ------------------------------------------------------------ internals

    def _measure_grad_norm(self, optimizer: Any) -> None:
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if grads:
            # On the device, like Lightning's own clipping; read by the agent's shipper.
            self._grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def _record(
        self, mon: Monitor, trainer: Trainer, pl_module: LightningModule, outputs: Any
    ) -> None:
        loss = _loss_of(outputs)
        if loss is not None:
            # Automatic optimization divided each micro-batch loss by
            # accumulate_grad_batches: their sum is the step's mean loss.
            summed = self._loss if pl_module.automatic_optimization else None
            self._loss = loss if summed is None else summed + loss
        if trainer.global_step == self._logged_step:
            return  # accumulating: no optimizer step yet
        self._logged_step = trainer.global_step
        scalars: dict[str, torch.Tensor] = {}
        if self._loss is not None:
            scalars["loss"] = self._loss
        if self._grad_norm is not None:
            scalars["grad_norm"] = self._grad_norm
        self._loss = self._grad_norm = None
        # The Trainer's own count (restored by a resume from ckpt_path), as its checkpoints use.
        mon.log(step=trainer.global_step, **scalars)

    def _report_checkpoint(self, trainer: Trainer) -> None:
        """Report a checkpoint saved since the last hook, with the path ModelCheckpoint used."""
        step, self._checkpoint_step = self._checkpoint_step, None
        if step is None or self.monitor is None:
            return
        for callback in trainer.checkpoint_callbacks:
            # ModelCheckpoint keeps the file it wrote last, and its step, in private
            # attributes (its public best/last paths miss top-k saves); getattr, as
            # they may go. A save at another step was not this callback's.
            path = getattr(callback, "_last_checkpoint_saved", "") or ""
            saved = (step, path)
            if (
                path
                and getattr(callback, "_last_global_step_saved", None) == step
                and saved not in self._reported
            ):
                self._reported.add(saved)
                self._attachment.run("reporting a checkpoint", _saved_reporter(step, path))

    def _finish(self, trainer: Trainer) -> None:
        self._report_checkpoint(trainer)
        self._attachment.close()


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss ``training_step`` returned: a tensor, or a mapping's ``"loss"``."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach()
    return None


def _saved_reporter(step: int, path: str) -> Callable[[Monitor], None]:
    """What reports one saved checkpoint to a monitor (bound now: the loop moves on)."""

    def report(mon: Monitor) -> None:
        mon.checkpoint_saved(step, path)

    return report
