"""The weights written outside the optimizer between two of its steps (agent/fence.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.wire.messages import WEIGHTS_WRITTEN


def written_at(
    between: Callable[[nn.Module, int], None], steps: int = 12, **kw: Any
) -> list[tuple[int, str]]:
    """Train a small MLP, calling ``between(model, step)`` before each step's forward:
    the steps whose weights_written event the agent queued, and the parameters it named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = gradwatch.watch(model, opt, job="fence", endpoint="tcp://127.0.0.1:1", **kw)
    events: list[tuple[int, str]] = []
    queue = mon._event

    def record(kind: str, step: int, values: dict[str, Any], extra: Any = None) -> None:
        if kind == WEIGHTS_WRITTEN:
            events.append((step, values["params"]))
        queue(kind, step, values, extra)

    mon._event = record
    for step in range(1, steps + 1):
        between(model, step)
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    mon.close()
    return events


def test_plain_training_writes_nothing_outside_the_optimizer() -> None:
    assert written_at(lambda model, step: None) == []


def reinitialise(model: nn.Module, step: int) -> None:
    if step == 6:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()  # model.apply(init) run again by mistake


def test_a_reinitialisation_or_a_checkpoint_load_between_steps_is_reported_at_its_step() -> None:
    both = "0.weight, 2.bias"  # the first and last watched parameters, the two it reads
    assert written_at(reinitialise) == [(6, both)]
    saved: dict[str, torch.Tensor] = {}

    def reload(model: nn.Module, step: int) -> None:
        if step == 3:
            saved.update({k: v.clone() for k, v in model.state_dict().items()})
        if step == 9:
            model.load_state_dict(saved)

    assert written_at(reload) == [(9, both)]
    # A new storage (p.data = ..., as a cast or a move does) is a write too.

    def new_storage(model: nn.Module, step: int) -> None:
        if step == 4:
            model[0].weight.data = model[0].weight.data.clone()

    assert written_at(new_storage) == [(4, "0.weight")]


def test_a_write_on_every_step_is_reported_once() -> None:
    # A max-norm constraint or WGAN's weight clipping, applied after log(): by design.
    def clip(model: nn.Module, step: int) -> None:
        if step >= 5:
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.5, 0.5)

    assert written_at(clip) == [(5, "0.weight, 2.bias")]


@pytest.mark.parametrize("kw", [{"stats_every": 2}, {"early_stats": False}])
def test_the_agents_own_statistics_write_nothing(kw: dict[str, Any]) -> None:
    # Cadence samples read the weights (norms, update-ratio samples) and never write them.
    assert written_at(lambda model, step: None, steps=20, **kw) == []


def test_a_frameworks_stand_in_optimizer_is_fenced_too() -> None:
    # The HF Trainer and Lightning callbacks watch a probe of the real optimizer
    # (integrations/_attach.py); the weights it updates are fenced the same way.
    from gradwatch.integrations._attach import Attachment

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = Attachment("fence", {"endpoint": "tcp://127.0.0.1:1"}, "test")
    attachment.attach(model, opt, "fence")
    mon = attachment.monitor
    assert mon is not None
    events: list[int] = []
    queue = mon._event

    def record(kind: str, step: int, values: dict[str, Any], extra: Any = None) -> None:
        if kind == WEIGHTS_WRITTEN:
            events.append(step)
        queue(kind, step, values, extra)

    mon._event = record
    for step in range(1, 8):
        if step == 4:
            model.reset_parameters()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        mon.log(step=step, loss=1.0)
        opt.zero_grad()
    attachment.close()
    assert events == [4]
