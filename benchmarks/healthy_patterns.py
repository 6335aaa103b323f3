"""Common healthy training recipes, each run live under the agent and a recording collector.

The trials run other people's scripts; this runs the recipes such scripts are made of,
each written the way its tutorials write it, to ask one question: does gradwatch page?
Every warning-or-higher alert here is a false page. Each recipe is small (a CNN or an
MLP on the synthetic digits of ``benchmarks/standins/``) and runs ``--steps`` steps on
the CPU, in its own process, attached as README's quickstart says.

Found here and fixed (2026-12-06; the code of 1586956 via ``PYTHONPATH``, the same
recipes): ``sigmoid_bce`` paged ActivationsSaturated at step 63 and ``autoencoder`` at
285 (an output sigmoid is no hidden unit: agent/activations.py), ``sgdr`` paged DeadReLUs
at step 22 (a layer that turned sparse as its loss fell: rules/activations.py). Now: 0
pages on all thirteen; ``gaussian_nll`` raises the info LossBelowZero, as it should,
and ``sparse_embedding`` paged AgentDegraded at step 0 before (now the info
AgentStatisticOff: agent/recovery.py).

    python benchmarks/healthy_patterns.py [--variants NAME,...] [--keep DIR]
    python benchmarks/healthy_patterns.py --replay-only DIR     # current rules
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from trials import STANDINS, report, run_recorded, trial_args

STEPS = 600
# A recipe: the model, its optimizer, a scheduler or None, and one step's forward and
# backward (it may backward several micro-batches, clip, ...) returning the loss to log.
Built = tuple[nn.Module, torch.optim.Optimizer, object, Callable[[int], torch.Tensor]]


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    sys.path.insert(0, str(STANDINS))
    from torchvision.datasets import synthetic_digits  # the stand-in, not torchvision

    x, y = synthetic_digits(20_000, 0)
    return ((x.float() / 255.0 - 0.16) / 0.3).unsqueeze(1), y


def _batch(x: torch.Tensor, y: torch.Tensor, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.randint(0, len(y), (size,))
    return x[i], y[i]


def _cnn(out: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 49, 64), nn.ReLU(), nn.Linear(64, out),
    )  # fmt: skip


def _mlp(out: int = 10, act: type[nn.Module] = nn.ReLU, drop: float = 0.0) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 256), act(), nn.Dropout(drop),
        nn.Linear(256, 128), act(), nn.Dropout(drop), nn.Linear(128, out),
    )  # fmt: skip


def _classifier(model: nn.Module, smoothing: float = 0.0) -> Callable[[int], torch.Tensor]:
    x, y = _digits()

    def step(_: int) -> torch.Tensor:
        xb, yb = _batch(x, y)
        loss = F.cross_entropy(model(xb), yb, label_smoothing=smoothing)
        loss.backward()
        return loss

    return step


def sgdr() -> Built:
    """A CNN, SGD 0.1 with momentum and weight decay, cosine warm restarts every 150 steps."""
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=150)
    return model, opt, sched, _classifier(model)


def one_cycle() -> Built:
    """The same CNN under OneCycleLR (max_lr 0.1): the super-convergence schedule."""
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    return model, opt, sched, _classifier(model)


def label_smoothing() -> Built:
    """A CNN with Adam and cross-entropy smoothed by 0.1: the loss floors near 0.5, not 0."""
    model = _cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, None, _classifier(model, smoothing=0.1)


def dropout_sgd() -> Built:
    """An MLP with dropout 0.5 after each hidden layer, plain SGD 0.05."""
    model = _mlp(drop=0.5)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), None, _classifier(model)


def warmup_cosine_clip() -> Built:
    """A GELU/LayerNorm MLP, AdamW 3e-3 (wd 0.1), 60 warm-up steps then cosine, clip 1.0."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 256), nn.LayerNorm(256), nn.GELU(),
        nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=60)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 60)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[60])
    forward = _classifier(model)

    def step(s: int) -> torch.Tensor:
        loss = forward(s)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    return model, opt, sched, step


def grad_accumulation() -> Built:
    """An MLP, 4 micro-batches of 16 per step, each loss / 4: the step's mean loss logged."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _digits()

    def step(_: int) -> torch.Tensor:
        total = torch.zeros(())
        for _ in range(4):
            xb, yb = _batch(x, y, 16)
            loss = F.cross_entropy(model(xb), yb) / 4
            loss.backward()
            total += loss.detach()
        return total

    return model, opt, None, step


def sigmoid_bce() -> Built:
    """An MLP ending in nn.Sigmoid, BCELoss on "is the digit even": a binary classifier."""
    model = nn.Sequential(_mlp(out=1), nn.Sigmoid())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _digits()

    def step(_: int) -> torch.Tensor:
        xb, yb = _batch(x, y)
        loss = F.binary_cross_entropy(model(xb).squeeze(1), (yb % 2 == 0).float())
        loss.backward()
        return loss

    return model, opt, None, step


def autoencoder() -> Built:
    """An MLP autoencoder (784-128-32-128-784), Sigmoid output, MSE on pixels in [0, 1]."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(),
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 784), nn.Sigmoid(),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _digits()
    pixels = (x * 0.3 + 0.16).clamp(0, 1).flatten(1)

    def step(_: int) -> torch.Tensor:
        i = torch.randint(0, len(y), (64,))
        loss = F.mse_loss(model(x[i]), pixels[i])
        loss.backward()
        return loss

    return model, opt, None, step


def gaussian_nll() -> Built:
    """Regression of the digit's ink with a predicted variance (GaussianNLLLoss): the
    loss goes below zero as the variance shrinks, by design."""
    model = _mlp(out=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _digits()
    ink = (x * 0.3 + 0.16).clamp(0, 1).mean(dim=(1, 2, 3)) * 10

    def step(_: int) -> torch.Tensor:
        i = torch.randint(0, len(y), (64,))
        mean, log_var = model(x[i]).unbind(1)
        loss = F.gaussian_nll_loss(mean, ink[i], log_var.exp())
        loss.backward()
        return loss

    return model, opt, None, step


def zero_init_head() -> Built:
    """An MLP whose classifier layer starts at exactly zero (a common head init), Adam."""
    model = _mlp()
    nn.init.zeros_(model[-1].weight)
    nn.init.zeros_(model[-1].bias)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, None, _classifier(model)


class _Block(nn.Module):
    """A residual block whose last BatchNorm gain starts at 0 (zero_init_residual)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def resnet_zero_init() -> Built:
    """A small ResNet (stem, 3 blocks with zero-initialised residual gains), SGD 0.1, cosine."""
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        _Block(16), nn.MaxPool2d(2), _Block(16), nn.MaxPool2d(2), _Block(16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return model, opt, sched, _classifier(model)


class _Contrastive(nn.Module):
    """An MLP encoder and CLIP's learnable temperature (a logit scale, ln 1/0.07 at start)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _mlp(out=64)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        za, zb = F.normalize(self.encoder(a), dim=1), F.normalize(self.encoder(b), dim=1)
        return self.logit_scale.exp().clamp(max=100) * za @ zb.T


def contrastive() -> Built:
    """InfoNCE between two noisy views of each digit, CLIP-style, Adam 1e-3."""
    model = _Contrastive()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _digits()

    def step(_: int) -> torch.Tensor:
        xb, _ = _batch(x, y, 128)
        logits = model(xb + 0.3 * torch.randn_like(xb), xb + 0.3 * torch.randn_like(xb))
        target = torch.arange(len(xb))
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        loss.backward()
        return loss

    return model, opt, None, step


def sparse_embedding() -> Built:
    """A recommender's bag of ids: nn.Embedding(sparse=True) and a dense head under one
    Adagrad optimizer (it takes sparse gradients, as SGD does)."""
    emb, head = nn.Embedding(500, 8, sparse=True), nn.Linear(8, 2)
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    score = torch.randn(500, generator=torch.Generator().manual_seed(1))

    def step(_: int) -> torch.Tensor:
        ids = torch.randint(0, 500, (64, 10))
        loss = F.cross_entropy(head(emb(ids).sum(1)), (score[ids].sum(1) > 0).long())
        loss.backward()
        return loss

    return model, opt, None, step


RECIPES: dict[str, Callable[[], Built]] = {
    f.__name__: f
    for f in (
        sgdr,
        one_cycle,
        label_smoothing,
        dropout_sgd,
        warmup_cosine_clip,
        grad_accumulation,
        sigmoid_bce,
        autoencoder,
        gaussian_nll,
        zero_init_head,
        resnet_zero_init,
        contrastive,
        sparse_embedding,
    )
}


def train(name: str, endpoint: str, steps: int) -> None:
    """One recipe in this process, watched as README's quickstart says."""
    import gradwatch

    torch.manual_seed(0)
    model, opt, sched, step = RECIPES[name]()
    mon = gradwatch.watch(model, opt, job=f"pattern-{name}", endpoint=endpoint)
    for s in range(steps):
        opt.zero_grad()
        loss = step(s)
        opt.step()
        mon.log(loss=loss)
        if sched is not None:
            sched.step()  # type: ignore[attr-defined]  # any torch scheduler
        if s % 100 == 0:
            print(f"step {s} loss {loss.item():.4g}", flush=True)
    mon.close()


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--train":
        train(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    accepts: dict[str, tuple[str, ...] | None] = dict.fromkeys(RECIPES, ())
    p, args, chosen = trial_args(__doc__ or "", None, dict.fromkeys(RECIPES, ()), STEPS, argv)
    traces = args.replay_only
    if traces is None:
        work = Path(tempfile.mkdtemp(prefix="patterns-"))
        traces = args.keep or work / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        for name in chosen:
            vdir = work / name
            vdir.mkdir()

            def write(endpoint: str, name: str = name) -> list[str]:
                return [str(Path(__file__).resolve()), "--train", name, endpoint, str(args.iters)]

            run_recorded(work, traces, f"pattern-{name}", vdir, write, {})
    report(traces, "pattern", chosen, args, accepts, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
