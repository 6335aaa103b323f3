"""The PNG of an lr range test: loss against learning rate, boundary and suggestion marked.

matplotlib is an optional extra (``pip install gradwatch[preflight]``). The
figure is drawn with the Agg canvas directly, never through pyplot, so the
caller's matplotlib backend and open figures are left alone.

Example::

    plot_lr_range(Path("lr.png"), lrs, losses, smoothed, boundary=0.3, suggested=0.03)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def plot_lr_range(
    path: Path,
    lrs: Sequence[float],
    losses: Sequence[float],
    smoothed: Sequence[float],
    boundary: float | None,
    suggested: float | None,
) -> Path:
    """Write the PNG to ``path`` (parent folders created) and return it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "the lr range plot needs matplotlib: pip install 'gradwatch[preflight]' "
            "(or pass plot=None)"
        ) from exc
    fig = Figure(figsize=(7.5, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    raw = [(lr, v) for lr, v in zip(lrs, losses, strict=True) if math.isfinite(v)]
    smooth = [(lr, v) for lr, v in zip(lrs, smoothed, strict=True) if math.isfinite(v)]
    if raw:
        ax.plot(*zip(*raw, strict=True), color="#9db4d0", linewidth=1, label="loss")
    if smooth:
        ax.plot(*zip(*smooth, strict=True), color="#1f4e8c", linewidth=2, label="smoothed loss")
        values = [v for _, v in smooth]
        low, high = min(values), max(values)
        pad = 0.1 * (high - low or abs(high) or 1.0)
        ax.set_ylim(low - pad, high + 3 * pad)
    if boundary is not None:
        ax.axvline(
            boundary, color="#c0392b", linestyle="--", label=f"instability boundary {boundary:.3g}"
        )
    if suggested is not None:
        ax.axvline(suggested, color="#1e8449", linewidth=2, label=f"suggested lr {suggested:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("training loss")
    ax.set_title("Learning-rate range test")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
