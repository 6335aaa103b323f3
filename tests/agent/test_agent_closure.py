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
            first.append([float(p.grad.norm()) for p in model.parameters()])
        return loss

    for _ in range(STEPS):
        calls.append(0)
        loss = opt.step(closure=closure) if as_keyword else opt.step(closure)
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
