"""How preflight checks take data, and the few helpers every check shares.

A *batch* is ``(inputs, targets)``: the loss is ``loss_fn(model(inputs), targets)``.
``inputs`` may be a tensor or a tuple of tensors (passed as ``model(*inputs)``).
Where a check trains for several steps it also accepts a *batch source*, a
zero-argument callable returning a batch, so a pipeline that changes the
batch under you (shuffled labels, augmentation) is exercised as in training.

Example::

    from gradwatch.preflight.batches import forward_loss
    loss = forward_loss(model, torch.nn.functional.cross_entropy, (x, y))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

Batch = tuple[Any, Any]
LossFn = Callable[[Any, Any], torch.Tensor]
BatchSource = Batch | Callable[[], Batch]


def forward(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, unpacking a tuple or list of inputs as positional arguments."""
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def forward_loss(model: torch.nn.Module, loss_fn: LossFn, batch: Batch) -> torch.Tensor:
    """The scalar loss of ``model`` on ``batch``; a clear error when it is not a scalar."""
    inputs, targets = batch
    # Typed as a Tensor, but a user's loss_fn may return anything: check what came back.
    loss: object = loss_fn(forward(model, inputs), targets)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned {type(loss).__name__} of shape "
            f"{tuple(getattr(loss, 'shape', ()))}; a preflight check needs one scalar "
            "tensor (reduce with .mean() or .sum())"
        )
    return loss.reshape(())


def draw(source: BatchSource) -> Batch:
    """The next batch of ``source``: call it when callable, else the fixed batch itself."""
    # Typed as a Batch, but a user's source may give anything: check what came back.
    batch: object = source() if callable(source) else source
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(
            f"a batch must be (inputs, targets), got {type(batch).__name__}; "
            "wrap your data as a 2-tuple or pass a callable returning one"
        )
    return batch[0], batch[1]


def cycle(batches: Iterable[Batch] | Callable[[], Batch]) -> Iterator[Batch]:
    """Batches forever: call a callable each time, or re-iterate an iterable when it ends."""
    if callable(batches):
        while True:
            yield draw(batches)
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield draw(batch)
        if empty:
            raise ValueError(
                "batches is empty (or an exhausted iterator); pass a list, a "
                "DataLoader, or a callable that returns (inputs, targets)"
            )


def scalar(loss: torch.Tensor) -> float:
    """The loss as a Python float. Preflight runs before training, so this sync is fine."""
    return float(loss.detach().item())


def finite(x: float) -> bool:
    return math.isfinite(x)


def same(a: Any, b: Any) -> bool:
    """Exact equality of two (possibly nested) tensors or values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


def make_optimizer(
    name: str | Callable[..., torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    lr: float,
) -> torch.optim.Optimizer:
    """``"adam"``, ``"sgd"`` (momentum 0.9), or a factory ``f(params, lr=...)``."""
    params = list(params)
    if callable(name):
        return name(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(
        f"unknown optimizer {name!r}; use 'adam', 'sgd' or a factory f(params, lr=...)"
    )
