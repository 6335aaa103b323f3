"""Fault families written into the training loop's own code, each beside its healthy twin.

One corrupt batch, an epoch scheduler stepped per batch, per-group learning rates, a
summed validation loss, labels misaligned with their inputs, an output detached from the
graph, eval mode left on after validation. The first part of ``families.FAMILIES`` (see
``families`` for what a family and its twin are), split from it by theme.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.runner import Ctx, Scenario
from scenarios.training import N_IN, classify, mlp, teacher

# --------------------------------------------------------------------------- one corrupt batch


def _corrupt_batch(ctx: Ctx, corrupt: bool) -> None:
    """One corrupt batch: loss x~1000 and grad norm x~700 for a single step, then recovery.

    A record with unscaled features (raw pixels or bytes read as floats) in one batch.
    Practice: PaLM (Chowdhery et al. 2022, sec. 5.1) and OLMo skip the batches around a
    spike; metaseq#521/#542 added `max_loss_to_skip_batch`; mistral#115 ("bad batches").
    """
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()

    def inputs(step: int) -> torch.Tensor:
        x = torch.randn(64, N_IN)
        return x * 1000.0 if corrupt and step == 200 else x

    classify(ctx, model, opt, 300, inputs=inputs, label=lambda x: t(x / x.abs().max()))


# --------------------------------------------------------------------------- lr scheduler units


def _scheduler_units(ctx: Ctx, per_batch: bool) -> None:
    """An epoch scheduler stepped per batch: StepLR(30, 0.1) takes Adam's 3e-3
    to 3e-7 by step 120.

    pytorch/vision#1261 and #8629 (detection reference), ivadomed#55 ("Scheduler was
    incorrectly stepped in the batch loop instead of in the epoch loop"), pytorch#3814.
    The loss stops improving while still far above what the model reaches.
    """
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    epoch = 100  # batches per epoch

    def before(step: int) -> None:
        if step > 1 and (per_batch or (step - 1) % epoch == 0):
            sched.step()

    classify(ctx, model, opt, 400, before_step=before)


# --------------------------------------------------------------------------- per-group lr typo


# Public: families.py's held-out layer-wise decay control runs it too.
def group_lrs(ctx: Ctx, hidden_lr: float, decay: float = 1.0) -> None:
    """Hidden layers updated ~100x slower than the head: a fine-tuning lr kept for scratch.

    Discriminative learning rates (ULMFiT, Howard & Ruder 2018) copied into training from
    scratch with the backbone group at lr*0.01. ``decay`` instead gives layer-wise lr
    decay (a healthy practice, ratios within a few x of each other).
    """
    model = mlp(depth=4, width=32)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    head = linears[-1]
    groups = [{"params": list(head.parameters()), "lr": 1e-3}]
    for i, layer in enumerate(reversed(linears[:-1]), start=1):
        groups.append({"params": list(layer.parameters()), "lr": hidden_lr * (decay**i)})
    classify(ctx, model, torch.optim.Adam(groups), 300)


# --------------------------------------------------------------------------- val loss summed


def _val_loss_reduction(ctx: Ctx, summed: bool) -> None:
    """Validation loss summed over 20 batches, never divided: 20x the training loss, falling.

    udacity/deep-learning-v2-pytorch#87 (validation loss normalised by the wrong length);
    nlpyang/PreSumm#223 ("validation loss twice the training loss" from the start).
    """
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    t = teacher()
    xva = torch.randn(20, 64, N_IN)
    yva = t(xva.reshape(-1, N_IN)).reshape(20, 64)

    def val() -> torch.Tensor:
        total = sum(F.cross_entropy(model(xva[i]), yva[i]) for i in range(20))
        return total if summed else total / 20

    classify(ctx, model, opt, 300, label=t, eval_every=20, eval_fn=val)


# --------------------------------------------------------------------------- labels misaligned


def _misaligned_labels(ctx: Ctx, misaligned: bool) -> None:
    """Labels shuffled apart from their inputs in a fixed 4,096-example set.

    A dataset sorted or shuffled on one array only (aidotse/LeakPro#315, "labels should
    correspond to the indices in the input"; MultimediaTechLab/YOLO#85). The model can only
    memorise: the loss drifts 2-3% below chance instead of falling.
    """
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, N_IN, generator=g)
    y = teacher()(x)
    if misaligned:
        y = y[torch.randperm(4096, generator=g)]
    box = [0]

    def inputs(step: int) -> torch.Tensor:
        idx = torch.randint(0, 4096, (64,), generator=g)
        box[0] = idx
        return x[idx]

    classify(ctx, model, opt, 400, inputs=inputs, label=lambda _: y[box[0]])


# ------------------------------------------------------------------ no gradient reaches the model


def _detached_output(ctx: Ctx, detached: bool) -> None:
    """`out.detach().requires_grad_()`: the error goes away, and so does every gradient.

    The usual "fix" for "element 0 of tensors does not require grad and does not have a
    grad_fn"; mperezcarrasco/PyTorch-DAGMM#4 ("gradients are coming up as None"). Every
    parameter's .grad stays None: nothing trains. This is dead_pipeline, not vanishing.
    """
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        if detached:
            out = out.detach().requires_grad_()
        return F.cross_entropy(out, y)

    classify(ctx, model, opt, 300, loss_fn=loss_fn)


# --------------------------------------------------------------------------- eval mode left on


def _eval_mode_left_on(ctx: Ctx, bn: bool) -> None:
    """model.eval() for validation at step 50, model.train() never called again.

    joeynmt#184, wkentaro/pytorch-fcn#56 ("Training will have no effect until end of the
    epoch"), asyml/texar-pytorch#310. With BatchNorm and Dropout(0.3) it changes training;
    with neither (the twin) eval mode changes nothing and nothing should be said.
    """
    model = mlp(bn=bn, dropout=0.3 if bn else 0.0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    t = teacher()

    def before(step: int) -> None:
        if step == 51:
            model.eval()  # validation ran after step 50 and left the model in eval mode

    classify(ctx, model, opt, 200, label=t, before_step=before)


def _dropout_p0_eval_in_train_mode(ctx: Ctx) -> None:
    """Validation run in train mode on a model whose Dropout has p=0.0: no effect at all.

    nanoGPT's default (dropout=0.0); issue 13's trial saw EvalInTrainingMode name 13
    `Dropout(p=0.0)` modules that cannot change the output.
    """
    model = mlp(dropout=1e-9)
    for m in model:
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    t = teacher()
    xva = torch.randn(256, N_IN)
    classify(
        ctx,
        model,
        opt,
        100,
        label=t,
        eval_every=20,
        eval_fn=lambda: F.cross_entropy(model(xva), t(xva)),
    )


LOOP_FAMILIES: tuple[Scenario, ...] = (
    Scenario("corrupt_batch_one_step", "loss_spike", 200, lambda c: _corrupt_batch(c, True)),
    Scenario("healthy_twin_corrupt_batch", None, 0, lambda c: _corrupt_batch(c, False)),
    Scenario(
        "scheduler_stepped_per_batch",
        "lr_too_low",
        61,
        lambda c: _scheduler_units(c, True),
        also=("dead_pipeline",),
    ),
    Scenario("healthy_scheduler_stepped_per_epoch", None, 0, lambda c: _scheduler_units(c, False)),
    Scenario(
        "hidden_lr_100x_below_head",
        "update_ratio",
        1,
        lambda c: group_lrs(c, 1e-5),
        also=("lr_too_low",),
    ),
    Scenario("healthy_twin_equal_group_lrs", None, 0, lambda c: group_lrs(c, 1e-3)),
    Scenario(
        "val_loss_summed_20x",
        "generalization_gap",
        20,
        lambda c: _val_loss_reduction(c, True),
        also=("eval_mode_wiring",),
    ),
    Scenario("healthy_twin_val_loss_averaged", None, 0, lambda c: _val_loss_reduction(c, False)),
    Scenario(
        "labels_misaligned_fixed_set", "dead_pipeline", 1, lambda c: _misaligned_labels(c, True)
    ),
    Scenario("healthy_twin_labels_aligned", None, 0, lambda c: _misaligned_labels(c, False)),
    Scenario(
        "output_detached_requires_grad", "dead_pipeline", 1, lambda c: _detached_output(c, True)
    ),
    Scenario("healthy_twin_output_attached", None, 0, lambda c: _detached_output(c, False)),
    Scenario(
        "eval_mode_left_on_after_validation",
        "eval_mode_wiring",
        51,
        lambda c: _eval_mode_left_on(c, bn=True),
    ),
    Scenario(
        "healthy_eval_mode_left_on_no_effect", None, 0, lambda c: _eval_mode_left_on(c, bn=False)
    ),
    Scenario("healthy_dropout_p0_eval_in_train_mode", None, 0, _dropout_p0_eval_in_train_mode),
)
