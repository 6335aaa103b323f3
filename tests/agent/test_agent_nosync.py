"""The training thread never reads a device value on the host.

On CPU there is no device to wait for, so the check is structural: every
tensor method that would synchronise with a device (``item``, ``cpu``,
``tolist``, ``numpy``, ``__float__``/``__int__``/``__bool__``/``__index__``)
and ``GradScaler.get_scale`` are wrapped with a detector that records calls
made on the training thread from inside a gradwatch module. The shipper
thread may read freely; so may the user's own code (the optimizer, the
scaler). ``benchmarks/cuda_sync_check.py`` is the same check on a GPU.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent import monitor as monitor_module
from gradwatch.agent.cadence import Cadence

SYNCING = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


def _gradwatch_frame() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "gradwatch" or name.startswith("gradwatch."):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


class SyncDetector:
    def __init__(self, thread_id: int) -> None:
        self.thread_id = thread_id
        self.calls: list[tuple[str, str]] = []

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def detecting(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self.thread_id:
                where = _gradwatch_frame()
                if where is not None:
                    self.calls.append((name, where))
            return original(*args, **kwargs)

        return detecting


@pytest.fixture
def detector(monkeypatch: pytest.MonkeyPatch) -> SyncDetector:
    found = SyncDetector(threading.get_ident())
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, found.wrap(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(
        torch.amp.GradScaler,
        "get_scale",
        found.wrap("GradScaler.get_scale", torch.amp.GradScaler.get_scale),
    )
    return found


@pytest.fixture
def endpoint() -> Iterator[str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


def cadence_steps(stats_every: int, steps: int) -> int:
    cadence = Cadence(stats_every)
    return sum(cadence.due(s) for s in range(1, steps + 1))


def run_loop(
    endpoint: str, steps: int = 40, stats_every: int = 10, phase_clock: bool | None = None
) -> gradwatch.Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Dropout(0.0),
        nn.Linear(32, 4),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)
    mon = gradwatch.watch(
        model,
        opt,
        job="nosync",
        endpoint=endpoint,
        flush_every=4,
        scaler=scaler,
        heartbeat_every=0.05,
        stats_every=stats_every,
        phase_clock=phase_clock,
    )
    for i in range(steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        scaler.scale(loss).backward()
        if i == 7:  # an overflow: GradScaler skips this optimizer step
            opt.param_groups[0]["params"][0].grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        mon.log(loss=loss, grad_norm=grad_norm, tokens=8 * 16, warm=torch.tensor(i < 5))
        opt.zero_grad()
        if i % 10 == 9:
            mon.log_eval(loss=loss.detach() * 2)
    mon.checkpoint_saved(steps, "ckpt.pt")
    mon.close()
    return mon


# The phase clock's forward hooks (on by default where several ranks run, off in one
# process) and the initial weight read each path makes: at the first forward, or the
# first gradient read.
@pytest.mark.parametrize("phase_clock", [False, True], ids=["one-process", "phase-clock"])
def test_monitored_loop_makes_no_syncing_call_on_the_training_thread(
    detector, endpoint, phase_clock
):
    mon = run_loop(endpoint, phase_clock=phase_clock)
    assert detector.calls == []
    assert mon.stats.steps_logged == 40
    assert mon.stats.disabled is None
    assert mon.stats.steps_dropped + mon.stats.steps_sent == 40
    assert mon.stats.stats_dropped + mon.stats.stats_sent == cadence_steps(10, 40)  # they ran


def test_cadence_steps_with_activation_hooks_make_no_syncing_call(detector, endpoint, monkeypatch):
    from gradwatch.agent import activations

    measured: list[int] = []  # which module's row each hook wrote
    original = activations.measure

    def counting(
        y: torch.Tensor, row: tuple[torch.Tensor, torch.Tensor], pre: str | None = None
    ) -> None:
        measured.append(row[0].storage_offset())
        original(y, row, pre)

    monkeypatch.setattr(activations, "measure", counting)
    mon = run_loop(endpoint, steps=12, stats_every=2)  # most steps hook the forward
    assert detector.calls == []
    assert mon.stats.disabled is None
    n = cadence_steps(2, 12)
    # The hooks really ran, both modules (two rows) on every cadence step.
    assert len(measured) == 2 * n and measured[:2] * n == measured and measured[0] != measured[1]
    assert mon.stats.stats_dropped + mon.stats.stats_sent == n


def test_detector_catches_a_deliberate_item(detector, endpoint, monkeypatch):
    original = monitor_module.Monitor._commit

    def leaky_commit(self: Any, scalars: dict[str, Any], skipped: float) -> None:
        for value in scalars.values():
            if isinstance(value, torch.Tensor):
                value.item()  # the kind of call the agent must never make
        original(self, scalars, skipped)

    monkeypatch.setattr(monitor_module.Monitor, "_commit", leaky_commit)
    run_loop(endpoint, steps=3)
    assert ("item",) == detector.calls[0][:1]
    assert "gradwatch.agent.monitor" in detector.calls[0][1]
