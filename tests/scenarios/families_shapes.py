"""GELU/SiLU units pushed dead beside their healthy twins, and healthy runs whose shapes
once paged: SGD warm restarts, a sigmoid output under BCE, a tied-embedding GPT, a loss
converged near zero, weights waking from a small init.

Part of ``families.FAMILIES``, after ``families_freezing``'s; split from it by theme.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.runner import Ctx, Scenario
from scenarios.training import N_CLS, N_IN, classify, mlp

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
    tests/rules/test_rules_activation_stats.py checks with its measured numbers.)
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


SHAPE_FAMILIES: tuple[Scenario, ...] = (
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
)
