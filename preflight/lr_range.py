"""Stage 5 of the seed's procedure: the learning-rate range test.

Train copies of the model and optimizer (yours are untouched) for ``steps``
steps while the learning rate grows exponentially from ``start`` to ``end``.
The loss is smoothed (a bias-corrected exponential moving average); the
*instability boundary* is the first learning rate where the smoothed loss
exceeds ``diverge_factor`` x its minimum so far, or goes non-finite; the sweep
stops there. The suggested learning rate is an order of magnitude below the
boundary. Asked for (``plot=PATH``), a PNG of loss against learning rate (log x)
marks both; nothing is written otherwise. At a terminal, a progress bar on
stderr counts the steps.

Example::

    from gradwatch.preflight import lr_range_test

    result = lr_range_test(model, optimizer, loss_fn, loader, plot="lr_range.png")
    print(result)                 # boundary 0.31, suggested lr 0.031, plot lr_range.png
    for group in optimizer.param_groups:
        group["lr"] = result.suggested_lr
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import torch

from gradwatch.preflight.batches import Batch, LossFn, cycle, forward_loss, scalar
from gradwatch.progress import progress

DIVERGE_FACTOR = 4.0  # smoothed loss above 4x its minimum: past the boundary (fastai's convention)
SMOOTHING = 0.7  # EMA weight of the past; short sweeps need a short memory or the boundary lags
SUGGEST_BELOW = 10.0  # seed: a good working lr is an order of magnitude below the boundary

OptimizerSpec = (
    torch.optim.Optimizer | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
)


@dataclass(frozen=True, slots=True)
class LRRangeResult:
    """The sweep: learning rates, raw and smoothed losses, boundary and suggestion."""

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    boundary: float | None
    suggested_lr: float | None
    min_loss_lr: float | None
    plot: Path | None
    seconds: float

    def __str__(self) -> str:
        if not self.lrs:
            return "lr range test: no steps ran"
        span = (
            f"{self.lrs[0]:.1e}..{self.lrs[-1]:.1e} over {len(self.lrs)} step(s), "
            f"{self.seconds:.1f}s"
        )
        if self.boundary is None:
            head = (
                f"lr range test: no instability boundary found in {span}; the loss never rose "
                f"{DIVERGE_FACTOR:g}x above its minimum -- extend `end` to find it"
            )
        else:
            head = (
                f"lr range test: instability boundary at lr {self.boundary:.3g}; suggested lr "
                f"{self.suggested_lr:.3g} (boundary / {SUGGEST_BELOW:g}); swept {span}"
            )
        if self.min_loss_lr is not None:
            head += (
                f"\n  lowest smoothed loss {min(self.smoothed):.4g} at lr {self.min_loss_lr:.3g}"
            )
        return head + (f"\n  plot: {self.plot}" if self.plot else "")


def lr_range_test(
    model: torch.nn.Module,
    optimizer: OptimizerSpec,
    loss_fn: LossFn,
    batches: Iterable[Batch] | Callable[[], Batch],
    start: float = 1e-7,
    end: float = 10.0,
    steps: int = 100,
    plot: str | PathLike[str] | None = None,
    diverge_factor: float = DIVERGE_FACTOR,
    smoothing: float = SMOOTHING,
) -> LRRangeResult:
    """Sweep the lr exponentially over ``steps`` steps; see the module docstring.

    ``optimizer`` is your optimizer (copied with the model, state included) or a
    factory ``f(params)``. ``batches`` is re-iterated when it runs out (a list,
    a DataLoader) or called each step. ``plot=PATH`` writes the PNG there (needs
    matplotlib, the ``preflight`` extra); the default writes no file.
    """
    if not (0 < start < end) or steps < 2:
        raise ValueError(
            f"need 0 < start < end and steps >= 2, got start={start}, end={end}, steps={steps}"
        )
    began = time.perf_counter()
    work, opt = _copies(model, optimizer)
    work.train()
    lrs, losses, smoothed = _sweep(
        work, opt, loss_fn, cycle(batches), start, end, steps, smoothing, diverge_factor
    )
    boundary = _boundary(lrs, smoothed, diverge_factor)
    finite = [(s, lr) for s, lr in zip(smoothed, lrs, strict=True) if math.isfinite(s)]
    min_lr = min(finite)[1] if finite else None
    suggested = boundary / SUGGEST_BELOW if boundary is not None else None
    path = None
    if plot is not None:
        from gradwatch.preflight.plot import plot_lr_range

        path = plot_lr_range(Path(plot), lrs, losses, smoothed, boundary, suggested)
    return LRRangeResult(
        tuple(lrs),
        tuple(losses),
        tuple(smoothed),
        boundary,
        suggested,
        min_lr,
        path,
        time.perf_counter() - began,
    )


def _copies(
    model: torch.nn.Module, optimizer: OptimizerSpec
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        own = {id(p) for p in model.parameters()}
        if not all(id(p) in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds parameters that are not this model's; pass the "
                "optimizer built on model.parameters(), or a factory f(params)"
            )
        # One deepcopy of both: the memo maps each parameter to its copy, so the copied
        # optimizer (state included) drives the copied model's parameters.
        return copy.deepcopy((model, optimizer))
    work = copy.deepcopy(model)
    return work, optimizer(work.parameters())


def _sweep(
    work: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: LossFn,
    batches: Iterable[Batch],
    start: float,
    end: float,
    steps: int,
    smoothing: float,
    diverge_factor: float,
) -> tuple[list[float], list[float], list[float]]:
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    avg, best = 0.0, math.inf
    growth = (end / start) ** (1.0 / (steps - 1))
    with progress(steps, "lr range test", unit="step") as bar:
        # Not strict: batches is cycled, so it is longer than the sweep by design.
        for i, batch in zip(range(steps), batches, strict=False):
            lr = start * growth**i
            for group in opt.param_groups:
                group["lr"] = lr
            loss = forward_loss(work, loss_fn, batch)
            value = scalar(
                loss
            )  # the sweep decides each step whether to stop: it must read the loss
            avg = smoothing * avg + (1 - smoothing) * value
            smooth = avg / (1 - smoothing ** (i + 1))
            lrs.append(lr)
            losses.append(value)
            smoothed.append(smooth if math.isfinite(value) else math.nan)
            bar.update(1)
            if not math.isfinite(smooth) or smooth > diverge_factor * best:
                break
            best = min(best, smooth)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return lrs, losses, smoothed


def _boundary(lrs: Sequence[float], smoothed: Sequence[float], factor: float) -> float | None:
    best = math.inf
    for lr, value in zip(lrs, smoothed, strict=True):
        if not math.isfinite(value) or value > factor * best:
            return lr
        best = min(best, value)
    return None
