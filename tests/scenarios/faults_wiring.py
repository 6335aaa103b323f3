"""The base suite's faults in how the loop or the model is set up: nothing trains (a frozen
or dead pipeline), overfitting, eval-mode wiring, weights running away, fp16 overflow, a
hung step, saturated or dead activations, and the seed's worked example.

Part of ``scenario_lib.SCENARIOS``, after ``faults_numeric``'s faults. Split by theme so
each module reads on its own.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.runner import Ctx, Scenario
from scenarios.training import (
    N_CLS,
    N_IN,
    classify,
    classify_fp16,
    mlp,
    seed_worked_example,
    teacher,
)


def _frozen_zero_grad_before_step(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # zero_grad() between backward and step: every update is zero
    classify(ctx, model, opt, 300, after_backward=lambda s: opt.zero_grad())


def _frozen_requires_grad_off(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for p in list(model.parameters())[:-2]:
        p.requires_grad_(False)  # "freeze the backbone" forgotten on
    classify(ctx, model, opt, 300)


def _lr_zero(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # scheduler bug: lr multiplied by 0
    classify(ctx, model, opt, 300)


def _detached_graph(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bias = nn.Parameter(torch.zeros(N_CLS))  # the only parameter still in the graph
    opt.add_param_group({"params": [bias]})

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        return F.cross_entropy(out.detach() + bias * 0, y)

    classify(ctx, model, opt, 300, loss_fn=loss_fn)


def _constant_inputs(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    classify(
        ctx,
        model,
        opt,
        400,
        inputs=lambda s: torch.zeros(64, N_IN),
        label=lambda x: torch.randint(0, N_CLS, (len(x),), generator=g),
    )


def _shuffled_labels(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(4)
    classify(ctx, model, opt, 400, label=lambda x: torch.randint(0, N_CLS, (len(x),), generator=g))


def _missing_optimizer_step(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 300, do_step=lambda s: False)


def _overfit(ctx: Ctx, n_train: int = 32, noise: float = 0.0) -> None:
    model = mlp(depth=2, width=128)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()
    xtr, xva = torch.randn(n_train, N_IN), torch.randn(512, N_IN)
    ytr, yva = t(xtr), t(xva)
    if noise:
        flip = torch.rand(n_train) < noise
        ytr[flip] = torch.randint(0, N_CLS, (int(flip.sum()),))
    classify(
        ctx,
        model,
        opt,
        400,
        inputs=lambda s: xtr,
        label=lambda x: ytr,
        eval_every=20,
        eval_fn=lambda: F.cross_entropy(model(xva), yva),
    )


def _eval_train_mode(ctx: Ctx, bn: bool, dropout: float) -> None:
    model = mlp(bn=bn, dropout=dropout)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()
    xva = torch.randn(256, N_IN)
    # forgot model.eval() before validation (and model.train() after)
    classify(
        ctx, model, opt, 100, eval_every=20, eval_fn=lambda: F.cross_entropy(model(xva), t(xva))
    )


def _weight_runaway(ctx: Ctx, in_loss: bool) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    if in_loss:  # an L2 penalty added with the wrong sign

        def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
            return F.cross_entropy(out, y) - 0.2 * sum((p * p).sum() for p in params)

        classify(ctx, model, opt, 200, loss_fn=loss_fn)
    else:  # hand-written decoupled weight decay with the wrong sign

        def decay(step: int) -> None:
            with torch.no_grad():
                for p in params:
                    p.grad.add_(p, alpha=-0.4)

        classify(ctx, model, opt, 200, after_backward=decay)


def _amp_overflow_storm(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify_fp16(ctx, model, opt, 300, scale_from=100)  # fp16 activations overflow


def _hung_step(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = classify(ctx, model, opt, 100, heartbeat_every=0.1)
    ctx.drain(mon)  # every step is in; the loop now "hangs" with heartbeats running
    for _ in range(3):
        ctx.advance_clock(200.0)  # 600 s of injected time, no step
        before = ctx.server.messages_handled
        ctx.server.wait_for_messages(before + 1, timeout=2.0)  # a heartbeat at the new time
        ctx.server.tick()


def _saturated_tanh(ctx: Ctx) -> None:
    model = mlp(depth=4, width=64, act=nn.Tanh)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.mul_(8.0)  # init far too large: tanh pinned at +-1
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    classify(ctx, model, opt, 200)


def _saturated_sigmoid_inputs(ctx: Ctx) -> None:
    model = mlp(depth=3, width=64, act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 200, inputs=lambda s: torch.randn(64, N_IN) * 50)


def _dead_relu_bias(ctx: Ctx) -> None:
    model = mlp(depth=3, width=64)
    with torch.no_grad():
        for m in list(model)[:-1]:
            if isinstance(m, nn.Linear):
                m.bias.fill_(-6.0)  # a bad bias init: nearly every ReLU outputs 0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 200)


def _bf16_updates_rounded_away(ctx: Ctx) -> None:
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)  # every update below bf16's precision
    classify(
        ctx,
        model,
        opt,
        300,
        inputs=lambda s: torch.randn(64, N_IN, dtype=torch.bfloat16),
        label=lambda x: teacher()(x.float()),
        loss_fn=lambda o, y, s: F.cross_entropy(o.float(), y),
    )


ACT = "gradwatch.agent.activations"  # the agent's activation statistics (saturation, dead units)
PARTIAL_FREEZE = (
    "a backbone frozen with requires_grad_(False) before watch(): the census "
    "counts it (params_frozen) but no rule pages on it, since a deliberate "
    "head-only fine-tune (families.healthy_head_only_finetune) looks the same "
    "except that its optimizer does not hold the frozen parameters"
)

WIRING_FAULTS: tuple[Scenario, ...] = (
    # dead pipeline / frozen
    Scenario(
        "frozen_zero_grad_before_step",
        "dead_pipeline",
        1,
        _frozen_zero_grad_before_step,
        also=("update_ratio", "vanishing_gradients"),
    ),
    Scenario(
        "frozen_backbone_requires_grad_off",
        "update_ratio",
        1,
        _frozen_requires_grad_off,
        also=("dead_pipeline",),
        needs=PARTIAL_FREEZE,
    ),
    Scenario(
        "bf16_updates_rounded_away",
        "update_ratio",
        1,
        _bf16_updates_rounded_away,
        also=("dead_pipeline",),
    ),
    Scenario("lr_zero", "dead_pipeline", 1, _lr_zero, also=("update_ratio",)),
    Scenario(
        "detached_graph",
        "dead_pipeline",
        1,
        _detached_graph,
        also=("vanishing_gradients", "update_ratio"),
    ),
    Scenario("constant_inputs", "dead_pipeline", 1, _constant_inputs),
    Scenario("shuffled_labels", "dead_pipeline", 1, _shuffled_labels),
    Scenario(
        "missing_optimizer_step",
        "dead_pipeline",
        1,
        _missing_optimizer_step,
        also=("update_ratio",),
    ),
    # generalization
    Scenario("overfit_32_samples", "generalization_gap", 1, lambda c: _overfit(c, 32)),
    Scenario("overfit_noisy_labels", "generalization_gap", 1, lambda c: _overfit(c, 64, noise=0.3)),
    # eval wiring
    Scenario(
        "eval_batchnorm_train_mode",
        "eval_mode_wiring",
        20,
        lambda c: _eval_train_mode(c, bn=True, dropout=0.0),
    ),
    Scenario(
        "eval_dropout_train_mode",
        "eval_mode_wiring",
        20,
        lambda c: _eval_train_mode(c, bn=False, dropout=0.3),
    ),
    # weights
    Scenario(
        "negative_weight_decay", "weight_runaway", 1, lambda c: _weight_runaway(c, in_loss=False)
    ),
    Scenario(
        "negative_l2_penalty_in_loss",
        "weight_runaway",
        1,
        lambda c: _weight_runaway(c, in_loss=True),
    ),
    # AMP
    Scenario("amp_fp16_overflow_storm", "loss_scale_collapse", 100, _amp_overflow_storm),
    # liveness
    Scenario("hung_step_heartbeats_continue", "stalled", 100, _hung_step),
    # activations
    Scenario("tanh_saturated_init", "saturation", 1, _saturated_tanh, requires=ACT),
    Scenario("sigmoid_saturated_inputs", "saturation", 1, _saturated_sigmoid_inputs, requires=ACT),
    Scenario("dead_relu_bias_init", "dead_units", 1, _dead_relu_bias, requires=ACT),
    # the seed's worked example, run for real (README: what actually happens)
    Scenario(
        "seed_example_xavier_x10",
        "saturation",
        1,
        lambda c: seed_worked_example(c, init_scale=10.0),
        requires=ACT,
    ),
)
