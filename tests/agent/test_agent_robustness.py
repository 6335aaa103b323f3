"""Instrumentation must never hurt training: no collector, internal errors, bad input."""

from __future__ import annotations

import logging
import tracemalloc

import pytest
import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent import NoLayersError
from gradwatch.agent import buffer as buffer_module
from gradwatch.agent import gradients as gradients_module
from gradwatch.agent import shipper as shipper_module


def free_endpoint() -> str:
    """A loopback address nothing listens on (bound once, then released)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    ctx.term()
    return f"tcp://127.0.0.1:{port}"


def tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, mon: gradwatch.Monitor, steps: int) -> None:
    x = torch.randn(4, 4)
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith("gradwatch") and r.levelno >= logging.ERROR
    ]


def test_absent_collector_never_blocks_and_memory_stays_bounded():
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="absent", endpoint=free_endpoint())
    pool_size = mon.config.pool_size
    train(model, opt, mon, 100)  # allocations that happen once are done by now
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        x = torch.randn(4, 4)
        for _ in range(2000):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            mon.log(loss=loss, grad_norm=loss.detach())
            opt.zero_grad()
            assert mon._work.qsize() <= mon._work.maxsize
            assert mon._buffer.pool.qsize() <= pool_size
        mon.log_eval(loss=1.0)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mon.close()
    assert after - before < 3 * 2**20
    assert mon._buffer.host_buffers_made == pool_size  # the pool never grew
    assert mon._work.maxsize == pool_size + mon.config.max_pending_events
    stats = mon.stats
    assert stats.steps_logged == 2100
    assert stats.steps_sent == 0 and stats.batches_sent == 0
    assert stats.steps_dropped == 2100  # every step accounted for as dropped
    assert stats.disabled is None
    assert not mon._shipper.alive


def test_encoder_failure_switches_off_once_without_raising(caplog, monkeypatch):
    def boom(batch: object) -> list[bytes]:
        raise RuntimeError("encoder exploded")

    monkeypatch.setattr(shipper_module, "encode_batch", boom)
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="enc", endpoint=free_endpoint(), flush_every=5)
    train(model, opt, mon, 50)
    mon.close()
    train(model, opt, mon, 5)  # after close and failure, still harmless
    assert len(errors(caplog)) == 1
    assert "encoder exploded" in errors(caplog)[0].getMessage()
    assert "switched off" in errors(caplog)[0].getMessage()
    assert mon.stats.disabled is not None and "encoder exploded" in mon.stats.disabled
    assert not opt._optimizer_step_pre_hooks  # hooks removed
    assert not mon._shipper.alive


def test_hook_failure_switches_off_once_and_removes_the_hook(caplog, monkeypatch):
    def broken(self: object, *row: torch.Tensor) -> None:
        raise IndexError("no such row")

    monkeypatch.setattr(gradients_module.GradReader, "read_into", broken)
    # The CPU read's own entry (the norms stacked later, on the shipper) breaks too.
    monkeypatch.setattr(gradients_module.GradReader, "norms", broken)
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="hook", endpoint=free_endpoint())
    train(model, opt, mon, 20)
    assert not opt._optimizer_step_pre_hooks
    mon.close()
    assert len(errors(caplog)) == 1
    assert "pre-hook" in errors(caplog)[0].getMessage()
    assert mon.stats.steps_logged == 0
    assert "no such row" in mon.stats.disabled


def test_hook_failure_never_raises_into_the_loop_when_another_hook_follows(caplog, monkeypatch):
    # torch iterates its pre-hook dict while ours runs: removing our entry there would
    # raise "OrderedDict mutated during iteration" into optimizer.step().
    def broken(self: object, *row: torch.Tensor) -> None:
        raise IndexError("no such row")

    monkeypatch.setattr(gradients_module.GradReader, "read_into", broken)
    # The CPU read's own entry (the norms stacked later, on the shipper) breaks too.
    monkeypatch.setattr(gradients_module.GradReader, "norms", broken)
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="hook", endpoint=free_endpoint())
    later: list[int] = []
    opt.register_step_pre_hook(lambda o, a, k: later.append(1))
    train(model, opt, mon, 5)  # raises if the hook dict is mutated mid-iteration
    assert len(later) == 5  # the user's own hook ran on every step
    assert len(opt._optimizer_step_pre_hooks) == 1  # ours is gone, theirs stays
    mon.close()
    assert len(errors(caplog)) == 1


def test_log_failure_switches_off_once(caplog, monkeypatch):
    def broken(self: object, *args: object) -> None:
        raise ValueError("bad row")

    monkeypatch.setattr(buffer_module.StepBuffer, "commit", broken)
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="log", endpoint=free_endpoint())
    train(model, opt, mon, 10)
    mon.close()
    assert len(errors(caplog)) == 1
    assert "Monitor.log" in mon.stats.disabled


def test_enabled_false_is_a_no_op():
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="off", enabled=False)
    train(model, opt, mon, 3)
    mon.log_eval(loss=1.0)
    mon.checkpoint_saved(3, "x.pt")
    mon.close()
    assert not opt._optimizer_step_pre_hooks
    assert mon.stats.steps_logged == 0
    assert "enabled=False" in mon.stats.disabled


def test_bad_scalars_warn_once_and_keep_monitoring(caplog):
    model, opt = tiny()
    mon = gradwatch.watch(model, opt, job="bad", endpoint=free_endpoint())
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        mon.log(loss=1.0, note="text", vec=torch.ones(2))
        mon.log_eval(obj=object())
    mon.checkpoint_saved(torch.tensor(3), "x.pt")
    mon.close()
    warnings = [r for r in caplog.records if r.name.startswith("gradwatch")]
    assert len(warnings) == 4  # note, vec, eval obj, checkpoint step: once each
    assert mon.stats.disabled is None and mon.stats.steps_logged == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"job": ""}, "job must be"),
        ({"job": "j", "endpoint": "localhost:5555"}, "endpoint must be"),
        ({"job": "j", "endpoint": "tcp://no host:x"}, "cannot connect"),
        ({"job": "j", "rank": 3, "world": 2}, "rank 3 / world 2"),
        ({"job": "j", "flush_every": 0}, "flush_every"),
    ],
)
def test_bad_arguments_fail_at_watch_with_a_clear_message(kwargs, message):
    model, opt = tiny()
    with pytest.raises(ValueError, match=message):
        gradwatch.watch(model, opt, **kwargs)


def test_optimizer_of_another_model_is_rejected():
    model, _ = tiny()
    _, other_opt = tiny()
    with pytest.raises(NoLayersError, match="none of the model's trainable parameters"):
        gradwatch.watch(model, other_opt, job="j")


def test_rank_and_world_come_from_the_environment(monkeypatch):
    from gradwatch.agent.config import resolve_rank_world

    assert resolve_rank_world(None, None, env={}) == (0, 1)
    assert resolve_rank_world(None, None, env={"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    assert resolve_rank_world(1, None, env={"WORLD_SIZE": "4"}) == (1, 4)
    with pytest.raises(ValueError, match="RANK='x'"):
        resolve_rank_world(None, None, env={"RANK": "x"})
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    model, opt = tiny()
    with gradwatch.watch(model, opt, job="env", endpoint=free_endpoint()) as mon:
        assert (mon.config.rank, mon.config.world) == (2, 4)
