"""Fault families and controls about how the weights get written: by the optimizer alone.

Layers the optimizer skips on some steps (LayerDrop, a layer the forward never calls) and
writes outside it between two steps (a model re-initialised, a checkpoint loaded mid-run).
Part of ``families.ALL_SCENARIOS``; none is held out of rule design.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.runner import Ctx, Scenario
from scenarios.training import N_CLS, N_IN, classify, mlp


class _LayerDropNet(nn.Module):
    """Pre-norm residual GELU blocks, each skipped for a whole batch with probability ``p``
    while training: LayerDrop (fairseq; HF's ``config.layerdrop``, 0.1 in wav2vec2)."""

    def __init__(self, depth: int = 6, width: int = 32, p: float = 0.2) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(N_IN, width), nn.Linear(width, N_CLS)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            if not (self.training and float(torch.rand(())) < self.p):
                h = h + block(h)
        return self.head(h)


def _layerdrop(ctx: Ctx) -> None:
    """LayerDrop: a skipped block gets no gradient, so AdamW leaves it alone that step.

    Healthy. Before 2026-12-07 its update ratio on such a step was 0, and blocks skipped
    on consecutive samples read as layers that "never change" (LayersFrozen, info, 6 times
    in these 300 steps); the agent now sends no ratio for a layer skipped now and then.
    """
    model = _LayerDropNet()
    classify(ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-3), 300)


class _Skipped(nn.Module):
    """An MLP whose middle layer is defined, in the optimizer, and never called."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(N_IN, 64), nn.Linear(64, 64), nn.Linear(64, N_CLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc1(x)))  # the forward forgot self.fc2


def _layer_never_called(ctx: Ctx) -> None:
    """A layer the forward never calls: it gets no gradient and never moves.

    Info (LayersFrozen): often a bug, sometimes by design (an unused pooler or head).
    Guards the agent's MISSING for layers skipped now and then (LayerDrop): a layer
    without a gradient on every sample still reads 0 and is named.
    """
    model = _Skipped()
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), 300)


def _weights_rewritten(ctx: Ctx, source: str) -> None:
    """The weights written outside the optimizer at step 300 of 600 (Adam, lr 1e-3).

    ``reinit``: every Linear's ``reset_parameters()`` (``model.apply(init)`` run again);
    ``early``: the step-20 checkpoint loaded instead of the latest; ``best``: the step-290
    one, restoring the best weights (healthy: it takes back nothing that matters); the
    loss goes back to its start in the first two and relearns over ~130 steps.
    """
    model = mlp(depth=4, width=64)
    saved: dict[str, torch.Tensor] = {}

    def before_step(step: int) -> None:
        if step == (20 if source == "early" else 290):
            saved.update({k: v.clone() for k, v in model.state_dict().items()})
        if step != 300:
            return
        if source == "reinit":
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
        else:
            model.load_state_dict(saved)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    classify(ctx, model, opt, 600, before_step=before_step)


WRITES: tuple[Scenario, ...] = (
    Scenario("healthy_layerdrop", None, 0, _layerdrop),
    Scenario("layer_never_called_in_forward", "update_ratio", 1, _layer_never_called),
    Scenario(
        "model_reinitialised_mid_run", "loss_spike", 300, lambda c: _weights_rewritten(c, "reinit")
    ),
    Scenario(
        "early_checkpoint_loaded_mid_run",
        "loss_spike",
        300,
        lambda c: _weights_rewritten(c, "early"),
    ),
    Scenario("healthy_best_checkpoint_restored", None, 0, lambda c: _weights_rewritten(c, "best")),
)
