"""Activation statistics worked out on the host, from the samples the hooks copied.

An activation hook (agent/activations.py) copies a strided sample of its
module's output into its row of one device buffer and writes the sample's
length; it computes nothing (each tensor operation costs 10-70 us in a forward
pass on the training thread). When the sample ships, the buffer is copied to
the host in one call (agent/hostpart.py) and :meth:`ActCopy.values` works out,
on the shipper thread, every module's mean, (population) std and share at
once. A softmax is measured by whole rows inside its hook (its share counts
rows, not elements) and only its std is finished here.

The share per family (thresholds and their sources in agent/activations.py):
exact zeros (ReLU, ReLU6); ``|y| > TANH_SATURATED`` (Tanh); within
``SIGMOID_MARGIN`` of 0 or 1 (Sigmoid); the flat negative tail
``f(cut) < y <= 0`` (GELU, SiLU: *dead*).

Example::

    >>> import torch
    >>> from gradwatch.agent.actstats import ActLayout
    >>> layout = ActLayout(width=3, rows=[(0, 2, "relu")], softmax=[], sample=4)
    >>> buf = torch.zeros(layout.size)
    >>> buf[layout.width] = 3  # the row's length: three values sampled
    >>> buf[layout.width + 1 :][:3] = torch.tensor([0.0, 2.0, 4.0])
    >>> [round(v, 3) for v in layout.finish(buf).tolist()]
    [2.0, 1.633, 0.333]
"""

from __future__ import annotations

import math

import torch

from gradwatch.agent.hostpart import HostCopy
from gradwatch.agent.layout import MISSING_I32, fill_missing

# Tanh |y| above this, or Sigmoid y within this of 0 or 1, counts as saturated.
TANH_SATURATED = 0.99
SIGMOID_MARGIN = 0.01
# GELU and SiLU are "dead" below these inputs, i.e. for outputs in (f(cut), 0]:
# the slope there is under ~1.2% of the linear regime's (agent/activations.py).
GELU_DEAD_INPUT = -3.0
SILU_DEAD_INPUT = -6.0
GELU_DEAD_OUTPUT = GELU_DEAD_INPUT * 0.5 * (1.0 + math.erf(GELU_DEAD_INPUT / math.sqrt(2.0)))
SILU_DEAD_OUTPUT = SILU_DEAD_INPUT / (1.0 + math.exp(-SILU_DEAD_INPUT))
# The shipper thread works on at most this many elements per tensor operation: under
# torch's parallel grain (32,768), so none opens an OpenMP team from the agent's own
# thread (a team per thread stays in the process; it made an unrelated test's timing
# fail in the suite, tests/security/test_security_http_bounds.py).
SERIAL_ELEMENTS = 1 << 14


def hits(kind: str, x: torch.Tensor) -> torch.Tensor:
    """Where ``x`` counts toward its family's share (a bool tensor like ``x``)."""
    if kind in ("relu", "relu6"):
        return x == 0
    if kind == "tanh":
        return x.abs() > TANH_SATURATED
    if kind == "sigmoid":
        return (x < SIGMOID_MARGIN) | (x > 1.0 - SIGMOID_MARGIN)
    cut = GELU_DEAD_OUTPUT if kind == "gelu" else SILU_DEAD_OUTPUT  # gelu, silu
    return (x > cut) & (x <= 0.0)


class ActLayout:
    """Where each module's statistics and sample live in the hooks' device buffer.

    The buffer: ``width`` statistic cells (a softmax's mean, mean of squares and
    share, written by its hook; MISSING for the others until finished), one
    length per sampled module (0: it did not run), then a row of ``sample``
    values per sampled module.
    """

    def __init__(
        self,
        width: int,
        rows: list[tuple[int, int | None, str]],
        softmax: list[int],
        sample: int,
        device: torch.device | None = None,
    ) -> None:
        """``rows``: per sampled module, (its mean's cell, its share's cell or None,
        its family); ``softmax``: the mean's cell of each softmax module; ``device``:
        where the buffers it finishes live (None: a host copy, finished on the shipper
        thread a few rows at a time, see SERIAL_ELEMENTS)."""
        self._args = (width, rows, softmax, sample)
        self.width, self.sample, self.n_rows = width, sample, len(rows)
        self.size = width + self.n_rows * (1 + sample)
        per_pass = max(1, self.n_rows if device is not None else SERIAL_ELEMENTS // sample)
        self._passes = [
            _Pass(first, rows[first : first + per_pass], device)
            for first in range(0, self.n_rows, per_pass)
        ]
        self._soft_mean_at = torch.tensor(softmax, dtype=torch.long, device=device)
        self._soft_square_at = self._soft_mean_at + 1
        self._positions = torch.arange(sample, dtype=torch.float32, device=device)
        self.device = self._positions.device

    def on_host(self) -> ActLayout:
        """The same layout for a host copy of the buffer."""
        return ActLayout(*self._args)

    def finish(self, buf: torch.Tensor) -> torch.Tensor:
        """The statistics from the buffer (on this layout's device): [mean, std(, share)]
        per module in column order, MISSING for a module that did not run; no sync."""
        out = buf[: self.width].clone()
        if self._soft_mean_at.numel():
            mean, square = out[self._soft_mean_at], out[self._soft_square_at]
            std = (square - mean * mean).clamp_min_(0.0).sqrt_()
            ran = square.view(torch.int32) != MISSING_I32  # MISSING, not a computed NaN
            out[self._soft_square_at] = torch.where(ran, std, square)
        lengths = buf[self.width : self.width + self.n_rows]
        rows = buf[self.width + self.n_rows :].view(self.n_rows, self.sample)
        for part in self._passes:
            part.finish(rows, lengths, self._positions, out)
        return out


class _Pass:
    """A run of consecutive rows finished together, and where their statistics go."""

    def __init__(
        self, first: int, rows: list[tuple[int, int | None, str]], device: torch.device | None
    ) -> None:
        self.first, self.stop = first, first + len(rows)
        self.mean_at = torch.tensor([m for m, _, _ in rows], dtype=torch.long, device=device)
        self.std_at = self.mean_at + 1
        # Per family with a share: its rows (within the run) and their share cells.
        by_kind: dict[str, tuple[list[int], list[int]]] = {}
        for r, (_, share, kind) in enumerate(rows):
            if share is not None:
                by_kind.setdefault(kind, ([], []))[0].append(r)
                by_kind[kind][1].append(share)
        self.shares = [
            (
                kind,
                torch.tensor(rs, dtype=torch.long, device=device),
                torch.tensor(at, dtype=torch.long, device=device),
            )
            for kind, (rs, at) in by_kind.items()
        ]

    def finish(
        self,
        all_rows: torch.Tensor,
        all_lengths: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        rows, lengths = all_rows[self.first : self.stop], all_lengths[self.first : self.stop]
        valid = positions < lengths[:, None]
        x = torch.where(valid, rows, 0.0)
        n = lengths.clamp_min(1.0)
        mean = x.sum(1) / n
        std = ((x * x).sum(1) / n - mean * mean).clamp_min_(0.0).sqrt_()
        ran = lengths > 0
        out[self.mean_at] = torch.where(ran, mean, out[self.mean_at])
        out[self.std_at] = torch.where(ran, std, out[self.std_at])
        for kind, at_rows, share_at in self.shares:
            counted = (hits(kind, rows[at_rows]) & valid[at_rows]).sum(1, dtype=torch.float32)
            share = counted / n[at_rows]
            out[share_at] = torch.where(ran[at_rows], share, out[share_at])


class ActCopy:
    """One sample's activation buffer on its way to the host (agent/hostpart.py)."""

    def __init__(self, layout: ActLayout, copy: HostCopy) -> None:
        self._layout, self._copy = layout, copy
        self.width = layout.width

    def values(self) -> torch.Tensor:
        return self._layout.finish(self._copy.wait())


def missing_buffer(buf: torch.Tensor, layout: ActLayout) -> None:
    """Start a sample: every statistic MISSING, every row not run (length 0)."""
    fill_missing(buf[: layout.width])
    buf[layout.width : layout.width + layout.n_rows].zero_()
