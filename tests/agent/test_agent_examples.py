"""pytorch/examples and nanoGPT loops, recreated with small models, run under the agent.

* word_language_model: no optimizer (``p.data.add_(p.grad, alpha=-lr)``),
  gradient clipping, the learning rate annealed by hand, and the whole model
  saved with ``torch.save(model, f)`` every epoch (which crashed while watched), then
  reloaded with ``torch.load``'s default ``weights_only`` and the script's classes
  allowlisted (which failed on a gradwatch class in the file).
* mnist: Adadelta, StepLR stepped per epoch, Dropout, ``model.train()`` /
  ``model.eval()`` around a test pass each epoch.
* nanoGPT's step numbering: iterations count from 0 and a resume continues
  at the checkpoint's ``iter_num``; with ``log(step=iter_num)`` gradwatch's
  steps are the script's iterations.

Each loop runs bare and watched from the same seed: the numbers must be
identical, and the agent must have reported every step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch
from gradwatch.wire import columns as wc
from tests.agent.receiver import Received, receive, wait_connected


def monitor(pull: Any, model: nn.Module, opt: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
    sock, endpoint = pull
    # Few batches: a starved shipper (busy machine) must not run out of host buffers.
    mon = gradwatch.watch(
        model, opt, job="example", endpoint=endpoint, flush_every=16, heartbeat_every=0.05, **kwargs
    )
    return mon, wait_connected(sock)


def finish(pull: Any, mon: Any, seen: list[Any]) -> Received:
    mon.close()
    s = mon.stats
    assert s.disabled is None and s.steps_dropped == 0 and s.events_dropped == 0, s
    return receive(pull[0], mon, seen)


# ------------------------------------------------------------ word_language_model


class RNNModel(nn.Module):
    """word_language_model's model, small: encoder, LSTM, decoder, dropout."""

    def __init__(self, ntoken: int = 50, ninp: int = 16, nhid: int = 16) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, 1)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return weight.new_zeros(1, bsz, 16), weight.new_zeros(1, bsz, 16)


def word_language_model(tmp: Path, pull: Any | None) -> tuple[list[float], Received | None]:
    torch.manual_seed(0)
    data = torch.randint(0, 50, (200, 4))  # (tokens, batch)
    model = RNNModel()
    mon, seen = monitor(pull, model, None, stats_every=4) if pull else (None, [])
    lr, bptt, clip, losses = 5.0, 10, 0.25, []
    best_val = None
    for _epoch in range(1, 3):
        model.train()
        hidden = model.init_hidden(4)
        for i in range(0, data.size(0) - 1 - bptt, bptt):
            x, y = data[i : i + bptt], data[i + 1 : i + 1 + bptt]
            model.zero_grad()
            hidden = tuple(h.detach() for h in hidden)
            output, hidden = model(x, hidden)
            loss = F.cross_entropy(output.view(-1, 50), y.reshape(-1))
            loss.backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            if mon is not None:
                mon.log(loss=loss, lr=lr, grad_norm=total)  # after the update, before zero_grad
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            out, _ = model(data[:20], model.init_hidden(4))
            val = F.cross_entropy(out.view(-1, 50), data[1:21].reshape(-1)).item()
        if mon is not None:
            mon.log_eval(loss=val)
        if best_val is None or val < best_val:
            with open(tmp / "model.pt", "wb") as f:
                torch.save(model, f)  # the whole model, every improving epoch
            best_val = val
        else:
            lr /= 4.0
        losses.append(val)
    with open(tmp / "model.pt", "rb") as f:
        # As the script reloads it: torch.load's default (weights_only), its own classes
        # allowlisted, none of gradwatch's.
        with torch.serialization.safe_globals(
            [RNNModel, nn.Dropout, nn.Embedding, nn.LSTM, nn.Linear]
        ):
            reloaded = torch.load(f)
    losses.append(reloaded(data[:5], reloaded.init_hidden(4))[0].sum().item())
    return losses, finish(pull, mon, seen) if mon is not None else None


def test_word_language_model_manual_sgd_and_torch_save(tmp_path: Path, pull) -> None:
    (tmp_path / "bare").mkdir()
    (tmp_path / "watched").mkdir()
    bare, _ = word_language_model(tmp_path / "bare", None)
    watched, got = word_language_model(tmp_path / "watched", pull)
    assert watched == bare
    assert got is not None
    steps = sorted(got.steps)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == 2 * 19
    assert got.layers == (
        "encoder.weight",
        "rnn.weight_ih_l0",
        "rnn.weight_hh_l0",
        "rnn.bias_ih_l0",
        "rnn.bias_hh_l0",
        "decoder.weight",
        "decoder.bias",
    )
    for step in steps:
        row = got.steps[step]
        assert row.columns["lr/0"] == 5.0 and row.columns["skipped"] == 0.0
        assert math.isfinite(row.columns["loss"])
        assert math.isfinite(row.columns[wc.scalar("grad_norm")])
        # Read at log(): the clipped gradients of this step (the pre-clip total is logged).
        total = math.sqrt(sum(v * v for v in row.layers))
        assert total <= 0.25 * (1 + 1e-4)
    assert len(got.kinds("eval")) == 2
    # Update ratios from the weights before and after the hand-written update.
    ratios = [got.stats[s].columns[wc.update_ratio("decoder.weight")] for s in got.stats]
    measured = [r for r in ratios if r is not None]
    assert measured and all(0 < r < 1 for r in measured)


def test_manual_update_ratio_is_the_hand_written_update(pull) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)  # 1,024 weights: small enough to be sampled whole
    mon, seen = monitor(pull, model, None, stats_every=1, activation_stats=False)
    expected = {}
    for step in range(1, 5):
        model.zero_grad()
        model(torch.randn(32, 32)).pow(2).mean().backward()
        before = model.weight.detach().clone()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        expected[step] = ((model.weight - before).norm() / model.weight.norm()).item()
        mon.log(loss=1.0)
    got = finish(pull, mon, seen)
    column = wc.update_ratio("weight")
    for step in (2, 3, 4):  # step 1: no copy of the weights before its update yet
        assert got.stats[step].columns[column] == pytest.approx(expected[step], rel=1e-3)


# ------------------------------------------------------------ mnist


class Net(nn.Module):
    """pytorch/examples mnist's network, for 1x12x12 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def mnist(pull: Any | None) -> tuple[list[float], Received | None]:
    torch.manual_seed(1)
    images, labels = torch.randn(96, 1, 12, 12), torch.randint(0, 10, (96,))
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    mon, seen = monitor(pull, model, optimizer, stats_every=5) if pull else (None, [])
    losses = []
    for _epoch in range(1, 3):
        model.train()
        for i in range(0, 96, 16):
            optimizer.zero_grad()
            loss = F.nll_loss(model(images[i : i + 16]), labels[i : i + 16])
            loss.backward()
            optimizer.step()
            if mon is not None:
                mon.log(loss=loss)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            test_loss = F.nll_loss(model(images[:32]), labels[:32], reduction="sum").item() / 32
        if mon is not None:
            mon.log_eval(loss=test_loss)  # while the model is in eval mode
        losses.append(test_loss)
        scheduler.step()
    return losses, finish(pull, mon, seen) if mon is not None else None


def test_mnist_adadelta_steplr_dropout(pull) -> None:
    bare, _ = mnist(None)
    watched, got = mnist(pull)
    assert watched == bare
    assert got is not None and sorted(got.steps) == list(range(1, 13))
    assert [got.steps[s].columns["lr/0"] for s in (1, 6, 7, 12)] == pytest.approx(
        [1.0, 1.0, 0.7, 0.7]
    )
    assert all(math.isfinite(v) and v > 0 for v in got.steps[12].layers)
    evals = got.kinds("eval")
    assert len(evals) == 2 and all(e.fields["train_mode_modules"] == [] for e in evals)


# ------------------------------------------------------------ nanoGPT step numbers


def nanogpt_iterations(
    pull: Any,
    model: nn.Module,
    opt: Any,
    start: int,
    stop: int,
    checkpoints: dict[int, dict[str, Any]],
) -> Received:
    """nanoGPT's loop shape: iter_num from ``start``, a checkpoint every 3 iterations."""
    mon, seen = monitor(pull, model, opt)
    for iter_num in range(start, stop):
        if iter_num % 3 == 0 and iter_num > start:
            checkpoints[iter_num] = {"model": model.state_dict(), "iter_num": iter_num}
            mon.checkpoint_saved(iter_num, f"out/ckpt-{iter_num}.pt")
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.log(step=iter_num, loss=loss)
    return finish(pull, mon, seen)


def test_nanogpt_iterations_are_gradwatch_steps_across_a_resume(pull) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoints: dict[int, dict[str, Any]] = {}
    first = nanogpt_iterations(pull, model, opt, 0, 7, checkpoints)
    assert sorted(first.steps) == list(range(7))
    assert [(e.step, e.fields["path"]) for e in first.kinds("checkpoint")] == [
        (3, "out/ckpt-3.pt"),
        (6, "out/ckpt-6.pt"),
    ]
    # init_from='resume': the script continues at the checkpoint's iter_num.
    model.load_state_dict(checkpoints[3]["model"])
    resumed = nanogpt_iterations(pull, model, opt, checkpoints[3]["iter_num"], 7, {})
    assert sorted(resumed.steps) == [3, 4, 5, 6]


def test_log_step_rewind_starts_a_new_incarnation_and_bad_steps_are_ignored(pull, caplog) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon, seen = monitor(pull, model, opt, start_step=10)
    for step in (None, None, 5, None, torch.tensor(3), -1):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.log(step=step, loss=1.0)
    got = finish(pull, mon, seen)
    assert got.step_order == [10, 11, 5, 6, 7, 8]
    assert got.steps[10].incarnation != got.steps[5].incarnation
    assert "needs a non-negative Python int" in caplog.text


def test_an_eval_before_the_first_step_of_a_run_numbered_from_zero_is_step_zero(pull) -> None:
    # nanoGPT evaluates at iter_num 0 before training; with start_step=0 the eval
    # must not carry step -1 (traces and replay refuse negative steps).
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon, seen = monitor(pull, model, opt, start_step=0)
    mon.log_eval(loss=2.0)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=1.0)
    got = finish(pull, mon, seen)
    assert [e.step for e in got.kinds("eval")] == [0]
    assert sorted(got.steps) == [0, 1]
