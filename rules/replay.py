"""Replay a recorded trace through the rules, and the conversions between records and trace lines.

``replay(path_or_lines, rules)`` is pure: it reads trace lines
(:mod:`gradwatch.wire.trace`), rebuilds ``Step``/``Stats``/``Eval`` records,
and feeds them in file order to an :class:`Engine` whose clock is the trace's
``time`` fields (never moving backwards), so ``for: 30s`` rules and alert
timestamps come out as they did live. Liveness is rebuilt from the records (every step and
heartbeat line
counts as a sign of life) and ticked at most once per trace second. A record
without ``time`` keeps the clock where it was.

``backtest(path)`` does the same for a training log the user already has (a
Hugging Face ``trainer_state.json``, a Lightning ``metrics.csv``; see
:mod:`gradwatch.rules.imports`), and ``replay_records`` for any records.

The ``trace_*`` functions go the other way (used by the collector's recorder):
``Step`` -> ``TraceStep`` etc., per-layer arrays aligned with the header's layers.

Example::

    from gradwatch.rules import load_default_rules
    from gradwatch.rules.replay import replay

    for t in replay("traces/run-42.jsonl", load_default_rules()):
        print(t.alert.step, t.current, t.alert.rule, t.alert.summary)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path

import numpy as np

from gradwatch.rules.agent_health import AgentNotice
from gradwatch.rules.alert import Transition
from gradwatch.rules.assembly import Assembler
from gradwatch.rules.engine import Engine
from gradwatch.rules.imports import ImportedRun, read_history, with_gaps
from gradwatch.rules.liveness import LivenessTracker
from gradwatch.rules.rulefile import RuleSpec, load_default_rules
from gradwatch.rules.step import FLOAT32_MAX, ActStats, Eval, Stats, Step
from gradwatch.wire.census import roles_for
from gradwatch.wire.messages import DATA_CHANGE, DEGRADED, WEIGHTS_WRITTEN
from gradwatch.wire.trace import (
    TraceAct,
    TraceEval,
    TraceEvent,
    TraceHeader,
    TraceHeartbeat,
    TraceReader,
    TraceRecord,
    TraceStats,
    TraceStep,
)

Source = str | PathLike[str] | Iterable[str]
TICK_SECONDS = 1.0


# ---------------------------------------------------------------- records -> trace


def _aligned(
    layers: tuple[str, ...], values: np.ndarray, header: tuple[str, ...]
) -> tuple[tuple[str, ...] | None, tuple[float | None, ...]]:
    """Per-layer ``values`` as a header-aligned list (None where not measured), or own names."""
    floats = values.astype(np.float64).tolist()
    if layers == header:
        return None, tuple(floats)
    position = {name: i for i, name in enumerate(header)}
    if len(position) == len(header) and all(name in position for name in layers):
        out: list[float | None] = [None] * len(header)
        for name, value in zip(layers, floats, strict=True):
            out[position[name]] = value
        return None, tuple(out)
    return layers, tuple(floats)


def trace_step(step: Step, header: tuple[str, ...]) -> TraceStep:
    """The trace line of ``step``; per-layer norms aligned with ``header`` layers where possible."""
    layers, norms = _aligned(step.layers, np.asarray(step.layer_norms), header)
    return TraceStep(
        step=step.step,
        rank=step.rank,
        time=step.time,
        loss=step.loss,
        lr=tuple(step.lr),
        grad_norm=step.grad_norm,
        layer_grad_norms=norms,
        layers=layers,
        loss_scale=step.loss_scale,
        skipped=step.skipped,
        scalars=dict(step.scalars),
    )


def trace_stats(stats: Stats, header: tuple[str, ...]) -> TraceStats:
    """The trace line of a cadence sample."""
    layers: tuple[str, ...] | None = None
    weights = ratios = None
    if stats.weight_norms is not None:
        layers, weights = _aligned(stats.layers, np.asarray(stats.weight_norms), header)
    if stats.update_ratios is not None:
        layers, ratios = _aligned(stats.layers, np.asarray(stats.update_ratios), header)
    acts = tuple(
        TraceAct(a.module, a.kind, a.mean, a.std, a.zero_frac, a.sat_frac) for a in stats.act
    )
    return TraceStats(
        step=stats.step,
        rank=stats.rank,
        time=stats.time,
        layers=layers,
        layer_weight_norms=weights,
        update_ratios=ratios,
        act=acts,
        census=stats.census,
    )


def trace_eval(ev: Eval) -> TraceEval:
    """The trace line of an evaluation."""
    return TraceEval(
        step=ev.step,
        rank=ev.rank,
        time=ev.time,
        loss=ev.loss,
        metrics=dict(ev.metrics),
        train_mode_modules=tuple(ev.train_mode_modules),
    )


# ---------------------------------------------------------------- trace -> records


def _measured(
    names: tuple[str, ...], values: Sequence[float | None]
) -> tuple[tuple[str, ...], np.ndarray]:
    """Drop not-measured (None) entries with their names, as the collector's ingest does."""
    if all(v is not None for v in values):
        return names, np.asarray(values, dtype=np.float64)
    keep = [i for i, v in enumerate(values) if v is not None]
    return tuple(names[i] for i in keep), np.asarray([values[i] for i in keep], dtype=np.float64)


def step_of(rec: TraceStep, header: TraceHeader, time: float) -> Step:
    """The ``Step`` a trace step line describes (``time`` when the line has none)."""
    names = rec.layers if rec.layers is not None else header.layers
    layers, norms = (
        _measured(names, rec.layer_grad_norms) if rec.layer_grad_norms else ((), np.zeros(0))
    )
    return Step(
        job=header.job,
        step=rec.step,
        time=time,
        rank=rec.rank,
        loss=rec.loss,
        grad_norm=rec.grad_norm,
        layers=layers,
        layer_norms=norms,
        lr=rec.lr,
        loss_scale=rec.loss_scale,
        skipped=rec.skipped,
        scalars=dict(rec.scalars),
        dtype_max=header.dtype_max if header.dtype_max is not None else FLOAT32_MAX,
        layer_roles=roles_for(layers, header.layers, header.layer_roles),
    )


def stats_of(rec: TraceStats, header: TraceHeader, time: float) -> Stats:
    """The ``Stats`` a trace stats line describes; unmeasured entries of a list read as NaN."""
    names = rec.layers if rec.layers is not None else header.layers

    def array(values: Sequence[float | None] | None) -> np.ndarray | None:
        if values is None:
            return None
        return np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)

    acts = tuple(
        ActStats(a.module, a.kind, a.mean, a.std, a.zero_frac, a.sat_frac) for a in rec.act
    )
    return Stats(
        job=header.job,
        step=rec.step,
        time=time,
        rank=rec.rank,
        layers=names,
        weight_norms=array(rec.layer_weight_norms),
        update_ratios=array(rec.update_ratios),
        act=acts,
        census=rec.census,
    )


def eval_of(rec: TraceEval, header: TraceHeader, time: float) -> Eval:
    """The ``Eval`` a trace eval line describes."""
    return Eval(
        job=header.job,
        step=rec.step,
        time=time,
        rank=rec.rank,
        loss=rec.loss,
        metrics=dict(rec.metrics),
        train_mode_modules=rec.train_mode_modules,
    )


# ---------------------------------------------------------------- replay


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint event seen in the trace."""

    step: int
    path: str


@dataclass(slots=True)
class Replay:
    """One replay run: the transitions, plus what the trace held (for reports).

    Example::

        run = Replay(load_default_rules(), strict=False)
        transitions = run.run("run-42.jsonl")
        print(run.records, run.skipped, run.problems[:3])
    """

    rules: Sequence[RuleSpec]
    strict: bool = True
    tick_seconds: float = TICK_SECONDS
    header: TraceHeader | None = None
    records: int = 0
    skipped: int = 0
    problems: list[tuple[int, str]] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    deadline_seconds: float = 5.0  # the collector's assembly_deadline_seconds default
    _assembler: Assembler | None = None
    _eval_rank: int | None = None

    def run(
        self, source: Source, on_record: Callable[[TraceRecord], None] | None = None
    ) -> list[Transition]:
        """Replay ``source`` (a path, or lines); raises ``TraceError`` on a bad trace.

        ``on_record`` sees every record the trace yields, in file order, before it is
        fed to the rules: a caller that also wants the curves (``gradwatch report``)
        reads the trace once.
        """
        if isinstance(source, (str, PathLike)):
            path = Path(source)
            with path.open(encoding="utf-8") as lines:
                return self._run(lines, str(path), on_record)
        return self._run(source, "<trace>", on_record)

    def last_good_checkpoint(self, step: int) -> str | None:
        """Newest checkpoint saved strictly before ``step`` (the one to roll back to)."""
        before = [c for c in self.checkpoints if c.step < step]
        return max(before, key=lambda c: c.step).path if before else None

    def _run(
        self, lines: Iterable[str], source: str, on_record: Callable[[TraceRecord], None] | None
    ) -> list[Transition]:
        reader = TraceReader(lines, strict=self.strict, source=source)
        header = self.header = reader.header
        now = 0.0
        engine = Engine(self.rules, clock=lambda: now)
        tracker = LivenessTracker(header.job)
        # A multi-rank trace is judged as the collector judged it: assembled steps.
        self._assembler = (
            Assembler(self.deadline_seconds, clock=lambda: now)
            if header.world is not None and header.world > 1
            else None
        )
        self._eval_rank = None
        last_tick: float | None = None
        out: list[Transition] = []
        for rec in reader:
            self.records += 1
            if on_record is not None:
                on_record(rec)
            stamp = getattr(rec, "time", None)
            if stamp is not None and math.isfinite(stamp):
                # Ranks ship in batches, so their times interleave out of order in the file;
                # the replay clock only moves forward, as the collector's did.
                now = max(now, stamp)
            out += self._feed(engine, tracker, header, rec, now)
            if self._assembler is not None:
                out += self._judge(engine, self._assembler.expire())
            if last_tick is None or now - last_tick >= self.tick_seconds:
                last_tick = now
                out += engine.tick(tracker.snapshot(now))
        if self._assembler is not None:
            out += self._judge(engine, self._assembler.flush())
        self.skipped, self.problems = reader.skipped, list(reader.problems)
        return out

    def _feed(
        self,
        engine: Engine,
        tracker: LivenessTracker,
        header: TraceHeader,
        rec: TraceRecord,
        now: float,
    ) -> list[Transition]:
        asm = self._assembler
        if isinstance(rec, TraceStep):
            time = now if rec.time is None else rec.time
            step = step_of(rec, header, time)
            tracker.step(rec.rank, rec.step, time, step)
            if asm is None:
                return engine.observe(step)
            return self._judge(engine, asm.add(_declared(step, header)))
        if isinstance(rec, TraceStats):
            stats = stats_of(rec, header, now if rec.time is None else rec.time)
            if asm is None:
                return engine.observe_stats(stats)
            return self._judge(engine, asm.add(_declared(stats, header)))
        if isinstance(rec, TraceEval):
            ev = eval_of(rec, header, now if rec.time is None else rec.time)
            if asm is None:
                return engine.observe_eval(ev)
            # As the collector: the lowest eval-reporting rank's evals speak for the job.
            if self._eval_rank is not None and ev.rank > self._eval_rank:
                return []
            self._eval_rank = ev.rank
            return engine.observe_eval(replace(ev, assembled=1))
        if isinstance(rec, TraceHeartbeat):
            tracker.heartbeat(rec.rank, rec.step, rec.time, rec.started)
            if asm is not None:
                asm.heard(header.job, rec.rank)
        elif isinstance(rec, TraceEvent) and rec.kind == "checkpoint":
            path = rec.fields.get("path")
            self.checkpoints.append(Checkpoint(rec.step, path if isinstance(path, str) else ""))
        elif isinstance(rec, TraceEvent) and rec.kind == DATA_CHANGE:
            engine.data_changed(header.job, rec.step)
        elif isinstance(rec, TraceEvent) and rec.kind == WEIGHTS_WRITTEN:
            engine.weights_written(header.job, rec.rank, rec.step)
        elif isinstance(rec, TraceEvent) and rec.kind == DEGRADED:  # as the collector does
            notice = AgentNotice.of_fields(header.job, rec.rank, max(rec.step, 0), dict(rec.fields))
            if notice is not None:
                return engine.observe_notice(notice)
        return []

    @staticmethod
    def _judge(engine: Engine, records: Iterable[Step | Stats]) -> list[Transition]:
        out: list[Transition] = []
        for record in records:
            out += engine.feed(record)
        return out


def _declared(record: Step | Stats, header: TraceHeader) -> Step | Stats:
    """``record`` with the topology its trace header declares, as the collector saw it."""
    return replace(record, world=header.world or 1, shards=header.shards or 0)


def replay_records(
    records: Iterable[Step | Stats | Eval],
    rules: Sequence[RuleSpec] | None = None,
    job: str | None = None,
) -> list[Transition]:
    """Every transition the rules would have produced over ``records``, fed in order.

    The engine's clock is the records' ``time`` (never moving backwards), as in
    :func:`replay`. Used for logs imported by :mod:`gradwatch.rules.imports`.
    """
    now = 0.0
    engine = Engine(load_default_rules() if rules is None else rules, clock=lambda: now)
    out: list[Transition] = []
    for record in records:
        now = max(now, record.time) if math.isfinite(record.time) else now
        out += engine.feed(record if job is None else replace(record, job=job))
    return out


def backtest(
    path: str | PathLike[str], rules: Sequence[RuleSpec] | None = None, *, gaps: bool = False
) -> tuple[ImportedRun, list[Transition]]:
    """Import the training log at ``path`` (:func:`~gradwatch.rules.imports.read_history`); replay.

    ``gaps``: also feed the unlogged steps between logged ones, as the live
    callback sends them (:func:`gradwatch.rules.imports.with_gaps`); the
    alerts must not change. Raises ``gradwatch.rules.imports.HistoryError``
    for a log it cannot read.
    """
    run = read_history(path)
    return run, replay_records(with_gaps(run.records) if gaps else run.records, rules)


def replay(
    source: Source, rules: Sequence[RuleSpec] | None = None, *, strict: bool = True
) -> list[Transition]:
    """Every transition the rules would have produced over the trace ``source``.

    ``rules`` defaults to the packaged rule pack. ``strict=True`` raises
    ``gradwatch.wire.trace.TraceError`` at the first bad line; ``False`` skips
    bad lines (use :class:`Replay` to see how many).
    """
    return Replay(load_default_rules() if rules is None else rules, strict=strict).run(source)
