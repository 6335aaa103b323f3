"""The real Lightning ``Trainer`` with ``GradwatchCallback`` against a real collector.

A tiny LightningModule trains 2 epochs of 12 batches with gradient
accumulation 2 (12 optimizer steps) and gradient clipping, validating and
checkpointing each epoch. The collector must record exactly the Trainer's
steps, every layer's gradient norm, each step's loss (the mean of its two
micro-batch losses, as the module computed them), the pre-clip total norm,
one eval per epoch (none from the sanity check) and both checkpoint files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip(
    "lightning.pytorch", reason="lightning is not installed: pip install 'gradwatch[lightning]'"
)

from torch import nn  # noqa: E402  # after importorskip
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402  # after importorskip

from gradwatch.integrations.lightning import GradwatchCallback  # noqa: E402  # after importorskip
from gradwatch.wire.messages import WEIGHTS_WRITTEN  # noqa: E402  # after importorskip
from tests.integrations.recording import RecordingCollector  # noqa: E402  # after importorskip

EPOCHS, BATCHES, ACCUMULATE, BATCH, CLIP = 2, 12, 2, 8, 0.5
STEPS = EPOCHS * BATCHES // ACCUMULATE

# Lightning 2.6 still builds torch's deprecated pytree LeafSpec (torch >= 2.10 warns);
# not ours to fix, and filterwarnings=error would fail the run on it.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning")


class TinyModule(pl.LightningModule):
    """Keeps what it computed, so the test can compare with what the collector received."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.micro_losses: list[float] = []
        self.pre_clip_norms: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.micro_losses.append(loss.item())  # the test's record, not the callback's
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # Lightning calls this after the callbacks' hook and before it clips.
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.pre_clip_norms.append(torch.linalg.vector_norm(torch.stack(norms)).item())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = 3.0 * x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def test_lightning_fit_reaches_the_collector(collector: RecordingCollector, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TinyModule()
    callback = GradwatchCallback(
        job="pl-tiny", endpoint=collector.endpoint, flush_every=5, stats_every=0
    )
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1
    )
    monitors: list[Any] = []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        callbacks=[callback, checkpoints, _Spy(callback, monitors)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, _loader(BATCHES * BATCH, seed=1), _loader(32, seed=2))
    assert trainer.global_step == STEPS
    assert callback.monitor is None  # closed at on_fit_end

    got = collector.received("pl-tiny", monitors[0])
    assert [s.step for s in got.steps] == list(range(1, STEPS + 1))
    assert got.layers == ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")
    step_losses = [
        (a + b) / 2
        for a, b in zip(module.micro_losses[::2], module.micro_losses[1::2], strict=True)
    ]
    assert [s.loss for s in got.steps] == pytest.approx(step_losses, rel=1e-5)
    # Read after backward and before clipping: this step's full gradients, not the
    # previous step's (what a step pre-hook sees inside Lightning's closure) nor clipped ones.
    assert max(module.pre_clip_norms) > CLIP
    assert [s.grad_norm for s in got.steps] == pytest.approx(module.pre_clip_norms, rel=1e-5)
    for s in got.steps:
        assert len(s.layer_grad_norms) == 4
        assert all(v is not None and math.isfinite(v) and v > 0 for v in s.layer_grad_norms)
    assert [math.hypot(*s.layer_grad_norms) for s in got.steps] == pytest.approx(
        module.pre_clip_norms, rel=1e-5
    )
    # The rate each step used: StepLR halves it after every 4 steps, stepping after each.
    # The rate each step used (StepLR halves it every 4 steps), though Lightning steps
    # the scheduler before on_train_batch_end, where the step is recorded.
    assert [s.lr for s in got.steps] == [
        (pytest.approx(0.1 * 0.5 ** ((step - 1) // 4)),) for step in range(1, STEPS + 1)
    ]

    assert [e.step for e in got.evals] == [STEPS // EPOCHS, STEPS]
    assert [e.loss for e in got.evals] == pytest.approx(module.val_losses, rel=1e-5)

    saved = [(e.step, Path(e.fields["path"])) for e in got.events if e.kind == "checkpoint"]
    assert [step for step, _ in saved] == [STEPS // EPOCHS, STEPS]
    # Nothing but the optimizer wrote the weights between its steps (agent/fence.py).
    assert not [e for e in got.events if e.kind == WEIGHTS_WRITTEN]
    assert all(path.is_file() and path.parent == tmp_path / "ckpt" for _, path in saved)


class _Spy(pl.Callback):
    """Keeps the callback's monitor before on_fit_end closes and forgets it."""

    def __init__(self, callback: GradwatchCallback, into: list[Any]) -> None:
        self.callback, self.into = callback, into

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.into.append(self.callback.monitor)


class AmpModule(pl.LightningModule):
    """fp16 AMP on CPU with a GradScaler; step 4's loss is made infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.stepped: list[int] = []  # steps the real optimizer took (the scaler skips others)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * float("inf") if self.trainer.global_step == 3 else loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        opt.register_step_post_hook(lambda *_: self.stepped.append(self.trainer.global_step + 1))
        return opt


def test_lightning_amp_reports_the_steps_the_scaler_skipped(collector: RecordingCollector) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    module = AmpModule()
    callback = GradwatchCallback(job="pl-amp", endpoint=collector.endpoint, stats_every=0)
    monitors: list[Any] = []
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=8,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        gradient_clip_val=CLIP,
        callbacks=[callback, _Spy(callback, monitors)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, _loader(64, seed=3))
    assert trainer.global_step == 8

    got = collector.received("pl-amp", monitors[0])
    assert [s.step for s in got.steps] == list(range(1, 9))
    skipped = [s.step for s in got.steps if s.skipped]
    assert 4 in skipped and skipped == sorted(set(range(1, 9)) - set(module.stepped))
    assert all(s.loss_scale is not None for s in got.steps)
    assert got.steps[3].loss == math.inf and got.steps[3].grad_norm is not None
    for s in got.steps:
        if not s.skipped:  # the pre-clip total, measured before Lightning clipped
            assert math.isfinite(s.grad_norm) and s.grad_norm > 0
            assert math.hypot(*s.layer_grad_norms) <= s.grad_norm * (1 + 1e-4)


# A resume writes its checkpoints next to the one it resumed from, as users do.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_resume_from_ckpt_path_continues_the_trainer_steps(tmp_path: Path) -> None:
    """fit(ckpt_path=...) restores global_step: the agent goes on from it, not from 1, and
    the checkpoints it reports carry the same numbering."""
    received = []
    for run, epochs in enumerate((1, EPOCHS)):
        collector = RecordingCollector(tmp_path / f"trace-{run}")
        try:
            torch.manual_seed(0)
            callback = GradwatchCallback(
                job="pl-resume", endpoint=collector.endpoint, flush_every=5, stats_every=0
            )
            checkpoints = pl.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1
            )
            monitors: list[Any] = []
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_epochs=epochs,
                accumulate_grad_batches=ACCUMULATE,
                callbacks=[callback, checkpoints, _Spy(callback, monitors)],
                enable_progress_bar=False,
                enable_model_summary=False,
                logger=False,
                default_root_dir=tmp_path,
                num_sanity_val_steps=0,
            )
            ckpt = str(next((tmp_path / "ckpt").glob("*.ckpt"))) if run else None
            trainer.fit(
                TinyModule(), _loader(BATCHES * BATCH, seed=1), _loader(32, seed=2), ckpt_path=ckpt
            )
            received.append(collector.received("pl-resume", monitors[0]))
        finally:
            collector.server.stop(timeout=5.0)
    first, resumed = received
    per_epoch = STEPS // EPOCHS
    assert [s.step for s in first.steps] == list(range(1, per_epoch + 1))
    assert [s.step for s in resumed.steps] == list(range(per_epoch + 1, STEPS + 1))
    assert [e.step for e in resumed.events if e.kind == "checkpoint"] == [STEPS]
    # The checkpoint is loaded before the first step: no write between two of them.
    assert not [e for e in resumed.events if e.kind == WEIGHTS_WRITTEN]
