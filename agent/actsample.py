"""How an activation hook samples and measures a module's output without copying it.

A hook (agent/activations.py) measures about ``SAMPLE`` evenly strided elements of
an output, whatever its size and layout: a view where the output is dense in some
dimension order, an index gather at storage offsets otherwise (a slice), never a
copy of the whole output. The stride is odd, so with the usual power-of-two widths
the sample cycles through every hidden unit instead of a fixed subset.
:func:`measure` copies that sample into the module's row (the host works it out);
:func:`measure_rows` reads a softmax by whole rows, about ``ROW_SAMPLE`` elements.

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


# A softmax is sampled by whole rows, and its share counts rows: about this many
# elements of them (512 rows of 128), so the share of one-hot rows keeps a standard
# error near 2% instead of the 6% of 64 rows.
ROW_SAMPLE = 1 << 16
# An attention row whose largest probability is above this attends to one position.
SOFTMAX_SATURATED = 0.99
# A softmax's slots in the values vector: all of them, its mean, its mean of squares
# (a std once finished, agent/actstats.py) and its share of one-hot rows.
Cells = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
# Any other module's row of the sample buffer and its length cell.
Row = tuple[torch.Tensor, torch.Tensor]


def measure(y: torch.Tensor, row: Row, pre: str | None = None) -> None:
    """Copy a strided sample of ``y`` into the module's row and write its length; no
    sync, no arithmetic (agent/actstats.py does it on the host). ``pre``: ``y`` is the
    input of that activation kind, applied to the sample first (actsample.PRE)."""
    values, length = row
    x = sample_of(y)
    if pre is not None:
        x = activated(pre, x)
    n = x.numel()
    values[:n].copy_(x)  # one strided read, cast to float32
    length.fill_(n)  # numel is shape metadata: no sync


def measure_rows(y: torch.Tensor, dim: int | None, cells: Cells) -> None:
    """Write [mean, mean of squares, share of rows with max > SOFTMAX_SATURATED] over whole
    softmax rows into ``cells``; no sync."""
    span, mean, square, share = cells
    if dim is None:  # nn.Softmax() without dim: torch's legacy choice of axis
        dim = 0 if y.dim() in (0, 1, 3) else 1
    rows = y.movedim(dim, -1) if dim not in (-1, y.dim() - 1) else y  # a view
    width = rows.shape[-1]
    n = rows.numel()
    if n > ROW_SAMPLE and rows.dim() > 1:
        # Every stride(n)-th row, gathered by index when the rows are not contiguous
        # (``dim`` not the last, or a strided output): no copy of the whole output.
        step = stride(n, ROW_SAMPLE)
        if rows.is_contiguous():
            rows = rows.view(-1, width)[::step]
        else:
            starts = offsets(rows.shape[:-1], rows.stride()[:-1], n // width, step, rows.device)
            cols = torch.arange(width, device=rows.device) * rows.stride(-1)
            at = (starts[:, None] + cols).view(-1)
            rows = storage_view(rows).index_select(0, at).view(-1, width)
    x = rows.reshape(-1, width).float()  # the sample's rows (one whole row at least)
    flat = x.reshape(-1)
    torch.sum(flat, 0, out=mean)
    torch.dot(flat, flat, out=square)
    span[:2].div_(flat.numel())
    assert share is not None  # a softmax always has its share (_frac_stat)
    torch.sum(x.amax(dim=-1) > SOFTMAX_SATURATED, 0, dtype=torch.float32, out=share)
    share.div_(x.shape[0])
