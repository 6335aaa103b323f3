"""Fault families from real bug reports and the literature, each beside a healthy twin.

Each family is a fault and a control that runs the same model and loop without
the fault, so a detector that fires on both is a false page, not a catch. Where a
family came from is cited in its function's docstring (GitHub issues of PyTorch
projects, papers). Families marked ``HELD_OUT`` were not shown to the engineers
who design the rules: they measure whether detectors derived from invariants of
healthy training generalise, so keep their descriptions out of rule-design notes.

``ALL_SCENARIOS`` is the whole suite: ``scenario_lib.SCENARIOS``, then ``FAMILIES`` (those
of ``families_loop``, ``families_freezing`` and ``families_shapes``, then the held-out ones
defined here), then ``writes.WRITES``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from scenarios.families_freezing import FREEZING_FAMILIES
from scenarios.families_loop import LOOP_FAMILIES, group_lrs
from scenarios.families_shapes import SHAPE_FAMILIES
from scenarios.runner import Ctx, Scenario
from scenarios.scenario_lib import SCENARIOS
from scenarios.training import N_IN, classify, mlp, teacher
from scenarios.writes import WRITES

# --------------------------------------------------------------------------- HELD OUT
# Not shown to rule designers: keep out of FINDINGS.md and of rule-design notes.


def _adam_eps(ctx: Ctx, eps: float) -> None:
    """Adam with eps=1.0: the update becomes ~lr*g, ~1e-5 per element; training crawls.

    tensorflow/models#779 (slim's default opt_epsilon 1.0: "weights only marginally changed
    after 10.000 steps"), balancap/SSD-Tensorflow#385, mlpnlp/mlpnlp-nmt#4. Twin: eps=1e-8.
    """
    model = mlp(depth=3)
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps), 300)


def _same_batch(ctx: Ctx, same: bool) -> None:
    """`next(iter(loader))` inside the loop with shuffle=False: the same 64 examples every
    step. Train loss collapses while validation does not. Twin: a fresh batch each step.

    leohsuofnthu/Pytorch-IterativeFCN#7 ("only one subject is used to training"),
    skhu101/GM-NAS#4, udacity/deep-learning-v2-pytorch#309.
    """
    model = mlp(depth=2, width=128)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()
    first = torch.randn(64, N_IN)
    xva = torch.randn(512, N_IN)
    yva = t(xva)
    classify(
        ctx,
        model,
        opt,
        300,
        inputs=lambda s: first if same else torch.randn(64, N_IN),
        label=t,
        eval_every=20,
        eval_fn=lambda: F.cross_entropy(model(xva), yva),
    )


def _warmup(ctx: Ctx, stuck: bool) -> None:
    """Twin: a linear warmup over 300 of 400 steps from lr exactly 0 (Hugging Face's
    get_linear_schedule_with_warmup), stepped per batch. ``stuck``: a 1,000-step warmup
    whose scheduler.step() is never called: the lr stays at its first value, 1e-6.

    rpryzant/causal-bert-pytorch#9 and Lightning-AI/pytorch-lightning#92 (where and whether
    scheduler.step() runs); HF's schedule starts at lr 0 by design.
    """
    model = mlp(depth=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if stuck:
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000))
        classify(ctx, model, opt, 400)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 300))
        classify(ctx, model, opt, 400, sched=sched)


_HELD_OUT_FAMILIES: tuple[Scenario, ...] = (
    Scenario(
        "adam_eps_too_large",
        "update_ratio",
        1,
        lambda c: _adam_eps(c, 1.0),
        also=("lr_too_low", "dead_pipeline"),
    ),
    Scenario("healthy_twin_adam_eps_default", None, 0, lambda c: _adam_eps(c, 1e-8)),
    Scenario(
        "same_batch_every_step",
        "generalization_gap",
        1,
        lambda c: _same_batch(c, True),
        also=("dead_pipeline",),
    ),
    Scenario("healthy_twin_fresh_batches", None, 0, lambda c: _same_batch(c, False)),
    Scenario(
        "warmup_scheduler_never_stepped",
        "lr_too_low",
        1,
        lambda c: _warmup(c, True),
        also=("update_ratio", "dead_pipeline"),
    ),
    Scenario("healthy_long_warmup_from_zero", None, 0, lambda c: _warmup(c, False)),
    Scenario("healthy_layerwise_lr_decay", None, 0, lambda c: group_lrs(c, 1e-3, decay=0.7)),
)

FAMILIES: tuple[Scenario, ...] = (
    LOOP_FAMILIES + FREEZING_FAMILIES + SHAPE_FAMILIES + _HELD_OUT_FAMILIES
)

# HELD OUT: these families were NOT shown to the rule designers (not in issue 13, not in
# FINDINGS.md). The suite reports them separately, as a test of generalisation.
HELD_OUT: tuple[str, ...] = (
    "adam_eps_too_large",
    "healthy_twin_adam_eps_default",
    "same_batch_every_step",
    "healthy_twin_fresh_batches",
    "warmup_scheduler_never_stepped",
    "healthy_long_warmup_from_zero",
    "healthy_layerwise_lr_decay",
)

ALL_SCENARIOS: tuple[Scenario, ...] = SCENARIOS + FAMILIES + WRITES
BY_NAME: dict[str, Scenario] = {s.name: s for s in ALL_SCENARIOS}
