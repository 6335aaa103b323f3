"""``optimizer.step(closure)``: the gradient norms sent are those the closure's first call
computed, at the step's starting point, from the first step on (agent/closures.py).
Before, the step pre-hook read before the closure ran: the last step's gradients, and
zeros at step 1. pytorch/examples' time_sequence_prediction (LBFGS) was sent exactly that."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.agent import Monitor
from tests.agent.receiver import batch_config, receive, wait_connected

STEPS = 6


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@pytest.mark.parametrize("optimizer", ["lbfgs", "sgd"])
@pytest.mark.parametrize("as_keyword", [False, True])
def test_norms_come_from_the_closures_first_call(pull, optimizer: str, as_keyword: bool) -> None:
    sock, endpoint = pull
    model = _model()
    if optimizer == "lbfgs":
        opt: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mon = Monitor(model, opt, batch_config("closure", endpoint, stats_every=0))
    seen = wait_connected(sock)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    first: list[list[float]] = []  # per step: each layer's norm after the first call
    calls: list[int] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls[-1] += 1
        if calls[-1] == 1:
            first.append([float(_grad(p).norm()) for p in model.parameters()])
        return loss

    for _ in range(STEPS):
        calls.append(0)
        loss = opt.step(closure=closure) if as_keyword else opt.step(closure)  # type: ignore[arg-type]  # torch types a closure's result as float; a tensor is what loops return
        mon.log(loss=loss)
    mon.close()
    got = receive(sock, mon, seen)
    assert sorted(got.steps) == list(range(1, STEPS + 1))
    if optimizer == "lbfgs":
        assert min(calls) > 1  # later evaluations, at other points, are not what is sent
    for step, norms in enumerate(first, start=1):
        row = got.steps[step]
        assert row.columns["skipped"] == 0.0
        sent = row.layers
        assert all(v is not None for v in sent)
        assert [pytest.approx(v, rel=1e-5) for v in norms] == sent, f"step {step}"
        assert not all(math.isclose(v or 0.0, 0.0) for v in sent)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as it is commonly written (a step given a closure after
    the loop's own backward pass): ascend to w + e, take the closure's gradients there,
    come back to w and descend along them."""

    def __init__(self, params: object, lr: float = 0.05, rho: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "rho": rho})  # type: ignore[arg-type]  # torch's ParamsT

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]  # SAM needs it
        assert callable(closure)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([p.grad.norm() for p in params]).norm()
        ascent = [p.grad * (self.defaults["rho"] / (norm + 1e-12)) for p in params]
        for p, e in zip(params, ascent, strict=True):
            p.add_(e)
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for p, e in zip(params, ascent, strict=True):
            p.sub_(e)
            p.add_(p.grad, alpha=-self.defaults["lr"])


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_the_loop_computed_before_a_closure_step_are_the_ones_sent(
    pull, set_to_none: bool
) -> None:
    """SAM: the loop's backward pass gives the gradients at w; its closure's, at w + e,
    come after a change of the weights and are not this step's reading."""
    sock, endpoint = pull
    model = _model()
    opt = SAM(model.parameters())
    mon = Monitor(model, opt, batch_config("sam", endpoint, stats_every=0))
    seen = wait_connected(sock)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    before: list[list[float]] = []

    def closure() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        before.append([float(_grad(p).norm()) for p in model.parameters()])
        opt.step(closure)
        mon.log(loss=loss)
        opt.zero_grad(set_to_none=set_to_none)
    mon.close()
    got = receive(sock, mon, seen)
    assert sorted(got.steps) == list(range(1, STEPS + 1))
    for step, norms in enumerate(before, start=1):
        assert [pytest.approx(v, rel=1e-5) for v in norms] == got.steps[step].layers, step
