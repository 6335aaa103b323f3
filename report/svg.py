"""Inline SVG charts for the post-mortem: line charts (linear or log y) and a log heatmap.

Plain strings, no JavaScript and nothing fetched: the report must open from a
file on a machine with no network. Non-finite values break a line and are
drawn as red triangles on the top edge, because a NaN loss is usually the
point of the report.

Example::

    svg = line_chart([Line(steps, loss, "train loss", "#1f4e8c")], title="loss", y_label="loss",
                     markers=[Marker(37, "A1", "#c0392b", "NonFiniteLoss")])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

import numpy as np

from gradwatch.report.binning import Cells, envelope

WIDTH = 1040
FONT = "font-family:inherit"
GRID = "#e3e6ea"
AXIS = "#5f6b7a"
NONFINITE = "#c0392b"
MAX_POINTS = 3000  # a longer line keeps each bin's lowest and highest point (binning.envelope)
# Viridis stops: perceptually uniform and readable by most colour-blind readers.
VIRIDIS = (
    (68, 1, 84),
    (72, 40, 120),
    (62, 74, 137),
    (49, 104, 142),
    (38, 130, 142),
    (31, 158, 137),
    (53, 183, 121),
    (110, 206, 88),
    (181, 222, 43),
    (253, 231, 37),
)


@dataclass(frozen=True, slots=True)
class Line:
    """One series: x and y of equal length; NaN/inf in ``y`` are gaps, marked on the top edge."""

    x: Sequence[float] | np.ndarray
    y: Sequence[float] | np.ndarray
    label: str
    color: str
    dashed: bool = False
    dots: bool = False


@dataclass(frozen=True, slots=True)
class Marker:
    """A vertical line at ``x`` (an alert's step) with a short ``label`` and a hover ``title``."""

    x: float
    label: str
    color: str
    title: str = ""


@dataclass(frozen=True, slots=True)
class _Frame:
    left: float
    top: float
    width: float
    height: float
    x0: float
    x1: float
    y0: float
    y1: float
    log_y: bool

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * self.width

    def py(self, y: float) -> float:
        v = math.log10(y) if self.log_y else y
        return self.top + self.height - (v - self.y0) / (self.y1 - self.y0) * self.height


def fmt(value: float) -> str:
    """A number for a label: 3 significant digits, non-finite spelled out."""
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return f"{value:.3g}"


def line_chart(
    lines: Sequence[Line],
    *,
    title: str,
    y_label: str,
    log_y: bool = False,
    markers: Sequence[Marker] = (),
    x_label: str = "step",
    width: int = WIDTH,
    height: int = 250,
    y_range: tuple[float, float] | None = None,
) -> str:
    """An SVG line chart; empty ``lines`` (or no finite value) gives a "not recorded" box."""
    xs = (
        np.concatenate([np.asarray(line.x, dtype=np.float64) for line in lines])
        if lines
        else np.zeros(0)
    )
    ys = (
        np.concatenate([np.asarray(line.y, dtype=np.float64) for line in lines])
        if lines
        else np.zeros(0)
    )
    usable = np.isfinite(ys) & ((ys > 0) if log_y else True)
    if not usable.any():
        return not_recorded(title, width)
    x0, x1 = float(xs.min()), float(xs.max())
    for marker in markers:
        x0, x1 = min(x0, marker.x), max(x1, marker.x)
    x1 = x1 if x1 > x0 else x0 + 1
    y0, y1 = _y_domain(ys[usable], log_y, y_range)
    frame = _Frame(70, 34, width - 90, height - 70, x0, x1, y0, y1, log_y)
    parts = [_open(width, height, title), _grid(frame, log_y)]
    for line in lines:
        parts.append(_polyline(frame, line))
    parts += [_marker(frame, m) for m in markers]
    parts.append(_legend(frame, lines))
    parts.append(
        f'<text x="{frame.left + frame.width / 2:.0f}" y="{height - 6}" text-anchor="middle" '
        f'class="axis-label">{escape(x_label)}</text>'
    )
    parts.append(
        f'<text transform="translate(14 {frame.top + frame.height / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle" class="axis-label">{escape(y_label)}</text>'
    )
    parts.append("</svg>")
    return "\n".join(parts)


def heatmap(
    cells: Cells, steps: np.ndarray, names: Sequence[str], *, title: str, width: int = WIDTH
) -> str:
    """Binned ``cells`` (rows: runs of ``names``, columns: runs of ``steps``) in log10 colour.

    A cell is coloured by its bin's largest value; hovering shows the layers,
    steps, largest and smallest values it covers.
    """
    positive = np.isfinite(cells.high) & (cells.high > 0)
    if not (positive.any() or cells.broken.any()):
        return not_recorded(title, width)
    logs = np.log10(np.where(positive, cells.high, 1.0))
    lo, hi = (
        (math.floor(float(logs[positive].min())), math.ceil(float(logs[positive].max())))
        if positive.any()
        else (0, 1)
    )
    hi = hi if hi > lo else lo + 1
    labels = [_row_label(names, a, b) for a, b in cells.rows]
    label_chars = min(36, max(len(label) for label in labels))
    left = 16 + 6.6 * label_chars
    n_rows, n_cols = cells.shape
    row = max(4.0, min(18.0, 420.0 / n_rows))
    plot_w = width - left - 90
    height = int(34 + row * n_rows + 44)
    col_w = plot_w / n_cols
    parts = [_open(width, height, title), '<g class="cells">']
    for i, (a, b) in enumerate(cells.rows):
        y = 34 + i * row
        who = names[a] if a == b else f"{names[a]} … {names[b]} ({b - a + 1} layers)"
        for j, (s0, s1) in enumerate(cells.columns):
            tip = f"{who}, steps {int(steps[s0])}–{int(steps[s1])}: "
            if cells.broken[i, j]:
                color, tip = NONFINITE, tip + "non-finite"
            elif math.isnan(cells.high[i, j]):
                color, tip = "#d9dce1", tip + "not measured"
            else:
                color = _viridis((logs[i, j] - lo) / (hi - lo)) if positive[i, j] else _viridis(0.0)
                tip += f"max {fmt(cells.high[i, j])}, min {fmt(cells.low[i, j])}"
            parts.append(
                f'<rect x="{left + j * col_w:.1f}" y="{y:.1f}" width="{col_w + 0.6:.1f}" '
                f'height="{row + 0.3:.1f}" fill="{color}"><title>{escape(tip)}</title></rect>'
            )
    parts.append("</g>")
    for i, label in enumerate(labels):
        if row >= 9 or i % math.ceil(9 / row) == 0:
            shown = label if len(label) <= label_chars else "…" + label[-(label_chars - 1) :]
            parts.append(
                f'<text x="{left - 6:.0f}" y="{34 + i * row + row / 2 + 4:.1f}" text-anchor="end" '
                f'class="tick">{escape(shown)}</text>'
            )
    bottom = 34 + row * n_rows
    for j in _tick_columns(n_cols):
        parts.append(
            f'<text x="{left + (j + 0.5) * col_w:.1f}" y="{bottom + 16:.0f}" text-anchor="middle" '
            f'class="tick">{int(steps[cells.columns[j][0]])}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 6}" text-anchor="middle" '
        'class="axis-label">step</text>'
    )
    parts.append(_colour_bar(width - 70, 34, min(220.0, bottom - 34), lo, hi))
    parts.append("</svg>")
    return "\n".join(parts)


def not_recorded(title: str, width: int = WIDTH, why: str = "not recorded in this trace") -> str:
    """A small placeholder panel for a signal the trace does not hold."""
    return (
        f'{_open(width, 70, title)}<rect x="1" y="28" width="{width - 2}" height="38" rx="6" '
        f'fill="#f5f6f8" stroke="{GRID}"/><text x="{width / 2:.0f}" y="52" text-anchor="middle" '
        f'class="muted">{escape(why)}</text></svg>'
    )


# ---------------------------------------------------------------- pieces


def _open(width: int, height: int, title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="{escape(title)}"><text x="0" y="16" class="chart-title">'
        f"{escape(title)}</text>"
    )


def _y_domain(
    values: np.ndarray, log_y: bool, fixed: tuple[float, float] | None
) -> tuple[float, float]:
    if fixed is not None:
        return (math.log10(fixed[0]), math.log10(fixed[1])) if log_y else fixed
    if log_y:
        lo, hi = math.floor(math.log10(values.min())), math.ceil(math.log10(values.max()))
        return float(lo), float(hi if hi > lo else lo + 1)
    low, high = float(values.min()), float(values.max())
    pad = 0.06 * (high - low) if high > low else (abs(high) * 0.1 or 1.0)
    return low - pad, high + pad


def _grid(frame: _Frame, log_y: bool) -> str:
    parts = [
        (
            f'<rect x="{frame.left}" y="{frame.top}" width="{frame.width}" height="{frame.height}" '
            f'fill="#fff" stroke="{GRID}"/>'
        )
    ]
    if log_y:
        span = int(frame.y1 - frame.y0)
        every = max(1, math.ceil(span / 6))
        ticks = [(10.0**d, f"1e{d}") for d in range(int(frame.y0), int(frame.y1) + 1, every)]
        if span <= 2:  # two decades or fewer: label 2x and 5x too, or the axis has two ticks
            ticks += [
                (m * 10.0**d, fmt(m * 10.0**d))
                for d in range(int(frame.y0), int(frame.y1))
                for m in (2, 5)
            ]
    else:
        ticks = [(t, fmt(t)) for t in _nice_ticks(frame.y0, frame.y1)]
    for value, label in ticks:
        y = frame.py(value)
        parts.append(
            f'<line x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{GRID}"/><text x="{frame.left - 6}" y="{y + 4:.1f}" text-anchor="end" '
            f'class="tick">{label}</text>'
        )
    for value in _nice_ticks(frame.x0, frame.x1):
        x = frame.px(value)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{frame.top + frame.height}" '
            f'stroke="{GRID}"/><text x="{x:.1f}" y="{frame.top + frame.height + 16:.0f}" '
            f'text-anchor="middle" class="tick">{fmt(value)}</text>'
        )
    return "\n".join(parts)


def _nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step) + 1)]


def _polyline(frame: _Frame, line: Line) -> str:
    x = np.asarray(line.x, dtype=np.float64)
    y = np.asarray(line.y, dtype=np.float64)
    if len(x) > MAX_POINTS:
        keep = envelope(y, MAX_POINTS)
        x, y = x[keep], y[keep]
    ok = np.isfinite(y) & ((y > 0) if frame.log_y else True)
    dash = ' stroke-dasharray="6 4"' if line.dashed else ""
    parts: list[str] = []
    for segment in _runs(ok):
        points = " ".join(
            f"{frame.px(a):.1f},{frame.py(b):.1f}"
            for a, b in zip(x[segment], y[segment], strict=True)
        )
        if line.dots or len(segment) == 1:
            parts += [
                f'<circle cx="{frame.px(a):.1f}" cy="{frame.py(b):.1f}" r="3" fill="{line.color}"/>'
                for a, b in zip(x[segment], y[segment], strict=True)
            ]
        if len(segment) > 1:
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{line.color}" '
                f'stroke-width="1.8"{dash}/>'
            )
    # One marker per run of non-finite points: a run that never recovers stays one element.
    for run in _runs(~np.isfinite(y)):
        px, values = frame.px(x[run[0]]), {fmt(v) for v in y[run]}
        what = values.pop() if len(values) == 1 else "non-finite"
        where = (
            f"step {int(x[run[0]])}"
            if len(run) == 1
            else f"steps {int(x[run[0]])}–{int(x[run[-1]])} ({len(run)} points)"
        )
        end = max(px + 5, frame.px(x[run[-1]]))
        parts.append(
            f'<path d="M{px - 5:.1f},{frame.top - 1} L{end:.1f},{frame.top - 1} L{end:.1f},'
            f'{frame.top + 2} L{px + 5:.1f},{frame.top + 2} L{px:.1f},{frame.top + 8}Z" '
            f'fill="{NONFINITE}"><title>{escape(line.label)} = {what} at {where}</title></path>'
        )
    return "\n".join(parts)


def _runs(mask: np.ndarray) -> list[np.ndarray]:
    """Index runs where ``mask`` holds: each becomes one unbroken polyline."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return []
    return np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1)


def _marker(frame: _Frame, marker: Marker) -> str:
    x = frame.px(marker.x)
    tip = f"<title>{escape(marker.title)}</title>" if marker.title else ""
    return (
        f'<g><line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{frame.top + frame.height}" '
        f'stroke="{marker.color}" stroke-width="1.5" stroke-dasharray="4 3"/>'
        f'<rect x="{x - 13:.1f}" y="{frame.top + 10}" width="26" height="16" rx="3" '
        f'fill="{marker.color}"/>'
        f'<text x="{x:.1f}" y="{frame.top + 22}" text-anchor="middle" class="badge">'
        f"{escape(marker.label)}</text>{tip}</g>"
    )


def _legend(frame: _Frame, lines: Sequence[Line]) -> str:
    parts, x = [], frame.left + frame.width
    if any(not np.isfinite(np.asarray(line.y, dtype=np.float64)).all() for line in lines):
        x -= 78
        parts.append(
            f'<path d="M{x:.0f},{frame.top - 15} L{x + 10:.0f},{frame.top - 15} L{x + 5:.0f},'
            f'{frame.top - 6}Z" fill="{NONFINITE}"/><text x="{x + 14:.0f}" y="{frame.top - 6}" '
            'class="tick">nan / inf</text>'
        )
    for line in reversed(lines):
        width = 34 + 7.4 * len(line.label)
        x -= width
        dash = ' stroke-dasharray="6 4"' if line.dashed else ""
        parts.append(
            f'<line x1="{x:.0f}" x2="{x + 18:.0f}" y1="{frame.top - 10}" y2="{frame.top - 10}" '
            f'stroke="{line.color}" stroke-width="3"{dash}/><text x="{x + 22:.0f}" '
            f'y="{frame.top - 6}" class="tick">{escape(line.label)}</text>'
        )
    return "\n".join(parts)


def _row_label(names: Sequence[str], first: int, last: int) -> str:
    """A heatmap row's label: the layer's name, or the run of layers a binned row covers."""
    if first == last:
        return names[first]
    a, b = names[first].split("."), names[last].split(".")
    common = 0
    while common < min(len(a), len(b)) - 1 and a[common] == b[common]:
        common += 1
    if a[common].isdigit() and b[common].isdigit():  # blocks.0… to blocks.6…: "blocks.0–6"
        return ".".join(a[:common] + [f"{a[common]}–{b[common]}"])
    return f"{names[first]} … {names[last]}"


def _viridis(t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    f = t - i
    rgb = [round(a + (b - a) * f) for a, b in zip(VIRIDIS[i], VIRIDIS[i + 1], strict=True)]
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _colour_bar(x: float, y: float, height: float, lo: int, hi: int) -> str:
    steps = 24
    parts = [
        f'<rect x="{x:.0f}" y="{y + i * height / steps:.1f}" width="14" '
        f'height="{height / steps + 0.5:.1f}" '
        f'fill="{_viridis(1 - i / (steps - 1))}"/>'
        for i in range(steps)
    ]
    parts.append(f'<text x="{x + 20:.0f}" y="{y + 10:.0f}" class="tick">1e{hi}</text>')
    parts.append(f'<text x="{x + 20:.0f}" y="{y + height:.0f}" class="tick">1e{lo}</text>')
    parts.append(f'<text x="{x - 4:.0f}" y="{y + height + 16:.0f}" class="tick">grad norm</text>')
    return "\n".join(parts)


def _tick_columns(columns: int, count: int = 8) -> list[int]:
    return sorted({round(i * (columns - 1) / max(1, count - 1)) for i in range(count)})
