"""Attachment.read_now: gradient norms read at a moment the callback picks, unscaled if need be."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from gradwatch.integrations._attach import Attachment
from tests.integrations.recording import RecordingCollector


def test_read_now_divides_still_scaled_gradients_by_the_scale_and_marks_skips(
    collector: RecordingCollector,
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    att = Attachment("scaled", {"endpoint": collector.endpoint, "stats_every": 0}, "test")
    att.attach(model, opt, "scaled")
    mon = att.monitor
    assert mon is not None
    # Connected (its first heartbeat arrived) before training: nothing sent is dropped.
    assert collector.server.wait_for_messages(1, timeout=10.0)
    scale = torch.tensor(1024.0)
    expected = []
    for step in range(1, 4):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        (loss * scale).backward()  # as GradScaler.scale(loss).backward() leaves them
        expected.append([(p.grad / scale).norm().item() for p in model.parameters()])
        att.read_now(unscale=scale)
        assert att.gradients_read
        opt.step()  # the real optimizer's own step does not read them again
        if step == 2:
            mon.mark_skipped()
        mon.log(step=step, loss=loss)
        att.gradients_read = False
        opt.zero_grad()
    copy.deepcopy(opt)  # the callback's hook on the real optimizer copies as a no-op
    att.close()
    got = collector.received("scaled", mon)
    assert [s.step for s in got.steps] == [1, 2, 3]
    assert [s.skipped for s in got.steps] == [False, True, False]
    for s, norms in zip(got.steps, expected, strict=True):
        assert all(
            math.isclose(a, b, rel_tol=1e-5) for a, b in zip(s.layer_grad_norms, norms, strict=True)
        )
