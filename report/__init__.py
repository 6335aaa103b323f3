"""gradwatch.report: a self-contained HTML post-mortem of a recorded trace.

``gradwatch report TRACE -o report.html`` replays the trace through the rules
and draws the loss (alerts marked), the learning rate, total and per-layer
gradient norms, the first/last layer ratio, activation saturation and dead
fractions, the AMP loss scale, and every alert with its diagnosis, evidence and
next checks. No torch. The page stays small whatever the model: the per-layer
heatmap bins layers and steps into at most ``binning.MAX_CELLS`` cells, each
showing its bin's largest norm (about 0.9 MB for 1,000 layers x 2,000 steps).

Example::

    from pathlib import Path
    from gradwatch.report import write_report

    write_report(Path("traces/run-42.jsonl"), Path("report.html"))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from gradwatch.report.data import ReportData, load_report_data
from gradwatch.report.html import render_report
from gradwatch.rules import RuleSpec


def build_report(
    trace: Path | Iterable[str],
    rules: Sequence[RuleSpec] | None = None,
    *,
    source: str | None = None,
) -> str:
    """The report of ``trace`` (a path, or its lines named by ``source``) as an HTML string.

    ``rules`` default to the packaged pack.
    """
    name = source or (str(trace) if isinstance(trace, Path) else "<trace>")
    return render_report(load_report_data(trace, rules, source=name), source=name)


def write_report(
    trace: Path | Iterable[str],
    out: Path,
    rules: Sequence[RuleSpec] | None = None,
    *,
    source: str | None = None,
) -> Path:
    """Write the report of ``trace`` to ``out`` (parent folders created); returns ``out``."""
    html = build_report(trace, rules, source=source)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out


__all__ = ["ReportData", "build_report", "load_report_data", "render_report", "write_report"]
