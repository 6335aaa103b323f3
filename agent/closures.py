"""Reading a step's gradients when the optimizer is given a closure that computes them.

``optimizer.step(closure)`` (LBFGS always, any optimizer optionally) calls the closure
inside the step: it zeroes the gradients, runs the forward and backward passes, and
returns the loss. The step pre-hook runs before that, so a read there sees the last
step's gradients, or none at all at the first step. So the pre-hook hands the step a
wrapped closure instead, and the read happens when the wrapped closure first
returns. That is still before any update: every torch optimizer evaluates its
closure before it moves the parameters, and LBFGS does so at the point it starts
from. Its later evaluations (LBFGS's line search and inner iterations) are not read.

If the step never calls the closure, nothing is read there, and ``log()`` reads the
gradients instead (agent/monitor.py).

Not every closure computes the step's gradients. Sharpness-aware minimisation (SAM)
is stepped with a closure *after* the loop's own backward pass: its step perturbs
the weights, calls the closure for the gradients there, then restores the weights
and updates. The gradients to report are the loop's, there at the pre-hook; the
closure's come after the weights moved. So the pre-hook reads at once when the
gradients have changed since the last closure step was logged (``GradMark``: a new
tensor, or the same one written again), and wraps the closure only when they have
not (LBFGS: the last step's leftovers, or none at the first). A loop that zeroes them
in place (``zero_grad(set_to_none=False)``) before an LBFGS step makes them look new:
zeros are read then, as before the wrapping existed.

Example::

    >>> read = []
    >>> args, kwargs = read_after_first_call(("opt", lambda: 1.5), {}, lambda: read.append(1))
    >>> closure = args[1]
    >>> closure(), closure(), read
    (1.5, 1.5, [1])
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch


class ReadAfterFirst:
    """A closure that runs ``read`` once, right after its first call returns."""

    __slots__ = ("_closure", "_read")

    def __init__(self, closure: Callable[[], Any], read: Callable[[], object]) -> None:
        self._closure = closure
        self._read: Callable[[], object] | None = read

    def __call__(self) -> Any:
        result = self._closure()
        read, self._read = self._read, None
        if read is not None:
            read()  # never raises: the monitor turns its own failures into a notice
        return result


def read_after_first_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], read: Callable[[], object]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The step's ``(args, kwargs)`` with its closure wrapped to ``read`` after its first
    call; None when the step has no closure. ``args[0]`` is the optimizer (torch's
    step-hook convention); the closure is ``args[1]`` or ``kwargs["closure"]``."""
    if len(args) > 1 and callable(args[1]):
        return (args[0], ReadAfterFirst(args[1], read), *args[2:]), kwargs
    closure = kwargs.get("closure")
    if callable(closure):
        return args, {**kwargs, "closure": ReadAfterFirst(closure, read)}
    return None


class GradMark:
    """The first gradient of the watched parameters as the last closure step ended: it
    tells a gradient the loop computed since (read it now) from that step's leftovers."""

    __slots__ = ("_index", "_ref", "_version")

    def __init__(self) -> None:
        self._index = -1
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._version = -1

    def note(self, params: Sequence[torch.Tensor]) -> None:
        """Mark the gradients as they are now (``log()`` of a step given a closure)."""
        self._index, self._ref = -1, None
        for i, p in enumerate(params):
            if p.grad is not None:
                self._index, self._ref, self._version = i, weakref.ref(p.grad), p.grad._version
                return

    def fresh(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether the loop computed gradients since the mark: a gradient there now that
        is not the marked tensor as it was (a weak reference: the mark keeps nothing)."""
        if self._ref is None:  # no closure step yet: any gradient is the loop's own
            return any(p.grad is not None for p in params)
        grad = params[self._index].grad if self._index < len(params) else None
        return grad is not None and (grad is not self._ref() or grad._version != self._version)
