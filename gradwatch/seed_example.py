"""The seed's worked example as code: data, model, loss and the Stage 1 → full-set loop.

A 6-layer tanh MLP classifier on a tabular set, Xavier init scaled by
``init_scale`` (the seed's bug is 10×), SGD at lr 0.1, and a hand-written
log-softmax (the numerically fragile kind the seed blames for its NaN). The
run memorizes 12 examples for 300 steps, then trains on the full set. Used by
``gradwatch demo``, the fault suite and ``benchmarks/seed_example.py``; what it
really does is measured there, not assumed from the seed's narrative.

Example::

    x, y = tabular()
    model = seed_model(init_scale=10.0)
    losses = run(model, x, y)   # one float per step
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

N_FEATURES, N_CLASSES, WIDTH, DEPTH = 16, 4, 64, 6
N_EXAMPLES = 2048  # the "tabular dataset": teacher-labelled Gaussian features
SUBSET = 12  # Stage 1 memorizes 12 examples ...
SUBSET_STEPS = 300  # ... for 300 steps
LR = 0.1
BATCH = 64


def tabular(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels: a fixed random tanh teacher labels Gaussian features (4 classes)."""
    teacher = torch.Generator().manual_seed(1)
    w1 = torch.randn(N_FEATURES, 32, generator=teacher)
    w2 = torch.randn(32, N_CLASSES, generator=teacher)
    x = torch.randn(N_EXAMPLES, N_FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def seed_model(init_scale: float) -> nn.Sequential:
    """The 6-layer tanh MLP with Xavier-uniform weights × ``init_scale`` and zero biases."""
    layers: list[nn.Module] = []
    for i in range(DEPTH):
        lin = nn.Linear(N_FEATURES if i == 0 else WIDTH, N_CLASSES if i == DEPTH - 1 else WIDTH)
        nn.init.xavier_uniform_(lin.weight, gain=init_scale)
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()] if i < DEPTH - 1 else [lin]
    return nn.Sequential(*layers)


def fragile_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy through a hand-written softmax: exp overflows and log(0) is -inf."""
    p = torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True)
    return -torch.log(p.gather(1, labels[:, None])).mean()


Watch = Callable[[nn.Module, torch.optim.Optimizer], Any]


def run(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    watch: Watch | None = None,
    *,
    full_steps: int = 300,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Memorize ``SUBSET`` examples for ``SUBSET_STEPS`` steps, then ``full_steps`` on the full set.

    ``watch(model, optimizer)`` returns the gradwatch Monitor (or None runs
    unmonitored); it gets each loss and the announced switch to the full set,
    and is left open for the caller to close. Returns the loss of every step
    (read on the host: a loop for CPU demos and measurements, not for speed).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    mon = watch(model, optimizer) if watch is not None else None
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for step in range(1, SUBSET_STEPS + full_steps + 1):
        if step <= SUBSET_STEPS:
            xb, yb = x[:SUBSET], y[:SUBSET]
        else:
            if step == SUBSET_STEPS + 1 and mon is not None:
                mon.data_changed("memorization subset -> full set")
            idx = torch.randint(0, len(x), (BATCH,), generator=g)
            xb, yb = x[idx], y[idx]
        loss = fragile_nll(model(xb), yb)
        loss.backward()
        optimizer.step()
        if mon is not None:
            mon.log(loss=loss)
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
