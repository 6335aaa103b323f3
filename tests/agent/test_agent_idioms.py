"""The idiom matrix: common loop idioms run unchanged under the agent, which keeps reporting.

Each idiom is a small loop written the way its users write it. It runs twice
from the same seed and the same data: bare, and watched by a monitor sending
to a real PULL socket. The watched run must give bit-identical losses and
final parameters (the agent changes nothing it watches), and every step must
arrive with a finite loss and finite gradient norms for every layer. The
list of idioms here is the "works with" list in docs/agent.md.
"""

from __future__ import annotations

import copy
import io
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

import gradwatch
from tests.agent.receiver import Received, receive, wait_connected

STEPS = 6


def batch(step: int, micro: int = 0, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of (step, micro-batch): the same in every run, and after a resume."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :1] * 2.0 - x[:, 1:2]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))


class Bare:
    """What a loop sees instead of a monitor in the bare run."""

    def log(self, **kwargs: Any) -> None: ...
    def checkpoint_saved(self, step: int, path: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class Run:
    """One run of an idiom: ``watch`` makes its monitor (or a Bare one)."""

    pull: tuple[Any, str] | None
    losses: list[float] = field(default_factory=list)
    monitors: list[tuple[Any, list[Any]]] = field(default_factory=list)

    def watch(self, model: nn.Module, opt: torch.optim.Optimizer | None, **kwargs: Any) -> Any:
        if self.pull is None:
            return Bare()
        sock, endpoint = self.pull
        mon = gradwatch.watch(
            model,
            opt,
            job="idiom",
            endpoint=endpoint,
            flush_every=4,
            heartbeat_every=0.05,
            stats_every=3,
            **kwargs,
        )
        self.monitors.append((mon, wait_connected(sock)))
        return mon

    def received(self) -> list[Received]:
        assert self.pull is not None
        out = []
        for mon, seen in self.monitors:
            mon.close()
            s = mon.stats
            assert s.disabled is None and s.steps_dropped == 0 and s.events_dropped == 0, s
            out.append(receive(self.pull[0], mon, seen))
        return out


def step_loss(model: nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    x, y = batch(step, micro)
    return F.mse_loss(model(x), y)


# ------------------------------------------------------------ idioms


def plain(run: Run) -> nn.Module:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mon = run.watch(model, opt)
    for step in range(1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def accumulation(run: Run) -> nn.Module:
    """nanoGPT-style: 4 micro-batches per step, each loss divided by 4; log the step's mean."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = run.watch(model, opt)
    for step in range(1, STEPS + 1):
        total = torch.zeros(())
        for micro in range(4):
            loss = step_loss(model, step, micro) / 4
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mon.log(loss=total)
        opt.zero_grad(set_to_none=True)
        run.losses.append(total.item())
    return model


def amp_with_scaler(run: Run) -> nn.Module:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    mon = run.watch(model, opt, scaler=scaler)
    for step in range(1, STEPS + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_loss(model, step)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def amp_without_scaler(run: Run) -> nn.Module:
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = run.watch(model, opt)
    for step in range(1, STEPS + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_loss(model, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def scheduler_per_batch(run: Run) -> nn.Module:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    mon = run.watch(model, opt)
    for step in range(1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        sched.step()  # before log(): the agent still reports the rate this step used
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def scheduler_per_epoch(run: Run) -> nn.Module:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mon = run.watch(model, opt)
    step = 0
    for _epoch in range(3):
        for _ in range(STEPS // 3):
            step += 1
            loss = step_loss(model, step)
            loss.backward()
            opt.step()
            mon.log(loss=loss)
            opt.zero_grad()
            run.losses.append(loss.item())
        sched.step()
    return model


def ema_copy(run: Run) -> nn.Module:
    """An EMA copy (a deepcopy of the watched model) updated each step and evaluated."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = run.watch(model, opt)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for step in range(1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        ema.update_parameters(model)
        mon.log(loss=loss)
        opt.zero_grad()
        with torch.no_grad():
            run.losses.append(loss.item() + step_loss(ema.eval(), step).item())
    return model


def swa(run: Run) -> nn.Module:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = run.watch(model, opt)
    swa_model = AveragedModel(model)
    swa_sched = SWALR(opt, swa_lr=0.01, anneal_epochs=2)
    for step in range(1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        if step > STEPS // 2:
            swa_model.update_parameters(model)
            swa_sched.step()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def data_parallel(run: Run) -> nn.Module:
    model = net()
    wrapped = nn.DataParallel(model)  # no GPU here: it calls the module as it is
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    mon = run.watch(model, opt)  # the raw model: layer names without "module."
    for step in range(1, STEPS + 1):
        loss = step_loss(wrapped, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def recreated_optimizer(run: Run) -> nn.Module:
    """A new optimizer halfway (a new phase): the agent follows it; no step is 'skipped'."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = run.watch(model, opt)
    for step in range(1, STEPS + 1):
        if step == STEPS // 2 + 1:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
    return model


def checkpoint_mid_run(run: Run) -> nn.Module:
    """Save and reload model and optimizer state mid-run (the loop's own checkpointing)."""
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = run.watch(model, opt)
    for step in range(1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        run.losses.append(loss.item())
        if step == 3:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, buf)
            mon.checkpoint_saved(step, "ckpt/3.pt")
            buf.seek(0)
            state = torch.load(buf)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
    return model


IDIOMS: dict[str, Callable[[Run], nn.Module]] = {
    "plain SGD with momentum": plain,
    "gradient accumulation with clipping": accumulation,
    "AMP autocast with GradScaler (unscale_, clip)": amp_with_scaler,
    "AMP autocast without a scaler (bf16)": amp_without_scaler,
    "scheduler stepped per batch (OneCycleLR)": scheduler_per_batch,
    "scheduler stepped per epoch (StepLR)": scheduler_per_epoch,
    "EMA copy (AveragedModel with an EMA average)": ema_copy,
    "SWA (AveragedModel + SWALR)": swa,
    "DataParallel wrapper": data_parallel,
    "optimizer re-created mid-run": recreated_optimizer,
    "checkpoint saved and reloaded mid-run": checkpoint_mid_run,
}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_reports(got: Received, steps: list[int]) -> None:
    assert sorted(got.steps) == steps
    for step in steps:
        row = got.steps[step]
        loss = row.columns["loss"]
        assert loss is not None and math.isfinite(loss), (step, row.columns)
        assert row.columns["skipped"] == 0.0, step
        assert all(v is not None and math.isfinite(v) and v > 0 for v in row.layers), step
    assert not got.kinds("degraded")


@pytest.mark.parametrize("name", list(IDIOMS))
def test_idiom_runs_unchanged_and_keeps_reporting(name: str, pull) -> None:
    idiom = IDIOMS[name]
    bare = Run(None)
    bare_model = idiom(bare)
    watched = Run(pull)
    watched_model = idiom(watched)
    assert watched.losses == bare.losses  # bit for bit: the agent changed nothing
    for key, value in state(bare_model).items():
        assert torch.equal(state(watched_model)[key], value), key
    [got] = watched.received()
    assert got.layers == ("0.weight", "0.bias", "3.weight", "3.bias")
    assert_reports(got, list(range(1, STEPS + 1)))
    if name.startswith("scheduler stepped per batch"):
        lrs = [got.steps[s].columns["lr/0"] for s in range(1, STEPS + 1)]
        sched = torch.optim.lr_scheduler.OneCycleLR(
            torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01), max_lr=0.1, total_steps=STEPS
        )
        expected = []
        for _ in range(STEPS):
            expected.append(sched.get_last_lr()[0])
            sched.optimizer.step()
            sched.step()
        assert lrs == pytest.approx(expected, rel=1e-6)
    if name.startswith("checkpoint"):
        [event] = got.kinds("checkpoint")
        assert event.step == 3 and event.fields["path"] == "ckpt/3.pt"


def test_resume_from_a_checkpoint_continues_the_step_numbers(pull) -> None:
    """A restarted process loads the step-3 checkpoint and continues at step 4, with the
    same numbers as the uninterrupted run (the data is a function of the step)."""
    first = Run(pull)
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = first.watch(model, opt)
    saved = io.BytesIO()
    for step in range(1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        first.losses.append(loss.item())
        if step == 3:
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": 3,
                    "rng": torch.get_rng_state(),
                },
                saved,
            )  # Dropout's, as resumes do
            mon.checkpoint_saved(3, "ckpt/3.pt")
    [before] = first.received()
    saved.seek(0)
    ckpt = torch.load(saved)
    resumed = Run(pull)
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    torch.set_rng_state(ckpt["rng"])
    mon = resumed.watch(model, opt, start_step=ckpt["step"] + 1)
    for step in range(ckpt["step"] + 1, STEPS + 1):
        loss = step_loss(model, step)
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        resumed.losses.append(loss.item())
    [after] = resumed.received()
    assert resumed.losses == first.losses[3:]
    assert_reports(before, list(range(1, STEPS + 1)))
    assert_reports(after, [4, 5, 6])
    assert [after.steps[s].columns["loss"] for s in (4, 5, 6)] == pytest.approx(
        [before.steps[s].columns["loss"] for s in (4, 5, 6)], rel=1e-6
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("pass_wrapper", [False, True], ids=["ddp.module", "ddp"])
def test_ddp_world_1_on_gloo(pull, pass_wrapper: bool) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        runs = []
        for watched in (False, True):
            run = Run(pull if watched else None)
            model = net()
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            mon = run.watch(ddp if pass_wrapper else ddp.module, opt)
            for step in range(1, STEPS + 1):
                loss = step_loss(ddp, step)
                loss.backward()
                opt.step()
                mon.log(loss=loss)
                opt.zero_grad()
                run.losses.append(loss.item())
            runs.append(run)
        assert runs[0].losses == runs[1].losses
        [got] = runs[1].received()
    finally:
        dist.destroy_process_group()
    prefix = "module." if pass_wrapper else ""
    assert got.layers[0] == prefix + "0.weight"
    assert_reports(got, list(range(1, STEPS + 1)))


def test_a_copy_made_while_watched_is_not_watched(pull) -> None:
    """An EMA made with copy.deepcopy of the watched model steps its own optimizer:
    the agent neither follows it nor counts its forwards."""
    run = Run(pull)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = run.watch(model, opt)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    for step in range(1, STEPS + 1):
        for m, o in ((model, opt), (twin, twin_opt)):
            step_loss(m, step).backward()
            o.step()
            o.zero_grad()
        mon.log(loss=1.0)
    [got] = run.received()
    assert_reports(got, list(range(1, STEPS + 1)))
