"""The agent's shipper sets a batch's ``nonfinite`` hint exactly when a row holds a NaN/Inf.

A real ``Monitor`` on a small model sends to a real PULL socket on loopback;
MISSING cells (unmeasured layers, an unlogged scalar) never set it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

import pytest
import torch
import zmq
from torch import nn

from gradwatch.agent.layout import has_nonfinite
from gradwatch.agent.monitor import Monitor
from gradwatch.wire import MISSING_BITS, Batch, decode
from gradwatch.wire import columns as wc
from tests.agent.receiver import batch_config

WAIT_MS = 5000
MISSING = struct.pack("<I", MISSING_BITS)


@pytest.fixture
def pull() -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (struct.pack("<3f", 1.0, -2.0, 3.4e38), False),
        (MISSING * 4, False),  # not measured is not non-finite
        (struct.pack("<f", 1.0) + MISSING + struct.pack("<f", math.nan), True),
        (struct.pack("<2f", 0.0, -math.inf), True),
        (struct.pack("<f", math.inf), True),
        (b"", False),
    ],
)
def test_has_nonfinite_reads_the_bits(values: bytes, expected: bool) -> None:
    assert has_nonfinite(values) is expected


def test_the_shipper_flags_only_the_batch_with_a_nonfinite_row(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, batch_config("hint", endpoint, stats_every=0))
    assert sock.poll(WAIT_MS)
    poisoned = 6  # in the second batch (steps 5-8)
    for step in range(1, 13):
        out = model(torch.randn(3, 4)).pow(2).mean()
        out.backward()
        opt.step()
        loss = torch.tensor(math.nan) if step == poisoned else out.detach()
        # A scalar logged once: every later row holds MISSING in its column.
        mon.log(loss=loss, **({"extra": 1.0} if step == 1 else {}))
        opt.zero_grad()
    mon.close()
    batches: list[Batch] = []
    while sum(len(b.steps) for b in batches) < 12:
        assert sock.poll(WAIT_MS), "the agent sent too few steps"
        msg = decode(sock.recv_multipart())
        if isinstance(msg, Batch) and msg.schema_id != wc.STATS_SCHEMA_ID:
            batches.append(msg)
    assert [b.steps for b in batches] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    assert [b.nonfinite for b in batches] == [False, True, False]
    assert all(MISSING in b.values for b in batches)  # MISSING cells did not flag
