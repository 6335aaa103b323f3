"""How an activation hook samples a module's output without copying it.

A hook (agent/activations.py) measures about ``SAMPLE`` evenly strided elements of
an output, whatever its size and layout: a view where the output is dense in some
dimension order, an index gather at storage offsets otherwise (a slice), never a
copy of the whole output. The stride is odd, so with the usual power-of-two widths
the sample cycles through every hidden unit instead of a fixed subset.

Example::

    >>> import torch
    >>> from gradwatch.agent.actsample import sample_of, stride
    >>> stride(100_000), sample_of(torch.arange(100_000.0)).numel()
    (13, 7693)
    >>> sample_of(torch.arange(12.0).view(3, 4).t()).tolist()[:4]  # small: whole
    [0.0, 4.0, 8.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Outputs larger than this are measured on a strided sample of about this size. A
# share estimated from 8,192 values has a standard error under 0.6% (p = 0.5), against
# thresholds of 0.5-0.9 over healthy floors of 0.02 or less (rules/default.yaml), and a
# hook on the GPT benchmark's (8, 128, 1024) GELU output costs ~134 us of CPU instead
# of ~388 us at 65,536 (it was that until 2026-12-03; benchmarks/activation_cost.py).
SAMPLE = 1 << 13


def stride(n: int, sample: int = SAMPLE) -> int:
    """An odd step that samples about ``sample`` of ``n`` elements (or rows)."""
    step = -(-n // sample)
    return step + 1 - step % 2


def sample_of(y: torch.Tensor) -> torch.Tensor:
    """Every ``stride(n)``-th element of ``y`` in its flat (row-major) order, as a 1-D tensor.

    Never a copy of the whole output, where ``reshape(-1)`` of a non-contiguous output
    copied all of it (an activation-sized temporary per hooked module: 4 MiB for a
    4 MiB transposed output). A contiguous ``y`` gives a strided view; a dense one in
    another dimension order (transposed, channels-last) is read in its memory order, also
    a view (the same evenly strided sample, in another order); any other (a slice) gathers
    the elements by index: index temporaries of a few times the sample, never the output.
    """
    n = y.numel()
    if n <= SAMPLE:
        return y.reshape(-1)  # at most SAMPLE elements copied
    step = stride(n)
    if not y.is_contiguous():
        order = sorted(range(y.dim()), key=lambda d: y.stride(d), reverse=True)
        dense = y.permute(order)
        if not dense.is_contiguous():
            return _gather(y, n, step)
        y = dense
    return y.view(-1)[::step]


def _gather(y: torch.Tensor, n: int, step: int) -> torch.Tensor:
    """Flat positions 0, step, 2 * step, ... < n of a non-dense ``y``, read at their storage
    offsets: three index vectors of the sample's length whatever ``y``'s rank (indexing by
    ``unravel_index`` held one per dimension and more: 7 MiB for a 7-d slice)."""
    return storage_view(y).index_select(0, offsets(y.shape, y.stride(), n, step, y.device))


def offsets(
    shape: tuple[int, ...], strides: tuple[int, ...], n: int, step: int, device: torch.device
) -> torch.Tensor:
    """Storage offsets (from the tensor's own) of flat positions 0, step, ... < n of ``shape``."""
    idx = torch.arange(0, n, step, device=device)
    offset = torch.zeros_like(idx)
    part = torch.empty_like(idx)
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        torch.remainder(idx, size, out=part)
        offset.add_(part, alpha=stride)
        idx.div_(size, rounding_mode="floor")
    return offset


def storage_view(y: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage ``y`` spans, from its first element (no copy)."""
    span = sum((size - 1) * stride for size, stride in zip(y.shape, y.stride(), strict=True))
    return y.as_strided((span + 1,), (1,))  # keeps y's storage offset


# ``activation_modules={"*.w1": "pre:silu"}``: the module's output is what an activation
# called as a function then takes (LLaMA's SwiGLU: w2(F.silu(w1(x)) * w3(x)), where no
# layer's input is the SiLU's output). Its sample is passed through the activation, so
# the statistics are those of the activation's output, as for a module of that kind.
PRE = "pre:"
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "relu6": lambda x: torch.clamp(x, 0.0, 6.0),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
}
PRE_KINDS = tuple(PRE + kind for kind in _ACTIVATIONS)


def activated(kind: str, x: torch.Tensor) -> torch.Tensor:
    """The activation ``kind`` of a sample of its pre-activations (float32, a new tensor)."""
    return _ACTIVATIONS[kind](x.float())
