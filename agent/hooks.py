"""Hooks the agent leaves on the user's objects, left out of every copy and saved file.

A hook registered on a module lives in that module's hook dictionaries, so
``torch.save(model)``, ``copy.deepcopy(model)`` or an EMA copy would carry it
along with the model. A bound method of the monitor cannot be pickled (it drags
in threads, sockets and locks), which made ``torch.save`` raise into the user's
loop; and a file naming any gradwatch class fails ``torch.load``'s default
``weights_only=True`` (torch >= 2.6) in a script that allowlists only its own
model classes, as pytorch/examples' word_language_model does when it reloads the
best model it saved whole.

So every module hook is registered through :func:`hook_module`: the module's
class pickles and copies without gradwatch's entries (a reducer in
``copyreg.dispatch_table``, which both ``pickle`` and ``copy`` consult; the class's
own ``__reduce_ex__`` does the rest), so a copy or a saved file is the unwatched
model, loadable where gradwatch is not installed. Every hook is also
:class:`Detached`, which pickles and copies to an :class:`Inert` no-op, for what
the reducer cannot reach (a class with its own non-dict state, a hook dict
pickled by itself); ``Inert`` is on torch's ``weights_only`` allowlist while
gradwatch is imported.

Example::

    >>> import copy, io, pickle, torch
    >>> from gradwatch.agent.hooks import Detached, hook_module
    >>> model = torch.nn.Linear(2, 2)
    >>> calls = []
    >>> _ = hook_module(model, Detached(lambda m, args: calls.append(1)))
    >>> _ = model(torch.ones(1, 2))
    >>> copied = pickle.loads(pickle.dumps(model))
    >>> _ = copied(torch.ones(1, 2)); len(calls), len(copied._forward_pre_hooks)
    (1, 0)
    >>> buf = io.BytesIO(); torch.save(model, buf); _ = buf.seek(0)
    >>> with torch.serialization.safe_globals([torch.nn.Linear]):
    ...     len(torch.load(buf)._forward_pre_hooks), len(model._forward_pre_hooks)
    (0, 1)
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

# The module attributes that hold hooks, and the per-hook flags torch keys by the
# same handle ids (unique across all of them).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


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


def hook_module(
    module: torch.nn.Module,
    hook: Detached,
    *,
    after: bool = False,
    prepend: bool = False,
    with_kwargs: bool = False,
) -> RemovableHandle:
    """Register ``hook`` as a forward pre-hook (``after``: a forward hook) on ``module``.

    A pickled, saved or copied ``module`` leaves it out (the module docstring).
    """
    _unwatched_when_copied(type(module))
    if after:
        return module.register_forward_hook(hook, prepend=prepend, with_kwargs=with_kwargs)
    return module.register_forward_pre_hook(hook, prepend=prepend, with_kwargs=with_kwargs)


def _unwatched_when_copied(cls: type) -> None:
    # A class that already has a reducer keeps it (its pickles then carry Inert hooks).
    if cls not in copyreg.dispatch_table:
        copyreg.pickle(cls, _reduce_unwatched)


def _reduce_unwatched(module: torch.nn.Module) -> Any:
    """What the class's own ``__reduce_ex__`` gives, less gradwatch's hooks in its state."""
    # Protocol 2: torch.save's, and what copy uses; the tuple is the same at any protocol.
    reduced = module.__reduce_ex__(2)
    if not isinstance(reduced, tuple) or len(reduced) < 3 or not isinstance(reduced[2], dict):
        return reduced
    state = reduced[2]
    ours = {
        key
        for name in _HOOK_DICTS
        if isinstance(hooks := state.get(name), dict)
        for key, hook in hooks.items()
        if isinstance(hook, (Detached, Inert))
    }
    if not ours:
        return reduced
    state = dict(state)
    for name in (*_HOOK_DICTS, *_HOOK_FLAGS):
        entries = state.get(name)
        if isinstance(entries, dict):
            # The same dict type (an OrderedDict): what weights_only loading accepts.
            state[name] = type(entries)((k, v) for k, v in entries.items() if k not in ours)
    return (reduced[0], reduced[1], state, *reduced[3:])


# A file saved by an older gradwatch, or through a path the reducer cannot reach,
# names Inert: let torch.load's default (weights_only) accept it while gradwatch is
# imported. Inert() takes no arguments and does nothing, so it admits no code.
torch.serialization.add_safe_globals([Inert])
