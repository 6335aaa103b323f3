"""The usual step's fast path (agent/rowplan.py) sends exactly what the general path sends.

The same seeded loop runs twice on a real PULL socket: once as shipped, once with
the plan refused on every step (every row then takes ``_general_row``, the
reference). The loop logs the ways loops do and changes them mid-run: a new
name, a number that is not a Python float, a 0-d tensor that is no autograd
result, a skipped optimizer step, two param groups under a scheduler, and the
loop's own step number. Every row must arrive with the same cells, bit for bit,
except the two phase clocks, which time the run itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gradwatch.agent import Monitor
from gradwatch.agent.rowplan import RowPlan
from gradwatch.wire import columns as wc
from tests.agent.receiver import Received, batch_config, receive, wait_connected

STEPS = 40
CLOCKS = {wc.scalar(wc.DATA_SECONDS_SCALAR), wc.scalar(wc.FORWARD_SECONDS_SCALAR)}


def _run(pull) -> Received:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 0.05},
            {"params": model[2].parameters(), "lr": 0.01},
        ],
        momentum=0.9,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    # Host buffers for every batch (batch_config): the two runs are compared row by row, so
    # neither may drop a batch when a busy machine starves its shipper.
    mon = Monitor(model, opt, batch_config("rowplan", endpoint, early_stats=True))
    seen = wait_connected(sock)
    for k in range(STEPS):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        loss.backward()
        logged: dict[str, object] = {"loss": loss, "acc": 0.5 * k}
        if k % 7 == 3:
            logged["tokens"] = torch.tensor(float(k))  # a 0-d tensor, not an autograd result
        if k == 15:
            logged["acc"] = np.float64(k)  # a Real that is not a Python float
        if k == 22:
            logged["late"] = 1  # a name first logged mid-run
        if k != 30:  # step 30: the optimizer step was skipped
            opt.step()
            sched.step()
        if k == 33:
            mon.log(step=100, **logged)  # the loop's own step number from here on
        else:
            mon.log(**logged)
        opt.zero_grad()
    mon.close()
    return receive(sock, mon, seen)


def test_the_plan_writes_every_cell_the_general_path_writes(pull, monkeypatch) -> None:
    planned = 0
    plan_row = RowPlan.row

    def counted(self: RowPlan, *args, **kwargs):
        nonlocal planned
        row = plan_row(self, *args, **kwargs)
        planned += row is not None
        return row

    monkeypatch.setattr(RowPlan, "row", counted)
    fast = _run(pull)
    # Without this the comparison below could pass on two general paths.
    assert planned >= STEPS // 2, f"the plan made only {planned} of {STEPS} rows"

    monkeypatch.setattr(RowPlan, "row", lambda *args, **kwargs: None)
    reference = _run(pull)

    assert len(fast.steps) == len(reference.steps) == STEPS
    assert list(fast.steps) == list(reference.steps)
    assert fast.layers == reference.layers
    for step, row in fast.steps.items():
        want = reference.steps[step]
        mine = {c: v for c, v in row.columns.items() if c not in CLOCKS}
        theirs = {c: v for c, v in want.columns.items() if c not in CLOCKS}
        assert mine == theirs, step
        assert row.layers == want.layers, step
    # The changes the loop made really reached the wire (else they tested nothing).
    assert fast.steps[4].columns[wc.scalar("tokens")] == 3.0
    assert fast.steps[31].columns[wc.SKIPPED] == 1.0
    assert fast.steps[16].columns[wc.scalar("acc")] == pytest.approx(15.0)
    assert 100 in fast.steps
