"""The real ``transformers.Trainer`` with ``GradwatchCallback`` against a real collector.

A tiny ``PreTrainedModel`` (built from code, nothing downloaded) trains for
12 optimizer steps with gradient accumulation 2, logging every 2 steps,
evaluating and saving every 6, clipping at 0.5. The collector must record
exactly the Trainer's steps, each with its loss (the mean of its
micro-batches, read on the device) and every layer's pre-clip gradient norm
(their total is the Trainer's logged pre-clip ``grad_norm``), both evals and
both checkpoints; after ``resume_from_checkpoint`` the steps go on from the
checkpoint's.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'gradwatch[hf]'"
)
pytest.importorskip(
    "accelerate", reason="the transformers Trainer needs accelerate: pip install 'gradwatch[hf]'"
)

from torch import nn  # noqa: E402  # after importorskip
from transformers import (  # noqa: E402  # after importorskip
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)

from gradwatch.integrations.transformers import GradwatchCallback  # noqa: E402  # after the skips
from gradwatch.wire.messages import WEIGHTS_WRITTEN  # noqa: E402  # after the skips
from tests.integrations.recording import RecordingCollector  # noqa: E402  # after importorskip

STEPS, ACCUMULATE, LOG_EVERY, EVAL_EVERY = 12, 2, 2, 6
N_IN, N_CLASSES, BATCH = 8, 3, 4


class TinyConfig(PretrainedConfig):
    model_type = "gradwatch-tiny"

    def __init__(
        self, n_in: int = N_IN, hidden: int = 16, n_classes: int = N_CLASSES, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.n_in, self.hidden, self.n_classes = n_in, hidden, n_classes


class TinyClassifier(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.body = nn.Sequential(
            nn.Linear(config.n_in, config.hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(config.hidden, config.n_classes),
        )
        self.post_init()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.body(x)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class RandomSet(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, N_IN, generator=g)
        self.y = torch.randint(0, N_CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _trainer(
    output_dir: Path,
    callback: GradwatchCallback,
    max_steps: int = STEPS,
    save_only_model: bool = True,
    trainer_class: type[Trainer] = Trainer,
) -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(output_dir),
        run_name="hf-tiny",
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        per_device_eval_batch_size=16,
        learning_rate=0.05,
        max_grad_norm=0.5,
        logging_steps=LOG_EVERY,
        logging_nan_inf_filter=False,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        save_strategy="steps",
        save_steps=EVAL_EVERY,
        save_only_model=save_only_model,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return trainer_class(
        model=TinyClassifier(TinyConfig()),
        args=args,
        train_dataset=RandomSet(STEPS * ACCUMULATE * BATCH, seed=1),
        eval_dataset=RandomSet(32, seed=2),
        callbacks=[callback],
    )


def test_trainer_run_reaches_the_collector(collector: RecordingCollector, tmp_path: Path) -> None:
    callback = GradwatchCallback(endpoint=collector.endpoint, flush_every=5, stats_every=0)
    trainer = _trainer(tmp_path / "out", callback)
    monitor_of_run: list[Any] = []
    trainer.add_callback(_Spy(callback, monitor_of_run))
    trainer.train()
    assert callback.monitor is None  # closed at on_train_end
    assert trainer.state.global_step == STEPS

    got = collector.received("hf-tiny", monitor_of_run[0])
    assert [s.step for s in got.steps] == list(range(1, STEPS + 1))
    names = tuple(name for name, _ in trainer.model.named_parameters())
    assert got.layers == names == ("body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias")
    for s in got.steps:
        assert len(s.layer_grad_norms) == len(names)
        assert all(v is not None and math.isfinite(v) and v > 0 for v in s.layer_grad_norms)
        assert not s.skipped

    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert any(h["grad_norm"] > 0.5 for h in logged.values())  # clipping was active
    by_step = {s.step: s for s in got.steps}
    for step, h in logged.items():
        # Every step carries its own loss; the Trainer logs their mean since its last log.
        losses = [by_step[k].loss for k in range(step - LOG_EVERY + 1, step + 1)]
        assert all(v is not None for v in losses)
        # abs: transformers 4.x rounds the logged loss to 4 decimals (5.x does not).
        assert sum(losses) / LOG_EVERY == pytest.approx(h["loss"], rel=1e-5, abs=5e-5)
        # Per-layer norms read before the Trainer clipped: their total is its pre-clip norm.
        total = math.sqrt(sum(v * v for v in by_step[step].layer_grad_norms))
        assert total == pytest.approx(h["grad_norm"], rel=1e-5)
        # The rate this step used (two groups: decay, no decay), though the Trainer
        # steps its linear scheduler before the step is recorded.
        assert by_step[step].lr == (pytest.approx(h["learning_rate"], rel=1e-6),) * 2
    for s in got.steps:  # one series: the collector's total of the pre-clip layer norms
        total = math.sqrt(sum(v * v for v in s.layer_grad_norms))
        assert s.grad_norm == pytest.approx(total, rel=1e-5)

    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert sorted(evals) == [EVAL_EVERY, STEPS]
    assert [(e.step, e.loss) for e in got.evals] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss in sorted(evals.items())
    ]
    assert all(e.train_mode_modules == () for e in got.evals)  # Dropout was in eval mode

    checkpoints = [(e.step, e.fields["path"]) for e in got.events if e.kind == "checkpoint"]
    # Nothing but the optimizer wrote the weights between its steps (agent/fence.py).
    assert not [e for e in got.events if e.kind == WEIGHTS_WRITTEN]
    expected = [
        (step, str(tmp_path / "out" / f"checkpoint-{step}")) for step in (EVAL_EVERY, STEPS)
    ]
    assert checkpoints == expected
    assert all(Path(path).is_dir() for _, path in checkpoints)


def test_a_failing_monitor_never_stops_the_trainer(
    collector: RecordingCollector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = GradwatchCallback(job="hf-broken", endpoint=collector.endpoint)

    def explode(**scalars: Any) -> None:
        raise RuntimeError("injected by the test")

    trainer = _trainer(tmp_path / "out", callback)
    trainer.add_callback(_Breaker(callback, explode))
    with caplog.at_level(logging.ERROR, logger="gradwatch.integrations._attach"):
        trainer.train()
    assert trainer.state.global_step == STEPS
    errors = [r for r in caplog.records if "injected by the test" in r.getMessage()]
    assert len(errors) == 1  # logged once, then off
    assert callback.monitor is None


class _Spy(transformers.TrainerCallback):
    """Keeps the callback's monitor before on_train_end closes and forgets it."""

    def __init__(self, callback: GradwatchCallback, into: list[Any]) -> None:
        self.callback, self.into = callback, into

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.into.append(self.callback.monitor)


class _Breaker(transformers.TrainerCallback):
    """Makes the watched monitor's log() raise from the first step on."""

    def __init__(self, callback: GradwatchCallback, log: Any) -> None:
        self.callback, self.log = callback, log

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        assert self.callback.monitor is not None
        # The test replaces log to record what the monitor logs.
        self.callback.monitor.log = self.log  # type: ignore[method-assign]


def test_resume_from_checkpoint_continues_the_trainer_steps(tmp_path: Path) -> None:
    """After resume_from_checkpoint the agent goes on from the checkpoint's global step (it
    used to restart at 1), and its checkpoint events carry the same numbering."""
    monitors: list[Any] = []
    received = []
    for run, max_steps in enumerate((6, STEPS)):
        collector = RecordingCollector(tmp_path / f"trace-{run}")
        try:
            callback = GradwatchCallback(
                job="hf-resume", endpoint=collector.endpoint, flush_every=5, stats_every=0
            )
            trainer = _trainer(
                tmp_path / "out", callback, max_steps=max_steps, save_only_model=False
            )
            trainer.add_callback(_Spy(callback, monitors))
            trainer.train(
                resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6") if run else None
            )
            received.append(collector.received("hf-resume", monitors[-1]))
        finally:
            collector.server.stop(timeout=5.0)
    first, resumed = received
    assert [s.step for s in first.steps] == list(range(1, 7))
    assert [s.step for s in resumed.steps] == list(range(7, STEPS + 1))
    assert all(s.loss is not None for s in resumed.steps)
    assert [e.step for e in resumed.events if e.kind == "checkpoint"] == [STEPS]
    # The checkpoint is loaded before the first step: no write between two of them.
    assert not [e for e in resumed.events if e.kind == WEIGHTS_WRITTEN]


def test_a_model_without_a_loss_output_falls_back_to_logged_losses_and_says_so(
    collector: RecordingCollector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = GradwatchCallback(endpoint=collector.endpoint, flush_every=5, stats_every=0)

    class OwnLoss(Trainer):  # a custom compute_loss: the model's output has no loss
        def compute_loss(
            self,
            model: Any,
            inputs: Any,
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = nn.functional.cross_entropy(outputs["logits"], labels)
            return (loss, outputs) if return_outputs else loss

    trainer = _trainer(tmp_path / "out", callback, trainer_class=OwnLoss)
    monitors: list[Any] = []
    trainer.add_callback(_Spy(callback, monitors))
    with caplog.at_level(logging.WARNING, logger="gradwatch.integrations.transformers"):
        trainer.train()
    assert sum("carry no 'loss'" in r.getMessage() for r in caplog.records) == 1
    got = collector.received("hf-tiny", monitors[0])
    assert [s.step for s in got.steps] == list(range(1, STEPS + 1))
    with_loss = [s.step for s in got.steps if s.loss is not None]
    assert with_loss == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    # The logits were still hooked: the norms are the pre-clip ones on every step.
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    for s in got.steps:
        if s.step in logged:
            total = math.sqrt(sum(v * v for v in s.layer_grad_norms))
            assert total == pytest.approx(logged[s.step], rel=1e-5)


def test_the_every_step_path_makes_no_syncing_call(
    collector: RecordingCollector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward hook, the end-of-backward read and the per-step log never read a device
    value on the training thread (tests/agent/test_agent_nosync.py's structural check)."""
    import threading

    from tests.agent.test_agent_nosync import SYNCING, SyncDetector

    found = SyncDetector(threading.get_ident())
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, found.wrap(name, getattr(torch.Tensor, name)))
    callback = GradwatchCallback(endpoint=collector.endpoint, flush_every=5, stats_every=4)
    trainer = _trainer(tmp_path / "out", callback)
    monitors: list[Any] = []
    trainer.add_callback(_Spy(callback, monitors))
    trainer.train()
    assert found.calls == []
    got = collector.received("hf-tiny", monitors[0])
    assert all(s.loss is not None for s in got.steps) and len(got.steps) == STEPS
