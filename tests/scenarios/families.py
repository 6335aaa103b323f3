"""Fault families from real bug reports and the literature, each beside a healthy twin.

Each family is a fault and a control that runs the same model and loop without
the fault, so a detector that fires on both is a false page, not a catch. Where a
family came from is cited in its function's docstring (GitHub issues of PyTorch
projects, papers). Families marked ``HELD_OUT`` were not shown to the engineers
who design the rules: they measure whether detectors derived from invariants of
healthy training generalise, so keep their descriptions out of rule-design notes.

``ALL_SCENARIOS`` is the whole suite: ``scenario_lib.SCENARIOS`` then these.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.scenario_lib import N_CLS, N_IN, SCENARIOS, Ctx, Scenario, classify, mlp, teacher
from scenarios.writes import WRITES

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


def _group_lrs(ctx: Ctx, hidden_lr: float, decay: float = 1.0) -> None:
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


def _norm_eval(ctx: Ctx) -> None:
    """BatchNorm kept in eval mode while the model trains, its affine weights learning.

    OpenMMLab's ``norm_eval=True`` (the default of its detection backbones: ResNet.train()
    calls ``m.eval()`` on every ``_BatchNorm``), used to fine-tune with small batches. It
    paged TrainingInEvalMode. Healthy: info at most (NormStatisticsFrozen).
    """
    model = mlp(bn=True)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.eval()
    classify(ctx, model, opt, 200, label=teacher())


class _ZeroInitBlock(nn.Module):
    """A residual block whose last BatchNorm gain starts at zero (torchvision's
    ``zero_init_residual=True``, Goyal et al. 2017): each block starts as the identity."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(width, width), nn.BatchNorm1d(width)
        self.fc2, self.bn2 = nn.Linear(width, width), nn.BatchNorm1d(width)
        self.act = nn.ReLU()
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x + self.bn2(self.fc2(self.act(self.bn1(self.fc1(x))))))


def _standard_recipe(ctx: Ctx, smoothing: float) -> None:
    """ImageNet-style recipe on a small residual net: zero-initialised residual gains, SGD
    with momentum and weight decay, and (``smoothing``) label smoothing, whose loss floor
    is above zero. Healthy: nothing at all."""
    blocks = [_ZeroInitBlock(64) for _ in range(6)]
    model = nn.Sequential(nn.Linear(N_IN, 64), nn.ReLU(), *blocks, nn.Linear(64, N_CLS))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    classify(
        ctx,
        model,
        opt,
        300,
        loss_fn=lambda out, y, step: F.cross_entropy(out, y, label_smoothing=smoothing),
    )


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


# --------------------------------------------------------------------------- freezing


def _backbone(model: nn.Sequential) -> list[nn.Parameter]:
    return [p for m in list(model)[:-1] for p in m.parameters()]


def _frozen_mid_run(ctx: Ctx) -> None:
    """The backbone frozen with requires_grad_(False) at step 100, by a callback gone wrong.

    ultralytics/yolov3#218 (freeze at epoch 0, unfreeze at epoch 1), eora-ai/torchok#158
    (a FreezeUnfreeze callback fixed), detectron2#2893. From step 100 only the head learns.
    """
    model = mlp(depth=3)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    def before(step: int) -> None:
        if step == 100:
            for p in _backbone(model):
                p.requires_grad_(False)

    classify(ctx, model, opt, 300, before_step=before)


def _discriminative_finetune(ctx: Ctx) -> None:
    """A pretrained backbone fine-tuned at lr/100 under a fresh head: discriminative rates.

    fast.ai's ``slice(1e-5, 1e-3)``, ULMFiT's discriminative fine-tuning; layer-wise decay
    in MAE/BEiT fine-tuning spans 30-175x. The backbone is trained here first (800 Adam
    steps on one task), then the head is reset for another. Healthy: info at most (the
    rates are the loop's choice, LayersLaggingByGroupRate says so).
    """
    model = mlp(depth=4, width=32)
    pre = torch.optim.Adam(model.parameters(), lr=2e-3)
    first = teacher(1)
    for _ in range(800):
        x = torch.randn(64, N_IN)
        F.cross_entropy(model(x), first(x)).backward()
        pre.step()
        pre.zero_grad()
    head = model[-1]
    head.reset_parameters()
    groups = [{"params": list(head.parameters()), "lr": 1e-3}]
    groups.append({"params": _backbone(model), "lr": 1e-5})
    classify(ctx, model, torch.optim.Adam(groups), 300, label=teacher(2))


def _head_only_finetune(ctx: Ctx) -> None:
    """A deliberate head-only fine-tune: the backbone frozen before watch(), the optimizer
    given only trainable parameters (the PyTorch transfer-learning tutorial's pattern).

    Healthy: nothing above info may be raised.
    """
    model = mlp(depth=3)
    for p in _backbone(model):
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    classify(ctx, model, opt, 300)


# --------------------------------------------------------------------------- GELU / SiLU units


def _smooth_act(ctx: Ctx, act: type[nn.Module], bias: float) -> None:
    """GELU/SiLU hidden units pushed far into their negative tail by a bad bias init.

    Modern MLPs (GPT-2, LLaMA's SwiGLU) use GELU/SiLU, whose outputs are never exactly 0:
    a unit at -6 outputs ~1e-8 and passes no gradient, as a dead ReLU does. ``bias`` 0
    is the healthy twin.
    """
    model = mlp(depth=3, width=64, act=act)
    with torch.no_grad():
        for m in list(model)[:-1]:
            if isinstance(m, nn.Linear):
                m.bias.fill_(bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    classify(ctx, model, opt, 200)


# --------------------------------------------------------------------------- healthy shapes


def _warm_restarts(ctx: Ctx) -> None:
    """SGD with cosine warm restarts (SGDR): the lr jumps back to its peak every 100 steps.

    A planned restart is no spike cause. (A small CNN under SGDR paged DeadReLUs at step
    22, a layer turning sparse as its loss fell; this MLP does not reproduce that, which
    tests/rules/test_rules_stats_detectors.py checks with its measured numbers.)
    """
    model = mlp(depth=3, width=64, act=nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=100)
    classify(ctx, model, opt, 400, sched=sched)


def _sigmoid_output(ctx: Ctx) -> None:
    """A binary classifier ending in ``nn.Sigmoid``, trained with ``BCELoss``.

    As it learns, its outputs pin near 0 and 1: a confident model, not saturated units
    (BCELoss undoes the sigmoid's slope). It paged ActivationsSaturated before 2026-12-06.
    """
    model = nn.Sequential(
        nn.Linear(N_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1), nn.Sigmoid()
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    direction = torch.randn(N_IN, generator=torch.Generator().manual_seed(3))

    def bce(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        return F.binary_cross_entropy(out.squeeze(1), y)

    classify(ctx, model, opt, 400, label=lambda x: (x @ direction > 0).float(), loss_fn=bce)


class TiedGPT(nn.Module):
    """A 2-layer pre-LN GPT with the token embedding tied to the LM head (nanoGPT's layout)."""

    def __init__(self, vocab: int = 32, d: int = 32, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, 2, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying (Press & Wolf 2017)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x, src_mask=self.mask, is_causal=True)
        return self.head(self.ln_f(x))


def _tied_gpt(ctx: Ctx, steps: int = 300) -> None:
    """nanoGPT's recipe in miniature: tied embeddings, AdamW, clip 1.0, grad accum 2,
    warmup + cosine, on a noisy periodic token stream. Healthy: nothing may fire.

    Issue 13: healthy nanoGPT raised LayerGradNormRatioExploding (the tied embedding and
    the final LayerNorm gain taken as the ratio's ends).
    """
    model = TiedGPT()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.99),
    )
    warm = 30

    def lr_at(it: int) -> float:
        if it < warm:
            return 3e-3 * (it + 1) / (warm + 1)
        return 3e-4 + 0.5 * (1 + math.cos(math.pi * (it - warm) / (steps - warm))) * 2.7e-3

    g = torch.Generator().manual_seed(7)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, 8, (8, 1), generator=g)
        seq = (start + torch.arange(17) * 3) % 32  # a periodic stream...
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, 32, seq.shape, generator=g), seq)  # ...noisy
        return seq[:, :-1], seq[:, 1:]

    mon = ctx.watch(model, opt)
    for it in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        for _ in range(2):
            x, y = batch()
            loss = F.cross_entropy(model(x).reshape(-1, 32), y.reshape(-1)) / 2
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mon.log(loss=loss * 2, grad_norm=norm)
        opt.zero_grad(set_to_none=True)


def _near_zero_converged(ctx: Ctx) -> None:
    """A separable task learnt to a loss near 1e-4, with rare harder batches 10x higher.

    Issue 13's Hugging Face corpus: 23 of 25 LossSpike firings were 0.0003 -> 0.003 on a
    converged loss. Healthy: nothing may fire.
    """
    model = mlp(depth=1, width=32, n_out=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    w = torch.randn(N_IN)

    def inputs(step: int) -> torch.Tensor:
        x = torch.randn(64, N_IN)
        margin = 2.5 if step % 40 == 0 else 3.0  # now and then a batch nearer the boundary
        return x + margin * torch.sign(x @ w)[:, None] * w / w.norm()

    classify(ctx, model, opt, 500, inputs=inputs, label=lambda x: (x @ w > 0).long())


def _weights_waking(ctx: Ctx) -> None:
    """A small-init (x0.02) bias-free tanh MLP: the grad norm rises from ~2e-4 to ~0.1 in
    20 steps as the weights wake (each layer's gradient is the product of the others'
    weights), then it trains normally. Adam's normalised step makes this harmless.

    Issue 13: geometric growth fired critical with "lower the learning rate" on such growth.
    Healthy (it ends where the default init does): a note (info) about the small start is
    fair, a page is not.
    """
    model = nn.Sequential(
        nn.Linear(N_IN, 64, bias=False),
        nn.Tanh(),
        nn.Linear(64, 64, bias=False),
        nn.Tanh(),
        nn.Linear(64, N_CLS, bias=False),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.02)
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), 400)


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


FAMILIES: tuple[Scenario, ...] = (
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
        lambda c: _group_lrs(c, 1e-5),
        also=("lr_too_low",),
    ),
    Scenario("healthy_twin_equal_group_lrs", None, 0, lambda c: _group_lrs(c, 1e-3)),
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
    Scenario(
        "backbone_frozen_mid_run", "update_ratio", 100, _frozen_mid_run, also=("dead_pipeline",)
    ),
    Scenario("healthy_head_only_finetune", None, 0, _head_only_finetune, allow="info"),
    Scenario("healthy_norm_eval_batchnorm_frozen", None, 0, _norm_eval, allow="info"),
    Scenario("healthy_zero_init_residual", None, 0, lambda c: _standard_recipe(c, 0.0)),
    Scenario("healthy_zero_init_label_smoothing", None, 0, lambda c: _standard_recipe(c, 0.2)),
    Scenario("healthy_discriminative_lr_finetune", None, 0, _discriminative_finetune, allow="info"),
    Scenario(
        "gelu_units_dead_bias",
        "dead_units",
        1,
        lambda c: _smooth_act(c, nn.GELU, -6.0),
        also=("vanishing_gradients",),
    ),
    Scenario(
        "silu_units_dead_bias",
        "dead_units",
        1,
        lambda c: _smooth_act(c, nn.SiLU, -8.0),
        also=("vanishing_gradients",),
    ),
    Scenario("healthy_gelu", None, 0, lambda c: _smooth_act(c, nn.GELU, 0.0)),
    Scenario("healthy_silu", None, 0, lambda c: _smooth_act(c, nn.SiLU, 0.0)),
    Scenario("healthy_tied_embedding_gpt", None, 0, _tied_gpt, slow=True),
    Scenario("healthy_near_zero_converged_loss", None, 0, _near_zero_converged),
    Scenario("healthy_sigmoid_output_bce", None, 0, _sigmoid_output),
    Scenario("healthy_sgd_warm_restarts", None, 0, _warm_restarts),
    Scenario("healthy_weights_waking_from_small_init", None, 0, _weights_waking, allow="info"),
    # HELD OUT (see HELD_OUT below)
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
    Scenario("healthy_layerwise_lr_decay", None, 0, lambda c: _group_lrs(c, 1e-3, decay=0.7)),
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
