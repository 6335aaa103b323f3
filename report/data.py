"""What a post-mortem shows, read from a trace: per-step series, evals, stats, alerts.

The trace is read once: replaying it through the rules engine
(:class:`gradwatch.rules.replay.Replay`, exactly as ``gradwatch replay`` does;
bad lines skipped and counted) gives the alerts, and hands every record it
parses (:mod:`gradwatch.wire.trace`) to the curves.
Curves follow the lowest-numbered rank, the one the diagnosis follows.

Example::

    data = load_report_data(Path("traces/run-42.jsonl"))
    print(data.job, len(data.steps), [a.rule for a in data.alerts])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from gradwatch.rules import Alert, RuleSpec, load_default_rules
from gradwatch.rules.ratio import group_layers
from gradwatch.rules.replay import Replay
from gradwatch.rules.step import Census
from gradwatch.wire.trace import (
    TraceError,
    TraceEval,
    TraceRecord,
    TraceStats,
    TraceStep,
)


@dataclass(slots=True)
class ActSeries:
    """One module's activation statistics over the cadence samples."""

    kind: str
    steps: list[int] = field(default_factory=list)
    zero_frac: list[float] = field(default_factory=list)
    sat_frac: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ReportData:
    """Everything the HTML report draws; arrays are aligned with ``steps``."""

    job: str
    layers: tuple[str, ...]
    rank: int | None
    steps: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    loss_scale: np.ndarray
    lr: np.ndarray  # param groups x steps; NaN = not logged
    layer_norms: np.ndarray  # layers x steps; NaN = not measured, +inf = measured non-finite
    eval_steps: np.ndarray
    eval_loss: np.ndarray
    acts: dict[str, ActSeries]
    alerts: list[Alert]
    records: int
    skipped: int
    problems: list[tuple[int, str]]
    # (step, census) of every cadence sample that carried one, in step order.
    censuses: list[tuple[int, Census]] = field(default_factory=list)

    @property
    def first_alert(self) -> Alert | None:
        return min(self.alerts, key=lambda a: (a.step, a.started_at)) if self.alerts else None

    def first_last_ratio(self) -> tuple[np.ndarray, str, str]:
        """Per-step grad-norm ratio of the first to the last module, and the two module names."""
        if len(self.layers) < 2 or not self.layer_norms.size:
            return np.full(len(self.steps), np.nan), "", ""
        inverse, names, _ = group_layers(self.layers)
        if len(names) < 2:
            return np.full(len(self.steps), np.nan), names[0] if names else "", ""
        squares = np.square(np.where(np.isinf(self.layer_norms), np.nan, self.layer_norms))
        first = np.sqrt(squares[inverse == 0].sum(axis=0))
        last = np.sqrt(squares[inverse == len(names) - 1].sum(axis=0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(last > 0, first / last, np.nan)
        return ratio, names[0], names[-1]


def load_report_data(
    trace: Path | Iterable[str],
    rules: Sequence[RuleSpec] | None = None,
    *,
    source: str | None = None,
) -> ReportData:
    """Read ``trace`` (a path, or its lines) and replay it through ``rules`` (default: packaged).

    Lines are read and parsed once (the replay hands its records to the
    curves), so a caller may pass a file it is drawing progress for
    (``gradwatch.progress.progress_lines``); ``source`` names the trace in
    error messages. Raises ``gradwatch.wire.trace.TraceError`` for a trace
    without a valid header, and ``OSError`` when the file cannot be read.
    """
    if isinstance(trace, Path):
        with trace.open(encoding="utf-8") as lines:
            return load_report_data(lines, rules, source=source or str(trace))
    name = source or "<trace>"
    records: list[TraceRecord] = []
    run = Replay(load_default_rules() if rules is None else rules, strict=False)
    try:
        # One parse: the replay hands every record it reads to the curves too.
        transitions = run.run(trace, on_record=records.append)
    except TraceError as exc:  # lines carry no file name: the message gets it back
        raise TraceError(exc.problems, name) from None
    alerts = [
        replace(t.alert, last_good_checkpoint=run.last_good_checkpoint(t.alert.onset))
        for t in transitions
        if t.current == "firing"
    ]
    header = run.header
    assert header is not None  # run() reads the header first, or raises TraceError
    steps = [r for r in records if isinstance(r, TraceStep)]
    rank = min((r.rank for r in steps), default=None)
    steps = sorted((r for r in steps if r.rank == rank), key=lambda r: r.step)
    layers = header.layers or next((r.layers for r in steps if r.layers), ())
    evals = sorted(
        (
            r
            for r in records
            if isinstance(r, TraceEval) and r.rank == (rank or 0) and r.loss is not None
        ),
        key=lambda r: r.step,
    )
    stats = [r for r in records if isinstance(r, TraceStats) and r.rank == (rank or 0)]
    return ReportData(
        job=header.job,
        layers=tuple(layers),
        rank=rank,
        steps=np.array([r.step for r in steps], dtype=np.int64),
        loss=_column(steps, "loss"),
        grad_norm=_column(steps, "grad_norm"),
        loss_scale=_column(steps, "loss_scale"),
        lr=_lr_matrix(steps),
        layer_norms=_layer_matrix(steps, tuple(layers)),
        eval_steps=np.array([r.step for r in evals], dtype=np.int64),
        eval_loss=np.array([r.loss for r in evals], dtype=np.float64),
        acts=_acts(stats),
        alerts=alerts,
        records=run.records,
        skipped=run.skipped,
        problems=list(run.problems),
        censuses=[
            (r.step, r.census) for r in sorted(stats, key=lambda r: r.step) if r.census is not None
        ],
    )


def _column(steps: Sequence[TraceStep], name: str) -> np.ndarray:
    values = [getattr(r, name) for r in steps]
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)


def _lr_matrix(steps: Sequence[TraceStep]) -> np.ndarray:
    out = np.full((max((len(r.lr) for r in steps), default=0), len(steps)), np.nan)
    for j, rec in enumerate(steps):
        out[: len(rec.lr), j] = rec.lr
    return out


def _layer_matrix(steps: Sequence[TraceStep], layers: tuple[str, ...]) -> np.ndarray:
    out = np.full((len(layers), len(steps)), np.nan)
    position = {name: i for i, name in enumerate(layers)}
    for j, rec in enumerate(steps):
        values = rec.layer_grad_norms
        if rec.layers is None or rec.layers == layers:
            # The common case, one C-level conversion per step: None becomes NaN ("not measured").
            row = np.array(values[: len(layers)], dtype=np.float64)
            out[: len(row), j] = _measured_non_finite(row, values)
            continue
        for name, value in zip(rec.layers, values, strict=False):
            if value is not None and name in position:
                out[position[name], j] = value if math.isfinite(value) else math.inf
    return out


def _measured_non_finite(row: np.ndarray, values: Sequence[float | None]) -> np.ndarray:
    """``row`` with measured non-finite values as +inf, so NaN keeps meaning "not measured"."""
    bad = ~np.isfinite(row)
    if bad.any():
        for i in np.flatnonzero(bad).tolist():
            row[i] = np.nan if values[i] is None else math.inf
    return row


def _acts(stats: Sequence[TraceStats]) -> dict[str, ActSeries]:
    out: dict[str, ActSeries] = {}
    for rec in sorted(stats, key=lambda r: r.step):
        for act in rec.act:
            series = out.setdefault(act.module, ActSeries(act.kind))
            series.steps.append(rec.step)
            series.zero_frac.append(math.nan if act.zero_frac is None else act.zero_frac)
            series.sat_frac.append(math.nan if act.sat_frac is None else act.sat_frac)
    return out
