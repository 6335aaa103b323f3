"""The post-mortem page: summary, charts and alerts in one self-contained HTML file.

Everything is inline (CSS and SVG); the page references no script, stylesheet,
font or image outside itself, so it can be attached to a ticket or opened
offline. Panels for signals a trace does not hold say "not recorded".

Example::

    html = render_report(load_report_data(Path("run-42.jsonl")), source="run-42.jsonl")
    Path("report.html").write_text(html, encoding="utf-8")
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from html import escape
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from gradwatch.report.binning import bin_max
from gradwatch.report.data import ReportData
from gradwatch.report.svg import Line, Marker, fmt, heatmap, line_chart, not_recorded
from gradwatch.rules import Alert
from gradwatch.rules.diagnosis import VERDICTS

PALETTE = (
    "#1f4e8c",
    "#e07b00",
    "#2e8b57",
    "#8e44ad",
    "#c0392b",
    "#16a085",
    "#7f8c8d",
    "#d35400",
    "#2c3e50",
    "#b7950b",
)
SEVERITY_COLOUR = {"critical": "#c0392b", "warning": "#d68910", "info": "#2471a3"}
MAX_MARKERS = 30  # alert markers on a chart; the alerts section lists every alert
MAX_ACT_SERIES = 10  # more modules than this make a chart unreadable: show the worst ones

CSS = """
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
       sans-serif; color: #1d2733; background: #f4f6f9; margin: 0; line-height: 1.5;
       font-size: 15px; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 26px; margin: 8px 0 2px; }
h2 { font-size: 19px; margin: 0 0 10px; }
h3 { font-size: 16px; margin: 0 0 4px; }
.sub { color: #5f6b7a; margin: 0 0 18px; }
section { background: #fff; border: 1px solid #e1e5ea; border-radius: 10px; padding: 18px 20px;
          margin: 0 0 18px; }
.summary { display: grid; grid-template-columns: repeat(4, 1fr); gap: 12px; }
.tile { background: #f7f9fb; border-radius: 8px; padding: 10px 12px; }
.tile .k { color: #5f6b7a; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.tile .v { font-size: 18px; font-weight: 600; overflow-wrap: anywhere; }
.verdict { margin-top: 14px; padding: 12px 14px; border-left: 5px solid #c0392b;
           background: #fdf2f1; border-radius: 6px; }
.verdict.ok { border-color: #2e8b57; background: #eff8f2; }
.note { color: #5f6b7a; font-size: 13px; margin: 6px 0 0; }
.chart-title { font-size: 14px; font-weight: 600; fill: #1d2733; }
.tick { font-size: 11px; fill: #5f6b7a; }
.axis-label { font-size: 12px; fill: #5f6b7a; }
.muted { font-size: 13px; fill: #7f8b99; }
.badge { font-size: 11px; font-weight: 700; fill: #fff; }
svg { display: block; margin: 4px 0 12px; }
.alert { border: 1px solid #e1e5ea; border-radius: 8px; padding: 12px 14px; margin: 0 0 12px; }
.pill { display: inline-block; color: #fff; border-radius: 4px; padding: 0 7px; font-size: 12px;
        font-weight: 700; margin-right: 6px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
td, th { border-bottom: 1px solid #eef0f3; padding: 3px 10px 3px 0; text-align: left;
         vertical-align: top; }
th { color: #5f6b7a; font-weight: 600; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; }
ul { margin: 4px 0 4px 20px; padding: 0; }
footer { color: #7f8b99; font-size: 12px; text-align: center; }
"""


def _version() -> str:
    # The distribution's version, not ``gradwatch.__version__``: the root package
    # references the agent, and the report must not import the agent (or torch).
    try:
        return version("gradwatch")
    except PackageNotFoundError:
        return "unknown"


def render_report(data: ReportData, source: str = "") -> str:
    """The whole HTML document for ``data``."""
    markers = [
        Marker(a.step, f"A{i}", SEVERITY_COLOUR.get(a.severity, "#555"), f"{a.rule}: {a.summary}")
        for i, a in enumerate(data.alerts[:MAX_MARKERS], 1)
    ]
    body = [
        f"<h1>Training post-mortem: {escape(data.job)}</h1>",
        f'<p class="sub">gradwatch {escape(_version())} report of '
        f"<code>{escape(source)}</code></p>",
        _summary(data),
        _section("loss", "Loss", _loss_chart(data, markers)),
        _section("lr", "Learning rate", _lr_chart(data, markers)),
        _section(
            "grad-norm",
            "Total gradient norm",
            _log_chart(data, data.grad_norm, "grad norm", "‖∇θ L‖ per step", PALETTE[0], markers),
        ),
        _section("layers", "Per-layer gradient norms", _layer_heatmap(data)),
        _section("ratio", "First / last layer ratio", _ratio_chart(data, markers)),
        _section("activations", "Activations", _activation_charts(data)),
        _section("census", "Model census", _census(data)),
        _section(
            "loss-scale",
            "AMP loss scale",
            _log_chart(
                data, data.loss_scale, "loss scale", "GradScaler loss scale", PALETTE[3], markers
            ),
        ),
        _section("alerts", f"Alerts ({len(data.alerts)})", _alerts(data.alerts)),
        (
            f"<footer>Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by "
            "<code>gradwatch report</code>. Alerts come from replaying the trace through the "
            "rules; a diagnosis narrows the search, it is not a certain cause.</footer>"
        ),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>gradwatch post-mortem: {escape(data.job)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def _log_chart(
    data: ReportData,
    values: np.ndarray,
    label: str,
    title: str,
    colour: str,
    markers: Sequence[Marker],
) -> str:
    """One per-step series on a log axis (norms and loss scales span orders of magnitude)."""
    return line_chart(
        [Line(data.steps, values, label, colour)],
        title=f"{title} (log scale)",
        y_label=label,
        log_y=True,
        markers=markers,
    )


def _section(anchor: str, title: str, content: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(title)}</h2>{content}</section>'


def _tile(key: str, value: str) -> str:
    return f'<div class="tile"><div class="k">{escape(key)}</div><div class="v">{value}</div></div>'


def _summary(data: ReportData) -> str:
    steps = (
        f"{int(data.steps[0])}–{int(data.steps[-1])} ({len(data.steps)})"
        if len(data.steps)
        else "none recorded"
    )
    first = data.first_alert
    first_text = f"step {first.step}: {escape(first.rule)}" if first is not None else "none"
    tiles = [
        _tile("job", escape(data.job)),
        _tile("steps", steps),
        _tile("first alert", first_text),
        _tile("alerts fired", str(len(data.alerts))),
    ]
    if first is None:
        verdict = (
            '<div class="verdict ok"><strong>Verdict: no alert fired.</strong> '
            f"{escape(VERDICTS['none'])} under the rules used for this report.</div>"
        )
    else:
        diagnosis = first.diagnosis or {}
        tree = str(diagnosis.get("verdict", "none"))
        # When the seed's tree sees nothing in loss and grad norms, the first alert's own class
        # (saturation, dead units...) is the finding.
        name = (
            VERDICTS[tree]
            if tree in VERDICTS and tree != "none"
            else first.category.replace("_", " ")
        )
        verdict = (
            f'<div class="verdict"><strong>Verdict: {escape(name)}</strong> (first alert '
            f"{escape(first.rule)}, step {first.step}). "
            f"{escape(_without(str(diagnosis.get('summary', first.summary)), name))}"
            "</div>"
        )
    notes = []
    if data.rank is not None and data.rank != 0:
        notes.append(f"Curves follow rank {data.rank}, the lowest rank in the trace.")
    if data.skipped:
        where = "; ".join(f"line {line}: {message}" for line, message in data.problems[:3])
        notes.append(f"{data.skipped} bad line(s) skipped ({escape(where)}).")
    note = "".join(f'<p class="note">{n}</p>' for n in notes)
    return _section(
        "summary", "Summary", f'<div class="summary">{"".join(tiles)}</div>{verdict}{note}'
    )


def _loss_chart(data: ReportData, markers: Sequence[Marker]) -> str:
    lines = [Line(data.steps, data.loss, "train loss", PALETTE[0])]
    if len(data.eval_steps):
        lines.append(
            Line(
                data.eval_steps,
                data.eval_loss,
                "validation loss",
                PALETTE[1],
                dashed=True,
                dots=True,
            )
        )
    finite = np.concatenate([line.y for line in lines])
    finite = finite[np.isfinite(finite)]
    # A loss spanning orders of magnitude (an explosion) only reads on a log axis.
    log_y = bool(len(finite)) and finite.min() > 0 and finite.max() / finite.min() > 100
    title = "training and validation loss" + (" (log scale)" if log_y else "")
    note = "" if len(data.eval_steps) else '<p class="note">Validation loss: not recorded.</p>'
    return line_chart(lines, title=title, y_label="loss", log_y=log_y, markers=markers) + note


def _lr_chart(data: ReportData, markers: Sequence[Marker]) -> str:
    title = "learning rate per step"
    groups = [g for g in data.lr if np.isfinite(g).any()]
    if not groups:
        return not_recorded(title)
    # Param groups on one schedule (decay / no-decay) draw as one line.
    distinct = [
        g
        for i, g in enumerate(groups)
        if not any(np.array_equal(g, h, equal_nan=True) for h in groups[:i])
    ]
    lines = [
        Line(data.steps, g, "lr" if len(distinct) == 1 else f"group {i}", PALETTE[i % len(PALETTE)])
        for i, g in enumerate(distinct[:MAX_ACT_SERIES])
    ]
    finite = np.concatenate(distinct)
    finite = finite[np.isfinite(finite) & (finite > 0)]
    # Warm-up, decay and an lr fault span orders of magnitude: a log axis keeps each readable.
    log_y = bool(len(finite)) and finite.max() / finite.min() > 10
    chart = line_chart(
        lines,
        title=title + (" (log scale)" if log_y else ""),
        y_label="lr",
        log_y=log_y,
        markers=markers,
    )
    return chart + f'<p class="note">{escape(_lr_note(data, distinct[0]))}</p>'


def _lr_note(data: ReportData, lr: np.ndarray) -> str:
    """The lr's largest step-to-step rise, and where it stood when the first alert fired."""
    prev, cur = lr[:-1], lr[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        rise = np.where((prev > 0) & np.isfinite(prev) & np.isfinite(cur), cur / prev, np.nan)
    parts = []
    k = int(np.nanargmax(rise)) if np.isfinite(rise).any() else -1
    if k >= 0 and rise[k] > 1:
        parts.append(
            f"Largest step-to-step rise: ×{fmt(rise[k])} at step {int(data.steps[k + 1])} "
            f"({fmt(prev[k])} → {fmt(cur[k])})."
        )
    elif k >= 0:
        parts.append("The lr never rose from one logged step to the next.")
    first = data.first_alert
    logged = np.flatnonzero((data.steps <= (first.step if first else -1)) & np.isfinite(lr))
    if first is not None and len(logged):
        at = fmt(lr[logged[-1]])
        parts.append(f"At the first alert ({first.rule}, step {first.step}) the lr was {at}.")
    parts.append(
        "A rise shortly before the loss or the gradients break points at the lr (schedule, "
        "warm-up, a scheduler restored wrongly on resume)."
    )
    return " ".join(parts)


def _layer_heatmap(data: ReportData) -> str:
    title = "gradient norm per parameter tensor (log colour)"
    if not data.layer_norms.size:
        return not_recorded(title)
    cells = bin_max(data.layer_norms)
    rows = max(b - a + 1 for a, b in cells.rows)
    cols = max(b - a + 1 for a, b in cells.columns)
    if rows == 1 and cols == 1:
        what = "Each cell is one parameter tensor at one step"
    else:
        what = (
            f"Each cell is the largest gradient norm among up to {rows} consecutive tensor(s) × "
            f"{cols} step(s) (the largest, so a one-step spike in one tensor stays visible; "
            "hover a cell for its range, largest and smallest)"
        )
    return (
        heatmap(cells, data.steps, data.layers, title=title)
        + f'<p class="note">{what}. Rows in model order; grey cells were not measured, red ones '
        "hold a nan/inf. Early layers orders of magnitude darker than late ones point at vanishing "
        "gradients.</p>"
    )


def _ratio_chart(data: ReportData, markers: Sequence[Marker]) -> str:
    ratio, first, last = data.first_last_ratio()
    if not np.isfinite(ratio).any():
        return not_recorded(
            "first/last layer grad-norm ratio",
            why="not recorded (needs per-layer norms of at least two modules)",
        )
    lines = [Line(data.steps, ratio, f"first module {first} / last {last}", PALETTE[2])]
    for bound, label in ((100.0, "×100"), (0.01, "×0.01")):
        lines.append(
            Line([data.steps[0], data.steps[-1]], [bound, bound], label, "#9aa5b1", dashed=True)
        )
    return (
        line_chart(
            lines,
            title="grad norm of the first module / the last (log scale)",
            y_label="ratio",
            log_y=True,
            markers=markers,
        )
        + '<p class="note">Beyond two orders of magnitude (dashed) the seed reads vanishing '
        "(below) or exploding (above) gradients.</p>"
    )


def _activation_charts(data: ReportData) -> str:
    charts = []
    for field, kinds, title in (
        (
            "sat_frac",
            ("tanh", "sigmoid", "softmax"),
            "saturated fraction (tanh/sigmoid near ±1; softmax rows with max prob > 0.99)",
        ),
        (
            "zero_frac",
            ("relu", "relu6", "gelu", "silu"),
            "dead fraction (ReLU: exact zeros; GELU/SiLU: flat negative tail)",
        ),
    ):
        series = [
            (name, s)
            for name, s in data.acts.items()
            if s.kind in kinds and any(math.isfinite(v) for v in getattr(s, field))
        ]
        series.sort(key=lambda item: -np.nanmax(getattr(item[1], field)))
        lines = [
            Line(s.steps, getattr(s, field), f"{name} ({s.kind})", PALETTE[i % len(PALETTE)])
            for i, (name, s) in enumerate(series[:MAX_ACT_SERIES])
        ]
        charts.append(
            line_chart(lines, title=title, y_label="fraction", y_range=(0.0, 1.0))
            if lines
            else not_recorded(title)
        )
    return "".join(charts)


def _census(data: ReportData) -> str:
    """The last census the agent sent, and the steps trained with the model in eval mode."""
    if not data.censuses:
        return not_recorded(
            "model census", why="not recorded (no cadence sample in this trace carried one)"
        )
    step, c = data.censuses[-1]
    in_eval = [s for s, census in data.censuses if not census.model_training]
    rows = [
        ("parameters", f"{c.params_total:,}"),
        ("frozen", f"{c.params_frozen:,} ({c.frozen_share:.1%})"),
        ("frozen modules", ", ".join(f"{name} ({n:,})" for name, n in c.frozen_modules) or "none"),
        (
            "requiring grad but not in the optimizer",
            f"{c.params_not_in_optimizer:,}"
            + (f": {', '.join(c.not_in_optimizer)}" if c.not_in_optimizer else ""),
        ),
        ("tied (one tensor, several names)", "; ".join(" = ".join(g) for g in c.tied) or "none"),
        ("in eval mode while training", ", ".join(c.eval_modules) or "none"),
        ("model.training", "yes" if c.model_training else "NO (training in eval mode)"),
    ]
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    note = (
        f"Sampled at step {step} ({len(data.censuses)} sample(s) carried a census). Freezing is "
        "often intended (fine-tuning a head, LoRA); parameters outside the optimizer never change."
    )
    if in_eval:
        note += (
            f" The model trained in eval mode at {len(in_eval)} sampled step(s), first at step "
            f"{in_eval[0]}."
        )
    return f'<table>{body}</table><p class="note">{escape(note)}</p>'


def _alerts(alerts: Sequence[Alert]) -> str:
    if not alerts:
        return "<p>No alert fired over this trace.</p>"
    return "".join(_alert(i, a) for i, a in enumerate(alerts, 1))


def _alert(index: int, alert: Alert) -> str:
    colour = SEVERITY_COLOUR.get(alert.severity, "#555")
    diagnosis: Mapping[str, Any] = alert.diagnosis or {}
    rank = "" if alert.rank is None else f", rank {alert.rank}"
    parts = [
        (
            f'<div class="alert" id="alert-{index}"><h3>'
            f'<span class="pill" style="background:{colour}">'
            f"A{index} {escape(alert.severity)}</span>{escape(alert.rule)} "
            f'<span class="sub">({escape(alert.category)}) from step {alert.step}{rank}</span></h3>'
        ),
        f"<p>{escape(alert.summary)}</p>",
    ]
    if diagnosis:
        verdict = VERDICTS.get(str(diagnosis.get("verdict", "")), str(diagnosis.get("verdict", "")))
        parts.append(
            f"<p><strong>Diagnosis: {escape(verdict)}.</strong> "
            f"{escape(_without(str(diagnosis.get('summary', '')), verdict))}</p>"
        )
    parts.append(_evidence(alert.evidence, diagnosis.get("evidence", ())))
    checks = list(diagnosis.get("next_checks", ()))
    if checks:
        parts.append(
            "<strong>Next checks</strong><ul>"
            + "".join(f"<li>{escape(str(c))}</li>" for c in checks)
            + "</ul>"
        )
    if alert.last_good_checkpoint:
        parts.append(
            f'<p class="note">Last good checkpoint: <code>{escape(alert.last_good_checkpoint)}'
            "</code></p>"
        )
    return "".join(parts) + "</div>"


def _without(summary: str, verdict: str) -> str:
    """The diagnosis summary without its leading verdict, which the page prints in bold."""
    for prefix in (verdict + ": ", verdict + ". ", verdict):
        if summary.startswith(prefix):
            return summary[len(prefix) :].strip()
    return summary


def _evidence(evidence: Mapping[str, Any], diagnosis_evidence: Sequence[Mapping[str, Any]]) -> str:
    rows = [(str(k), _value(v), "") for k, v in evidence.items()]
    rows += [
        (str(e.get("signal", "")), _value(e.get("value")), str(e.get("step", "")))
        for e in diagnosis_evidence
    ]
    if not rows:
        return ""
    body = "".join(
        f"<tr><td><code>{escape(k)}</code></td><td>{escape(v)}</td><td>{escape(s)}</td></tr>"
        for k, v, s in rows
    )
    return f"<table><tr><th>evidence</th><th>value</th><th>step</th></tr>{body}</table>"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return fmt(value)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_value(v) for v in value[:8])
        return f"[{shown}{', …' if len(value) > 8 else ''}]"
    return str(value)
