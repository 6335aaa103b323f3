"""Record a nanoGPT-architecture run's gradient signals, to calibrate the rules on a real model.

The model is karpathy/nanoGPT's ``model.py`` architecture rebuilt here (token
embedding tied to the LM head, learned positions, pre-LayerNorm blocks without
biases, GELU MLP, nanoGPT's init with the scaled residual projections), trained
as nanoGPT's README runs it on a CPU: 4 layers, 4 heads, d 128, block 64,
batch 12, AdamW (0.9, 0.99) with weight decay 0.1 on matrices only, lr 1e-3
with 100 warm-up steps and cosine decay to 1e-4 over 2,000, clip 1.0,
dropout 0, gradient accumulation 2. The text is character-level: this
repository's own docs. (``benchmarks/nanogpt_trial.py`` runs nanoGPT's own
code end to end through the agent and collector; this script needs neither,
and its output is small enough to keep as a test fixture.)

Per optimizer step it records what the agent sends: the loss (mean of the
micro-batches), the pre-clip total grad norm, every parameter's gradient norm
in ``named_parameters()`` order, the learning rate; every ``--stats-every``
steps (and the first 20) the weight norms and update ratios ‖Δw‖/‖w‖.
Parameter roles (CONTRACTS C1) are saved alongside. Faults: ``--init-scale
0.01`` (weights start 100x too small), ``--lr-mult 100``.

Run (about 5 minutes per 1,500 iterations on one busy core)::

    python benchmarks/gpt_signals.py --iters 1500 --out tests/rules/data/gpt-healthy.npz

``tests/rules/test_rules_gpt_signals.py`` replays the saved runs through the
default rules.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm without bias."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln_2, self.mlp = LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, block: int, layers: int, heads: int, d: int, init_scale: float
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(block, d),
                "h": nn.ModuleList(Block(d, heads) for _ in range(layers)),
                "ln_f": LayerNorm(d),
            }
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying
        std = 0.02 * init_scale
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                proj = name.endswith("c_proj.weight")
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers) if proj else std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def roles(model: nn.Module) -> list[str]:
    """CONTRACTS C1 roles, in ``named_parameters()`` order (tied parameters named once)."""
    users: dict[int, int] = {}
    kind: dict[int, type] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
            kind[id(p)] = type(module)
    out = []
    for name, p in model.named_parameters():
        if users[id(p)] > 1:
            out.append("tied")
        elif issubclass(kind[id(p)], (LayerNorm, nn.LayerNorm)):
            out.append("norm")
        elif issubclass(kind[id(p)], nn.Embedding):
            out.append("embedding")
        elif p.dim() >= 2:
            out.append("weight")
        else:
            out.append("bias" if name.endswith("bias") else "other")
    return out


def lr_at(
    it: int, base: float, warmup: int = 100, decay: int = 2000, floor_ratio: float = 0.1
) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to a tenth, then flat."""
    if it < warmup:
        return base * (it + 1) / (warmup + 1)
    if it > decay:
        return base * floor_ratio
    ratio = (it - warmup) / (decay - warmup)
    return base * floor_ratio + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (
        base - base * floor_ratio
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--init-scale", type=float, default=1.0)
    ap.add_argument("--lr-mult", type=float, default=1.0)
    ap.add_argument("--stats-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    block, batch, accum = 64, 12, 2
    model = GPT(len(chars), block, layers=4, heads=4, d=128, init_scale=args.init_scale)
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    base_lr = 1e-3 * args.lr_mult
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=base_lr,
        betas=(0.9, 0.99),
    )
    rec: dict[str, list] = {
        k: []
        for k in ("loss", "grad_norm", "lr", "norms", "stats_step", "weight_norms", "update_ratios")
    }
    started = time.perf_counter()
    for it in range(args.iters):
        lr = lr_at(it, base_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        losses = []
        for _ in range(accum):
            ix = torch.randint(len(data) - block - 1, (batch,))
            x = torch.stack([data[i : i + block] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
            loss = model(x, y) / accum
            loss.backward()
            losses.append(float(loss.detach()) * accum)
        norms = torch.stack(torch._foreach_norm([p.grad for p in params.values()])).double().numpy()
        total = float(nn.utils.clip_grad_norm_(params.values(), 1.0))
        stats = (it + 1) % args.stats_every == 0 or it < 20
        before = [p.detach().clone() for p in params.values()] if stats else []
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["loss"].append(sum(losses) / accum)
        rec["grad_norm"].append(total)
        rec["lr"].append(lr)
        rec["norms"].append(norms)
        if stats:
            w = np.array([float(p.detach().norm()) for p in params.values()])
            dw = np.array(
                [
                    float((p.detach() - b).norm())
                    for p, b in zip(params.values(), before, strict=True)
                ]
            )
            rec["stats_step"].append(it + 1)
            rec["weight_norms"].append(w)
            rec["update_ratios"].append(dw / np.maximum(w, 1e-30))
        if (it + 1) % 250 == 0:
            print(
                f"iter {it + 1}: loss {rec['loss'][-1]:.3f} grad norm {total:.3g} "
                f"({time.perf_counter() - started:.0f}s)",
                flush=True,
            )
    np.savez_compressed(
        args.out,
        layers=np.array(list(params)),
        roles=np.array(roles(model)),
        loss=np.array(rec["loss"], np.float32),
        grad_norm=np.array(rec["grad_norm"], np.float32),
        lr=np.array(rec["lr"], np.float32),
        norms=np.array(rec["norms"], np.float32),
        stats_step=np.array(rec["stats_step"], np.int32),
        weight_norms=np.array(rec["weight_norms"], np.float32),
        update_ratios=np.array(rec["update_ratios"], np.float32),
    )
    print(
        f"wrote {args.out}: {args.iters} steps, {len(params)} parameters, "
        f"{time.perf_counter() - started:.0f}s"
    )


if __name__ == "__main__":
    main()
