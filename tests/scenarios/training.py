"""What the scenarios train: a teacher task, small MLPs, and the loops that inject faults.

Shared by every scenario module (the base suite, the families, ``writes``). Separate from
the harness (``runner``): these are about the model and the data, not about the collector
a run ships to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradwatch import seed_example
from scenarios.runner import Ctx

N_IN, N_CLS = 16, 4


def teacher(seed: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(N_IN, 32, generator=g), torch.randn(32, N_CLS, generator=g)
    return lambda x: (torch.tanh(x @ w1) @ w2).argmax(1)


def mlp(
    depth: int = 2,
    width: int = 32,
    act: type[nn.Module] = nn.ReLU,
    n_in: int = N_IN,
    n_out: int = N_CLS,
    bn: bool = False,
    dropout: float = 0.0,
) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = n_in
    for _ in range(depth):
        layers.append(nn.Linear(d, width))
        if bn:
            layers.append(nn.BatchNorm1d(width))
        layers.append(act())
        if dropout:
            layers.append(nn.Dropout(dropout))
        d = width
    layers.append(nn.Linear(d, n_out))
    return nn.Sequential(*layers)


def classify(
    ctx: Ctx,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    batch: int = 64,
    label: Callable[[torch.Tensor], torch.Tensor] | None = None,
    inputs: Callable[[int], torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    before_step: Callable[[int], None] | None = None,
    after_backward: Callable[[int], None] | None = None,
    do_step: Callable[[int], bool] | None = None,
    eval_every: int = 0,
    eval_fn: Callable[[], torch.Tensor] | None = None,
    sched: Any = None,
    data_change_at: int | None = None,
    **watch_kw: Any,
) -> Any:
    """One plain classification loop; the hooks inject each fault at its step.

    ``data_change_at``: the loop announces a planned data change before that step.
    """
    label = label or teacher()
    mon = ctx.watch(model, opt, **watch_kw)
    for step in range(1, steps + 1):
        if step == data_change_at:
            mon.data_changed("switched to a new task")
        if before_step:
            before_step(step)
        x = inputs(step) if inputs else torch.randn(batch, N_IN)
        y = label(x)
        out = model(x)
        loss = loss_fn(out, y, step) if loss_fn else F.cross_entropy(out, y)
        loss.backward()
        if after_backward:
            after_backward(step)
        if do_step is None or do_step(step):
            opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if eval_every and step % eval_every == 0 and eval_fn is not None:
            with torch.no_grad():
                mon.log_eval(loss=eval_fn())
    return mon


def classify_fp16(
    ctx: Ctx,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    scale_from: int | None = None,
) -> None:
    """The classification loop under fp16 autocast with a ``GradScaler`` (on CPU); from step
    ``scale_from`` the inputs are x1e5, an unnormalised shard whose activations overflow."""
    scaler = torch.amp.GradScaler("cpu")
    t = teacher()
    mon = ctx.watch(model, opt, scaler=scaler)
    for step in range(1, steps + 1):
        x = torch.randn(64, N_IN)
        if scale_from is not None and step >= scale_from:
            x = x * 1e5
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), t(x))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        mon.log(loss=loss)
        opt.zero_grad()


def least_squares(
    ctx: Ctx,
    steps: int,
    lr: Callable[[int], float],
    *,
    sign: float = 1.0,
    noise: float = 0.1,
    batch: int = 64,
    **watch_kw: Any,
) -> Any:
    """SGD on least squares: stable only for lr < 2/lambda_max(H) (about 0.6 here)."""
    feats = torch.randn(512, 32)
    targets = feats @ torch.randn(32, 1) + noise * torch.randn(512, 1)
    model = nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr(1))
    mon = ctx.watch(model, opt, **watch_kw)
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr(step)
        idx = torch.randint(0, 512, (batch,))
        loss = sign * F.mse_loss(model(feats[idx]), targets[idx])
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    return mon


def seed_worked_example(
    ctx: Ctx | None, init_scale: float, full_steps: int = 300, **watch_kw: Any
) -> list[float]:
    """The seed's worked example (``gradwatch.seed_example``), watched through ``ctx``."""
    x, y = seed_example.tabular()
    watch = (lambda model, opt: ctx.watch(model, opt, **watch_kw)) if ctx is not None else None
    return seed_example.run(seed_example.seed_model(init_scale), x, y, watch, full_steps=full_steps)
