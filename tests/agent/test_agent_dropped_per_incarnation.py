"""The count of dropped steps travels per incarnation, so a collector adding up a job's
incarnations counts each dropped step once (a rollback after 10 dropped steps read 20)."""

from __future__ import annotations

import torch

from gradwatch.agent import Monitor
from gradwatch.wire import Batch, Heartbeat
from tests.agent.receiver import batch_config, drain, wait_connected

DROPPED = 10


def train(mon: Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()


def test_a_rollback_starts_a_fresh_count_after_the_old_incarnation_sends_its_last(pull):
    sock, endpoint = pull
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, batch_config("drops", endpoint, stats_every=0))
    seen = wait_connected(sock)
    train(mon, model, opt, 8)
    # Steps the agent could not ship, as a starved shipper counts them (none is dropped
    # here: the count is what this test is about, not how the drops come about).
    mon._counters.steps_dropped_agent += DROPPED
    old = mon.incarnation
    mon.rollback_done(4)
    train(mon, model, opt, 8)
    mon.close()
    counts: dict[str, int] = {}
    for message in [*seen, *drain(sock)]:
        if isinstance(message, Heartbeat | Batch):
            counts[message.incarnation] = max(counts.get(message.incarnation, 0), message.dropped)
    assert mon.stats.steps_dropped == DROPPED
    assert counts == {old: DROPPED, mon.incarnation: 0}
    assert sum(counts.values()) == mon.stats.steps_dropped  # what the collector adds up
