"""The base fault suite, ``SCENARIOS``: the faults of ``faults_numeric`` and ``faults_wiring``,
then the healthy controls defined here, which must raise nothing (or only what they allow).

Also the suite's one import point: the harness (``runner``) and the training helpers
(``training``) are re-exported, so ``from scenarios.scenario_lib import run_scenario``
works for the tests and benchmarks. ``families.ALL_SCENARIOS`` adds the fault families.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.faults_numeric import NUMERIC_FAULTS
from scenarios.faults_wiring import ACT, PARTIAL_FREEZE, WIRING_FAULTS
from scenarios.runner import (
    DRAIN_TIMEOUT_S,
    SEVERITY_RANK,
    CaptureSink,
    Ctx,
    Fired,
    Result,
    Scenario,
    run_scenario,
    score,
)
from scenarios.training import (
    N_CLS,
    N_IN,
    classify,
    classify_fp16,
    least_squares,
    mlp,
    seed_worked_example,
    teacher,
)

__all__ = [
    "ACT",
    "BY_NAME",
    "DRAIN_TIMEOUT_S",
    "N_CLS",
    "N_IN",
    "PARTIAL_FREEZE",
    "SCENARIOS",
    "SEVERITY_RANK",
    "CaptureSink",
    "Ctx",
    "Fired",
    "Result",
    "Scenario",
    "classify",
    "least_squares",
    "mlp",
    "run_scenario",
    "score",
    "seed_worked_example",
    "teacher",
]

# --------------------------------------------------------------------------- controls


def _healthy_sgd(ctx: Ctx) -> None:
    model = mlp()
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 400)


def _healthy_adam(ctx: Ctx) -> None:
    model = mlp(depth=3)
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), 400)


def _converged_flat_tail(ctx: Ctx) -> None:
    least_squares(ctx, 600, lambda s: 0.1, noise=0.05)


def _many_inactive_relus(ctx: Ctx) -> None:
    model = mlp(depth=1, width=256)
    with torch.no_grad():
        model[0].bias.fill_(-0.6)  # ~85% of ReLU outputs are zero; the rest learn fine
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 400)


def _noisy_small_batch(ctx: Ctx) -> None:
    model = mlp()
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.02), 500, batch=2)


def _dataset_shift(ctx: Ctx) -> None:
    model = mlp()
    t = teacher()
    # the same task on a new input distribution from step 250 (a second data source)
    classify(
        ctx,
        model,
        torch.optim.Adam(model.parameters(), lr=2e-3),
        500,
        inputs=lambda s: (
            torch.randn(64, N_IN) * (1.0 if s < 250 else 1.3) + (0.0 if s < 250 else 0.3)
        ),
        label=t,
    )


def _task_switch(ctx: Ctx, announced: bool = True) -> None:
    model = mlp()
    t1, t2 = teacher(1), teacher(2)
    box = [0]
    classify(
        ctx,
        model,
        torch.optim.Adam(model.parameters(), lr=2e-3),
        500,
        label=lambda x: t1(x) if box[0] < 250 else t2(x),
        before_step=lambda s: box.__setitem__(0, s),
        data_change_at=250 if announced else None,
    )


def _warmup_cosine(ctx: Ctx) -> None:
    model = mlp(depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps, warm = 500, 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warm
            if s < warm
            else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
        ),
    )
    classify(ctx, model, opt, steps, sched=sched)


def _step_decay(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    classify(ctx, model, opt, 400, sched=torch.optim.lr_scheduler.StepLR(opt, 150, 0.1))


def _amp_healthy(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    classify_fp16(ctx, model, opt, 300)


def _healthy_eval_bn(ctx: Ctx) -> None:
    model = mlp(bn=True, dropout=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    t = teacher()
    xva = torch.randn(512, N_IN)
    yva = t(xva)
    mon = ctx.watch(model, opt)
    for step in range(1, 401):
        x = torch.randn(64, N_IN)
        loss = F.cross_entropy(model(x), t(x))
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        if step % 25 == 0:
            model.eval()
            with torch.no_grad():
                mon.log_eval(loss=F.cross_entropy(model(xva), yva))
            model.train()


def _healthy_residual_deep(ctx: Ctx) -> None:
    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(N_IN, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))
            self.out = nn.Linear(32, N_CLS)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = h + 0.5 * F.relu(b(h))
            return self.out(h)

    model = Res()
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), 400)


def _healthy_tanh(ctx: Ctx) -> None:
    model = mlp(depth=3, act=nn.Tanh)
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 400)


def _healthy_weight_decay_long(ctx: Ctx) -> None:
    model = mlp(width=64)
    classify(ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05), 800)


CONTROLS: tuple[Scenario, ...] = (
    Scenario("healthy_sgd_momentum", None, 0, _healthy_sgd),
    Scenario("healthy_adam", None, 0, _healthy_adam),
    Scenario("healthy_converged_flat_tail", None, 0, _converged_flat_tail),
    Scenario("healthy_many_inactive_relus", None, 0, _many_inactive_relus),
    Scenario("healthy_noisy_batch_of_2", None, 0, _noisy_small_batch),
    Scenario("healthy_dataset_shift_midrun", None, 0, _dataset_shift),
    Scenario("healthy_task_switch_announced", None, 0, _task_switch),
    # Unannounced, the jump is worth a note (LossLevelShift, info: "call mon.data_changed()"),
    # never a page: the run learns the new task (the loss falls steadily, gradients calm).
    Scenario(
        "healthy_task_switch_unannounced",
        None,
        0,
        lambda c: _task_switch(c, announced=False),
        allow="info",
    ),
    Scenario(
        "healthy_seed_example_fixed_init", None, 0, lambda c: seed_worked_example(c, init_scale=1.0)
    ),
    Scenario("healthy_warmup_cosine", None, 0, _warmup_cosine),
    Scenario("healthy_step_decay", None, 0, _step_decay),
    Scenario("healthy_amp_fp16", None, 0, _amp_healthy),
    Scenario("healthy_eval_bn_dropout", None, 0, _healthy_eval_bn),
    Scenario("healthy_residual_deep", None, 0, _healthy_residual_deep),
    Scenario("healthy_tanh", None, 0, _healthy_tanh),
    Scenario("healthy_adamw_long", None, 0, _healthy_weight_decay_long),
)

SCENARIOS: tuple[Scenario, ...] = NUMERIC_FAULTS + WIRING_FAULTS + CONTROLS

BY_NAME = {s.name: s for s in SCENARIOS}
