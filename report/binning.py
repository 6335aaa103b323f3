"""Shrink per-layer and per-step series to what a page can draw, without hiding a spike.

A heatmap of every layer at every step is millions of SVG cells for a large
model (32 MB and 15 s in Chromium for 1,000 layers x 2,000 steps). Here rows
bin consecutive layers (model order) and columns bin consecutive steps, and a
cell keeps the **largest** value of its bin, so a one-step spike in one layer
stays as bright as it was; the smallest is kept too, for the hover text. Long
line series keep each bin's lowest and highest point for the same reason.

Example::

    cells = bin_max(norms, max_rows=40, max_columns=100)  # norms: layers x steps
    print(cells.shape, cells.high[0, 0], cells.rows[0])   # rows[0]: (first, last) layer index
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_ROWS = 40  # layer bins: at 10 px a row the heatmap stays about one screen tall
MAX_COLUMNS = 100  # step bins: about 7 px each across the plot
MAX_CELLS = MAX_ROWS * MAX_COLUMNS


@dataclass(frozen=True, slots=True)
class Cells:
    """A binned ``layers x steps`` matrix; every array is ``rows x columns``.

    ``high``/``low``: the largest/smallest finite value in the bin (NaN when the
    bin has none); ``broken``: the bin holds a non-finite measurement (+inf in
    the input); ``rows``/``columns``: each bin's (first, last) input index.
    """

    high: np.ndarray
    low: np.ndarray
    broken: np.ndarray
    rows: tuple[tuple[int, int], ...]
    columns: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), len(self.columns)


def edges(length: int, bins: int) -> np.ndarray:
    """Start index of each of ``min(bins, length)`` near-equal consecutive bins of ``length``."""
    count = max(1, min(bins, length))
    return np.linspace(0, length, count + 1).astype(np.int64)[:-1]


def bin_max(
    matrix: np.ndarray, *, max_rows: int = MAX_ROWS, max_columns: int = MAX_COLUMNS
) -> Cells:
    """Bin ``matrix`` into at most ``max_rows x max_columns`` cells.

    NaN in ``matrix`` means not measured, +inf measured non-finite.
    """
    if matrix.ndim != 2 or not matrix.size:
        raise ValueError(f"bin_max needs a non-empty 2-D matrix, got shape {matrix.shape}")
    row_starts, col_starts = edges(matrix.shape[0], max_rows), edges(matrix.shape[1], max_columns)
    finite = np.where(np.isfinite(matrix), matrix, np.nan)
    # fmax/fmin skip NaN, so a bin is NaN only when nothing in it was measured finite.
    high = np.fmax.reduceat(np.fmax.reduceat(finite, row_starts, axis=0), col_starts, axis=1)
    low = np.fmin.reduceat(np.fmin.reduceat(finite, row_starts, axis=0), col_starts, axis=1)
    inf = np.isinf(matrix).astype(np.uint8)
    broken = (
        np.maximum.reduceat(np.maximum.reduceat(inf, row_starts, axis=0), col_starts, axis=1) > 0
    )
    return Cells(
        high, low, broken, _spans(row_starts, matrix.shape[0]), _spans(col_starts, matrix.shape[1])
    )


def envelope(y: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of ``y`` to draw: all when few, else each bin's lowest and highest point, in order.

    Non-finite points are always kept: they are drawn as markers and are
    usually the point of the report.
    """
    if len(y) <= max_points:
        return np.arange(len(y))
    starts = edges(len(y), max(1, max_points // 2))
    finite = np.isfinite(y)
    low = np.where(finite, y, np.inf)
    high = np.where(finite, y, -np.inf)
    sizes = np.diff(np.append(starts, len(y)))
    owner = np.repeat(np.arange(len(starts)), sizes)
    # The position of each bin's min/max: sort by (bin, value) and take each bin's first entry.
    by_low = np.lexsort((low, owner))
    by_high = np.lexsort((-high, owner))
    keep = np.concatenate([by_low[starts], by_high[starts], np.flatnonzero(~finite)])
    return np.unique(keep)


def _spans(starts: np.ndarray, length: int) -> tuple[tuple[int, int], ...]:
    ends = np.append(starts[1:], length) - 1
    return tuple((int(a), int(b)) for a, b in zip(starts, ends, strict=True))
