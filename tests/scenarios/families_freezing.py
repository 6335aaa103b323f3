"""Families about parameters held still: a backbone frozen mid-run beside deliberate
freezes (a head-only fine-tune, discriminative learning rates), and BatchNorm recipes that
hold or zero part of the model on purpose (``norm_eval``, zero-initialised residual gains).

Part of ``families.FAMILIES``, after ``families_loop``'s; split from it by theme.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.runner import Ctx, Scenario
from scenarios.training import N_CLS, N_IN, classify, mlp, teacher

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


# --------------------------------------------------------------------------- BatchNorm recipes


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


FREEZING_FAMILIES: tuple[Scenario, ...] = (
    Scenario(
        "backbone_frozen_mid_run", "update_ratio", 100, _frozen_mid_run, also=("dead_pipeline",)
    ),
    Scenario("healthy_head_only_finetune", None, 0, _head_only_finetune, allow="info"),
    Scenario("healthy_norm_eval_batchnorm_frozen", None, 0, _norm_eval, allow="info"),
    Scenario("healthy_zero_init_residual", None, 0, lambda c: _standard_recipe(c, 0.0)),
    Scenario("healthy_zero_init_label_smoothing", None, 0, lambda c: _standard_recipe(c, 0.2)),
    Scenario("healthy_discriminative_lr_finetune", None, 0, _discriminative_finetune, allow="info"),
)
