"""Hooks the agent leaves on the user's objects, made safe to pickle and copy.

A hook registered on a module or optimizer lives in that object's hook
dictionaries, so ``torch.save(model)``, ``copy.deepcopy(model)`` or an EMA copy
pickle it along with the model. A bound method of the monitor cannot be
pickled (it drags in threads, sockets and locks), which made ``torch.save``
raise into the user's loop. :class:`Detached` wraps every such hook: it calls
through while the original object is watched, and pickles (or deep-copies) to
an :class:`Inert` hook that does nothing, so a copy or a reloaded model is
not watched and behaves exactly as the original unwatched model.

A model saved whole while watched therefore refers to
``gradwatch.agent.hooks.Inert``: load it where gradwatch is installed, or save
``model.state_dict()`` (which carries no hooks) as PyTorch recommends.

Example::

    >>> import copy, pickle, torch
    >>> from gradwatch.agent.hooks import Detached, Inert
    >>> model = torch.nn.Linear(2, 2)
    >>> calls = []
    >>> _ = model.register_forward_pre_hook(Detached(lambda m, args: calls.append(1)))
    >>> _ = model(torch.ones(1, 2))
    >>> copied = pickle.loads(pickle.dumps(model))
    >>> _ = copied(torch.ones(1, 2)); len(calls)
    1
    >>> isinstance(next(iter(copy.deepcopy(model)._forward_pre_hooks.values())), Inert)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Inert:
    """What a :class:`Detached` hook becomes in a pickled or copied object: returns None."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __reduce__(self) -> tuple[type[Inert], tuple[()]]:
        return (Inert, ())


class Detached:
    """Calls ``fn`` while registered on the watched object; pickles and copies to :class:`Inert`.

    ``compile_safe``: skip the call while ``torch.compile`` traces (the hook
    then runs only in eager code), for hooks that read the host clock: a
    traced clock read would be frozen into the graph as a constant.
    """

    __slots__ = ("_compile_safe", "_fn")

    def __init__(self, fn: Callable[..., Any], compile_safe: bool = False) -> None:
        self._fn = fn
        self._compile_safe = compile_safe

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compile_safe and torch.compiler.is_compiling():
            return None
        return self._fn(*args, **kwargs)

    def __reduce__(self) -> tuple[type[Inert], tuple[()]]:
        return (Inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Inert:
        return Inert()

    def __copy__(self) -> Inert:
        return Inert()
