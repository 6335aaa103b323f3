"""Binning for the report: cells and points bounded whatever the size, spikes never averaged."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from gradwatch.report.binning import MAX_CELLS, bin_max, edges, envelope
from gradwatch.report.svg import MAX_POINTS, Line, line_chart


@pytest.mark.parametrize(
    ("layers", "steps"), [(1, 1), (6, 60), (39, 3), (1000, 2000), (10_007, 997)]
)
def test_cells_stay_bounded_and_cover_every_layer_and_step(layers: int, steps: int) -> None:
    cells = bin_max(np.ones((layers, steps)))
    rows, cols = cells.shape
    assert rows * cols <= MAX_CELLS
    assert (rows, cols) == (min(layers, 40), min(steps, 100))
    for spans, length in ((cells.rows, layers), (cells.columns, steps)):
        assert spans[0][0] == 0 and spans[-1][1] == length - 1
        assert all(
            b + 1 == c for (_, b), (c, _) in zip(spans, spans[1:], strict=False)
        )  # contiguous, no overlap
        sizes = [b - a + 1 for a, b in spans]
        assert max(sizes) - min(sizes) <= 1  # near-equal bins


def test_a_one_step_spike_in_one_layer_keeps_its_value() -> None:
    matrix = np.full((1000, 2000), 0.01)
    matrix[333, 500] = 5.0
    cells = bin_max(matrix)
    i = next(k for k, (a, b) in enumerate(cells.rows) if a <= 333 <= b)
    j = next(k for k, (a, b) in enumerate(cells.columns) if a <= 500 <= b)
    assert cells.high[i, j] == 5.0 and cells.low[i, j] == 0.01
    assert np.count_nonzero(cells.high == 5.0) == 1 and np.all(cells.low == 0.01)
    # What the old heatmap did, a mean of logs over the bin, all but erases it:
    rows, cols = cells.rows[i], cells.columns[j]
    block = matrix[rows[0] : rows[1] + 1, cols[0] : cols[1] + 1]
    assert 10 ** np.log10(block).mean() < 0.02


def test_not_measured_and_non_finite_bins() -> None:
    matrix = np.full((4, 4), np.nan)
    matrix[0, 0] = 1.0
    matrix[0, 1] = math.inf  # measured non-finite
    matrix[1, 2], matrix[1, 3] = 2.0, math.inf
    cells = bin_max(matrix, max_rows=2, max_columns=2)
    assert cells.rows == ((0, 1), (2, 3)) and cells.columns == ((0, 1), (2, 3))
    assert cells.broken.tolist() == [[True, True], [False, False]]
    assert cells.high[0, 0] == 1.0 and cells.high[0, 1] == 2.0  # inf is "broken", not a value
    assert np.isnan(cells.high[1]).all()  # nothing measured: a grey cell


def test_bin_max_refuses_an_empty_matrix() -> None:
    with pytest.raises(ValueError, match="non-empty 2-D"):
        bin_max(np.zeros((0, 5)))


def test_edges() -> None:
    assert edges(10, 3).tolist() == [0, 3, 6]
    assert edges(2, 5).tolist() == [0, 1]
    assert edges(0, 5).tolist() == [0]


def test_the_envelope_keeps_extremes_and_every_non_finite_point() -> None:
    y = np.sin(np.linspace(0, 20, 100_000))
    y[12_345] = 50.0
    y[54_321] = -50.0
    y[70_000:70_010] = np.nan
    keep = envelope(y, 3000)
    assert len(keep) <= 3000 + 10 and np.all(np.diff(keep) > 0)
    assert {12_345, 54_321} <= set(keep.tolist())
    assert set(range(70_000, 70_010)) <= set(keep.tolist())
    assert envelope(y[:50], 3000).tolist() == list(range(50))


def test_a_nan_run_that_never_recovers_is_one_marker_and_a_long_line_keeps_its_spike() -> None:
    steps = np.arange(1, 20_001)
    loss = np.full(len(steps), 2.0)
    loss[7_000] = 900.0  # one step: striding would drop it
    loss[15_000:] = np.nan
    svg = line_chart([Line(steps, loss, "train loss", "#000")], title="loss", y_label="loss")
    assert svg.count("<title>train loss = ") == 1  # the legend's nan/inf sample aside
    assert "train loss = nan at steps 15001–20000 (5000 points)" in svg
    top = re.findall(r'points="([^"]+)"', svg)[0].split()
    ys = [float(p.split(",")[1]) for p in top]
    assert min(ys) < 50 < max(ys)  # the 900 spike is drawn at the top of the plot, the 2.0s low
    assert len(top) <= MAX_POINTS
