"""Robust statistics over short series, shared by the loss detectors and the diagnosis.

Losses are noisy and heavy-tailed (a hard batch, a bad shard), so every
comparison here is between medians, with a noise scale from the median
absolute deviation, never between single values or plain means.

Example::

    sigma = robust_sigma(np.array(recent_losses))
    verdict = flat_since_start(first, head, tail, tolerance=0.02, z=3.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradwatch.rules.growth import fit_line

MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation
MEDIAN_SE = 1.2533  # standard error of a median is ~ this * sigma / sqrt(n) (normal noise)


def robust_sigma(values: np.ndarray) -> float:
    """Noise scale of ``values`` from their median absolute deviation (0 for a constant series)."""
    if values.size == 0:
        return 0.0
    return MAD_TO_SIGMA * float(np.median(np.abs(values - np.median(values))))


def median_se(sigma: float, n: int) -> float:
    """Standard error of the median of ``n`` values with noise ``sigma``."""
    return MEDIAN_SE * sigma / math.sqrt(max(n, 1))


@dataclass(frozen=True, slots=True)
class Flatness:
    """How far the loss has moved since the start, with the noise that blurs it."""

    flat: bool
    first: float  # median of the very first losses
    head: float  # median of the first window
    tail: float  # median of the latest window
    change: float  # (head - tail) / |head|: positive when the loss went down
    bound: float  # largest relative change the noise cannot rule out


def flat_since_start(
    first: Sequence[float], head: Sequence[float], tail: Sequence[float], tolerance: float, z: float
) -> Flatness:
    """Has the loss stayed within ``tolerance`` (relative) of where it started?

    Flat only when the evidence *resolves* it: the change between the first
    window and the latest, plus ``z`` standard errors of that difference, is
    within ``tolerance`` of the starting level, and the very first losses
    were not higher either (a run that learned in its first steps then
    converged is not a dead pipeline). A noisy loss whose trend the windows
    cannot resolve is never called flat.
    """
    f, h, t = (np.asarray(x, dtype=np.float64) for x in (first, head, tail))
    level_first, level_head, level_tail = (float(np.median(x)) for x in (f, h, t))
    sigma = max(robust_sigma(h), robust_sigma(t))
    scale = max(abs(level_head), 1e-12)
    se = MEDIAN_SE * sigma * math.sqrt(1.0 / h.size + 1.0 / t.size)
    bound = (abs(level_head - level_tail) + z * se) / scale
    se_first = MEDIAN_SE * sigma * math.sqrt(1.0 / f.size + 1.0 / t.size)
    dropped_early = (level_first - level_tail) > tolerance * max(
        abs(level_first), 1e-12
    ) + z * se_first
    flat = bound <= tolerance and not dropped_early
    return Flatness(
        flat, level_first, level_head, level_tail, (level_head - level_tail) / scale, bound
    )


def slope_t(values: Sequence[float]) -> float:
    """t statistic of the least-squares slope of ``values`` against their index.

    Negative when the series falls; its size says how many standard errors the
    slope is from zero (a straight line is +-inf, fewer than 3 values or a flat
    series 0). Used to tell a steady trend from noise over a short series.
    """
    y = np.asarray(values, dtype=np.float64)
    if y.size < 3:
        return 0.0
    slope, r2 = fit_line(np.arange(y.size, dtype=np.float64), y)
    if r2 >= 1.0:
        return math.copysign(math.inf, slope) if slope else 0.0
    return math.copysign(math.sqrt(r2 * (y.size - 2) / (1.0 - r2)), slope)


def trending_up(values: Sequence[float], factor: float, min_r2: float = 0.5) -> bool:
    """A sustained rise: the last third's median is ``factor`` times the first third's,
    and log(values) rises along a line that explains at least ``min_r2`` of its variance.
    """
    y = np.asarray(values, dtype=np.float64)
    y = y[np.isfinite(y) & (y > 0)]
    if y.size < 9:
        return False
    third = y.size // 3
    if float(np.median(y[-third:])) < factor * float(np.median(y[:third])):
        return False
    slope, r2 = fit_line(np.arange(y.size, dtype=np.float64), np.log(y))
    return slope > 0 and r2 >= min_r2
