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

Example::

    >>> read = []
    >>> args, kwargs = read_after_first_call(("opt", lambda: 1.5), {}, lambda: read.append(1))
    >>> closure = args[1]
    >>> closure(), closure(), read
    (1.5, 1.5, [1])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
