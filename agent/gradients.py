"""Per-layer gradient L2 norms, read on the device with one fused call.

A :class:`GradReader` is built once, when the monitor attaches: it works out
which parameters are "layers" (the model's trainable parameters that the
optimizer updates, in ``model.named_parameters()`` order) and precomputes
everything the hot path would otherwise recompute each step. Reading is then
a list comprehension over ``p.grad``, one ``torch._foreach_norm`` and one
``torch.stack`` into a row of the device buffer: no host-device sync, no
per-layer kernel launches from Python.

Example::

    >>> import torch
    >>> from gradwatch.agent.gradients import GradReader
    >>> model = torch.nn.Linear(3, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> reader = GradReader.attach(model, opt)
    >>> reader.names
    ('weight', 'bias')
    >>> model(torch.ones(1, 3)).sum().backward()
    >>> row = torch.empty(2)  # one float32 per layer
    >>> reader.read_into(row)
    >>> bool((row > 0).all())
    True
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from gradwatch.agent.layout import DEFERRED_MAX_LAYERS

# torch.compile wraps the model; its parameters gain this prefix, which
# names nothing the user wrote.
_COMPILED_PREFIX = "_orig_mod."

# foreach_norm accumulates in the requested dtype; float32 for these is both
# exact enough and cheap. float64 refuses a narrowing dtype, so it is normed
# in its own precision and cast on the way into the row.
_FP32_ACCUMULABLE = frozenset({torch.float32, torch.float16, torch.bfloat16})


class NoLayersError(ValueError):
    """The optimizer updates none of the model's trainable parameters."""


@dataclass(frozen=True, slots=True)
class GradReader:
    """Reads the gradient norms of ``params`` into a preallocated row.

    ``names[i]`` is the layer whose norm lands in ``row[i]``. A parameter
    whose ``.grad`` is ``None`` this step gets ``0.0``: it received no
    gradient, which is information (a detached branch), not a missing value.
    """

    names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    device: torch.device
    # Indices of the float64 (or other non-float32-able) params, normed apart.
    wide: tuple[int, ...]
    # Params on a device other than ``device`` (model parallel in one process).
    multi_device: bool
    # DTensor params (FSDP2, tensor parallel): their norms are of the local
    # shard, which is what the wire carries; a DTensor norm would need a
    # collective to resolve.
    sharded: bool = False
    # None of the above: every step's read is one _foreach_norm and one stack.
    plain: bool = False
    # Plain, on a CPU, and small enough that its norms may wait for the shipper to stack
    # them (agent/layout.py: fill_norms, DEFERRED_MAX_LAYERS).
    deferrable: bool = False

    @classmethod
    def attach(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> GradReader:
        """Map the model's named trainable parameters to the optimizer's."""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names: list[str] = []
        params: list[torch.nn.Parameter] = []
        for name, param in model.named_parameters():
            if param.requires_grad and id(param) in in_optimizer:
                names.append(name.removeprefix(_COMPILED_PREFIX))
                params.append(param)
        if not params:
            raise NoLayersError(
                "the optimizer updates none of the model's trainable parameters; pass the "
                "model whose parameters this optimizer was built with"
            )
        device = params[0].device
        wide = tuple(i for i, p in enumerate(params) if p.dtype not in _FP32_ACCUMULABLE)
        multi = any(p.device != device for p in params)
        sharded = any(_is_dtensor(p) for p in params)
        plain = not (wide or multi or sharded)
        deferrable = plain and device.type == "cpu" and len(params) <= DEFERRED_MAX_LAYERS
        return cls(tuple(names), tuple(params), device, wide, multi, sharded, plain, deferrable)

    def read_into(self, row: torch.Tensor) -> None:
        """Write each layer's gradient L2 norm (float32) into ``row``, in order.

        ``row`` has exactly ``len(names)`` elements (the layer part of a
        buffer row, sliced once by the caller).
        """
        norms = self.norms()
        if norms is not None:
            torch.stack(norms, out=row)
            return
        self._write_norms([p.grad for p in self.params], row)

    def norms(self) -> tuple[torch.Tensor, ...] | None:
        """The fused read's per-layer norms as 0-d float32 tensors, not yet in a row.

        None when this step needs the general path of :meth:`read_into` (the reader
        is not plain, or a parameter has no gradient this step). On a CPU the norms
        are final when this returns, so a caller may stack them later, elsewhere.
        """
        if not self.plain:
            return None
        grads = [p.grad for p in self.params]
        # The usual case, on every step: what a bare fused read does, and one
        # test. foreach_norm refuses a None (no gradient this step) with a
        # TypeError before it does any work; the general path reads those as 0.
        try:
            # A None is caught below (the TypeError), so the list is typed as it comes.
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # type: ignore[arg-type]
        except TypeError:
            if not any(g is None for g in grads):
                raise
            return None
        return norms

    def read_weights_into(self, row: torch.Tensor) -> None:
        """Write each parameter's own L2 norm (of this rank's shard) into ``row``; no sync."""
        with torch.no_grad():  # called from the loop, where autograd would record the norms
            self._write_norms(list(self.params), row)

    def snapshot_weights(self) -> list[torch.Tensor]:
        """A copy of every parameter (of this rank's shard), queued in one fused call; no sync.

        Holds one copy of the trainable parameters until the caller drops it.
        """
        with torch.no_grad():
            return list(torch._foreach_mul(self._weights(), 1.0))

    def read_updates_into(self, before: list[torch.Tensor], row: torch.Tensor) -> None:
        """Write ``||w - before||`` per parameter into ``row``; overwrites ``before``; no sync."""
        with torch.no_grad():
            torch._foreach_sub_(before, self._weights())
            self._write_norms(list(before), row)

    def _weights(self) -> list[torch.Tensor]:
        return [local(p).detach() for p in self.params]

    def _write_norms(self, tensors: Sequence[torch.Tensor | None], row: torch.Tensor) -> None:
        if self.sharded:
            tensors = [None if t is None else local(t) for t in tensors]
        # A list comprehension, not ``None in tensors``: ``in`` would call
        # Tensor.__eq__(None) per tensor, ~16 us each.
        present = [t for t in tensors if t is not None]
        norms: Sequence[torch.Tensor]
        if self.wide or self.multi_device or len(present) != len(tensors):
            norms = self._norms_slow(tensors, row.device)
        else:
            norms = torch._foreach_norm(present, 2, dtype=torch.float32)
        # One kernel writes every norm (cast to the row's float32) in place.
        torch.stack(norms, out=row)

    def _norms_slow(
        self, grads: Sequence[torch.Tensor | None], device: torch.device
    ) -> list[torch.Tensor]:
        """Norms when some grads are absent, wide, or elsewhere: still no sync."""
        present = {i: g for i, g in enumerate(grads) if g is not None}
        narrow = [i for i in present if i not in self.wide]
        wide = [i for i in present if i in self.wide]
        out: list[torch.Tensor] = [_zero(device)] * len(grads)
        if narrow:
            normed = torch._foreach_norm([present[i] for i in narrow], 2, dtype=torch.float32)
            for i, n in zip(narrow, normed, strict=True):
                out[i] = n
        if wide:
            for i, n in zip(wide, torch._foreach_norm([present[i] for i in wide], 2), strict=True):
                out[i] = n  # float64 here; stack casts it into the float32 row
        if self.multi_device:
            # A device-to-device copy, queued; it does not wait for the host.
            out = [n.to(device, non_blocking=True) for n in out]
        return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (FSDP2, tensor parallel), else ``t``."""
    if _is_dtensor(t):
        # DTensor is a Tensor subclass torch types apart; to_local is its own method.
        shard: torch.Tensor = cast(Any, t).to_local()
        return shard
    return t


def _is_dtensor(t: object) -> bool:
    # No DTensor can exist unless its module was imported, so a plain run
    # never imports torch.distributed for this check.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zero(device: torch.device) -> torch.Tensor:
    """A cached 0-d float32 zero on ``device``; created once, never synced."""
    zero = _ZEROS.get(device)
    if zero is None:
        zero = _ZEROS[device] = torch.zeros((), dtype=torch.float32, device=device)
    return zero
