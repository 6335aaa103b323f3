"""Whether the watched weights were written outside the optimizer, between two of its steps.

A training loop writes its parameters in one place: the optimizer's step. A write
anywhere else between one step's ``log()`` and the next step's optimizer pre-hook is a
checkpoint loaded, the model re-initialised (``model.apply(init)`` run again, a layer's
``reset_parameters()``), a cast or a move, or a write that corrupts it. The first two
undo days of training in one step and look like nothing to a loss rule: the loss goes
back to where it was at the start, or to where the checkpoint was, and falls again
(a re-initialised MLP went from 0.65 back to its starting 1.38 and relearned; nothing
fired). The collector reads what follows (rules/rewrites.py); the agent says when.

Each in-place write bumps a tensor's version counter, and a new storage changes its
data pointer. The fence reads both for the first and the last watched parameter (a load
or a re-initialisation writes them all; four attribute reads a step, no tensor
operation) at the end of ``log()`` and again in the next optimizer pre-hook.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> fence = WriteFence(tuple(layer.parameters()))
    >>> fence.close()
    >>> fence.crossed()
    False
    >>> fence.close()  # a step later
    >>> _ = layer.reset_parameters()
    >>> fence.crossed()
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class WriteFence:
    """The version counters and data pointers of two watched parameters at one moment."""

    __slots__ = ("_marks", "_params", "_previous", "_written", "names")

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str] = ()) -> None:
        self._params = (params[0], params[-1]) if params else ()
        self.names = (names[0], names[-1]) if len(names) == len(params) and names else ()
        self._marks: tuple[int, int, int, int] | None = None
        self._previous = False  # the last check found a write
        self._written: tuple[int, int, int, int] | None = None  # the marks before it

    def _read(self) -> tuple[int, int, int, int] | None:
        if not self._params:
            return None
        first, last = self._params
        return first._version, first.data_ptr(), last._version, last.data_ptr()

    def close(self) -> None:
        """Mark the weights as the optimizer left them (the end of ``log()``)."""
        self._marks = self._read()

    def crossed(self) -> bool:
        """Whether either parameter was written since :meth:`close`, after a step whose
        check found none; opens the fence (a write is reported once). A loop that writes
        its weights on every step by design (a max-norm constraint, WGAN's weight
        clipping, after its ``log()``) is reported once, at its first."""
        marks, self._marks = self._marks, None
        written = marks is not None and marks != self._read()
        first, self._previous = written and not self._previous, written
        if first:
            self._written = marks
        return first

    def written(self) -> tuple[str, ...]:
        """The names of the two parameters that the write :meth:`crossed` found changed."""
        now, then = self._read(), self._written
        if now is None or then is None or len(self.names) != 2:
            return ()
        return tuple(
            n for n, i in zip(self.names, (0, 2), strict=True) if now[i : i + 2] != then[i : i + 2]
        )
