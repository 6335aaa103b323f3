"""Training logs users already have, read as the live path would have seen them (backtesting).

Two formats, both from the training loop's own logger, so a user can replay
their last runs through the rules before turning paging on:

* a Hugging Face ``trainer_state.json`` (plain or ``.gz``): its ``log_history``
  holds what the Trainer logged, which is exactly what gradwatch's Trainer
  callback sends at ``logging_steps``: the training ``loss`` (mean since the
  previous log), the pre-clip ``grad_norm``, ``learning_rate``, and
  ``eval_loss`` on eval rows; steps are the Trainer's global step;
* a Lightning ``CSVLogger`` ``metrics.csv``: one row per ``self.log`` flush,
  with a ``step`` column (the global step) and whatever the module logged.
  Columns are found by name (:data:`LOSS_COLUMNS`, :data:`VAL_COLUMNS`, a
  ``LearningRateMonitor``'s ``lr-*``, Lightning's ``grad_2.0_norm_total``).

Neither format records wall time, so every record's ``time`` is its step
number: a duration in a rule's ``for:`` reads as steps on these logs.

A non-finite ``grad_norm`` on a row whose loss is finite and whose next
training row is finite again is an fp16 overflow the GradScaler skipped
(designed behaviour). The live agent learns this from the scaler; a log can
only show it by the run carrying on, so the importer looks one row ahead and
marks that step skipped, with an unknown (NaN) loss scale. Every other
non-finite value is kept as it is, for the non-finite rule.

Example::

    run = read_history("out/checkpoint-500/trainer_state.json")
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    for record in run.records:
        engine.feed(record)
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from os import PathLike
from pathlib import Path
from typing import Any, Literal

from gradwatch.rules.step import Eval, Step
from gradwatch.wire.fields import MAX_STEP

Format = Literal["trainer_state", "lightning_csv"]
Record = Step | Eval

# Lightning names the per-step value of `self.log(name, on_step=True, on_epoch=True)` name_step.
LOSS_COLUMNS = ("train_loss_step", "train_loss", "train/loss", "loss_step", "loss", "training_loss")
VAL_COLUMNS = (
    "val_loss",
    "val/loss",
    "valid_loss",
    "validation_loss",
    "val_loss_epoch",
    "eval_loss",
)
LR_COLUMNS = ("learning_rate", "lr")
GRAD_NORM_COLUMNS = ("grad_2.0_norm_total", "grad_norm", "train/grad_norm")
_LR_MONITOR = re.compile(r"^lr-")


# with_gaps fills at most this many steps between two logs: a jump further than that (a
# hand-edited or corrupt step number) is not a stream any callback sent.
MAX_GAP = 100_000


class HistoryError(ValueError):
    """A log that cannot be imported; the message says what was wrong and where."""


@dataclass(frozen=True, slots=True)
class ImportedRun:
    """The records a training log holds, in step order, as the live path would have sent them.

    ``max_steps``: the run's planned length where the log states it (the
    Trainer's ``max_steps``), else None.
    """

    job: str
    format: Format
    records: tuple[Record, ...]
    max_steps: int | None = None

    @property
    def steps(self) -> int:
        """How many training rows (steps with a loss or grad norm) the log held."""
        return sum(isinstance(r, Step) for r in self.records)

    @property
    def evals(self) -> int:
        """How many evaluations the log held."""
        return sum(isinstance(r, Eval) for r in self.records)


def history_format(path: str | PathLike[str]) -> Format | None:
    """The log format ``path``'s name says, or None for anything else (a trace)."""
    name = Path(path).name.lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return "lightning_csv"
    if name.endswith(".json"):
        return "trainer_state"
    return None


def read_history(path: str | PathLike[str], job: str | None = None) -> ImportedRun:
    """Import the log at ``path`` by its name (:func:`history_format`); raises ``HistoryError``."""
    fmt = history_format(path)
    if fmt == "lightning_csv":
        return read_lightning_csv(path, job)
    if fmt == "trainer_state":
        return read_trainer_state(path, job)
    raise HistoryError(
        f"{path}: not a trainer_state.json(.gz) or a metrics.csv(.gz); name the file by its format"
    )


def _open_text(path: Path) -> str:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
        raise HistoryError(
            f"cannot read {path}: {exc}; check the path (a .gz name must hold gzip)"
        ) from exc


def _job_name(path: Path, job: str | None) -> str:
    if job:
        return job
    stem = path.name.removesuffix(".gz").rsplit(".", 1)[0]
    if stem not in ("trainer_state", "metrics"):
        return stem  # a renamed copy: its name is the best label
    # trainer_state.json sits in the run's output dir or one of its checkpoint-N dirs.
    parent = path.resolve().parent
    if parent.name.startswith("checkpoint-") and parent.parent.name:
        parent = parent.parent
    return parent.name or path.stem


def read_trainer_state(path: str | PathLike[str], job: str | None = None) -> ImportedRun:
    """Import a Hugging Face ``trainer_state.json`` (or ``.json.gz``)."""
    file = Path(path)
    text = _open_text(file)
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise HistoryError(
            f"{file}: not valid JSON ({exc}); pass the Trainer's trainer_state.json"
        ) from exc
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise HistoryError(
            f"{file}: no 'log_history' list; is this a Trainer's trainer_state.json?"
        )
    rows = [row for row in history if isinstance(row, dict)]
    max_steps = state.get("max_steps")
    name = _job_name(file, job)
    return ImportedRun(
        name,
        "trainer_state",
        tuple(trainer_records(rows, name)),
        max_steps if isinstance(max_steps, int) and max_steps > 0 else None,
    )


def trainer_records(rows: Sequence[Mapping[str, Any]], job: str) -> list[Record]:
    """Records from ``log_history`` rows: a training row per ``loss``, an eval per ``eval_loss``.

    What the live callback sends: a step only when the Trainer logged a
    ``loss`` (rows of end-of-training summaries carry ``train_loss`` and are
    not steps), an eval when it logged an ``eval_loss``.
    """
    records: list[Record] = []
    for row in rows:
        step = _int(row.get("step"))
        if step is None:
            continue
        if "loss" in row:
            records.append(
                Step(
                    job=job,
                    step=step,
                    time=float(step),
                    loss=_number(row.get("loss")),
                    grad_norm=_number(row.get("grad_norm")),
                    lr=_lrs(row.get("learning_rate")),
                    grad_norm_logged="grad_norm" in row,
                )
            )
        if "eval_loss" in row:
            loss = _number(row.get("eval_loss"))
            metrics = {
                k.removeprefix("eval_"): v
                for k, v in row.items()
                if k.startswith("eval_") and k != "eval_loss" and _number(v) is not None
            }
            records.append(
                Eval(
                    job=job,
                    step=step,
                    time=float(step),
                    loss=loss,
                    metrics={k: float(v) for k, v in metrics.items()},
                )
            )
    return mark_overflow_skips(records)


def read_lightning_csv(path: str | PathLike[str], job: str | None = None) -> ImportedRun:
    """Import a Lightning ``CSVLogger`` ``metrics.csv`` (or ``.csv.gz``)."""
    file = Path(path)
    reader = csv.DictReader(_open_text(file).splitlines())
    columns = tuple(reader.fieldnames or ())
    if "step" not in columns:
        raise HistoryError(f"{file}: no 'step' column; is this a Lightning CSVLogger metrics.csv?")
    loss_col = next((c for c in LOSS_COLUMNS if c in columns), None)
    val_col = next((c for c in VAL_COLUMNS if c in columns), None)
    if loss_col is None and val_col is None:
        raise HistoryError(
            f"{file}: no training loss column (one of {', '.join(LOSS_COLUMNS)}) "
            f"and no validation loss column (one of {', '.join(VAL_COLUMNS)})"
        )
    lr_cols = [c for c in columns if c in LR_COLUMNS or _LR_MONITOR.match(c)]
    norm_col = next((c for c in GRAD_NORM_COLUMNS if c in columns), None)
    name = _job_name(file, job)
    return ImportedRun(
        name,
        "lightning_csv",
        tuple(lightning_records(reader, name, loss_col, val_col, lr_cols, norm_col)),
    )


def lightning_records(
    rows: Iterable[Mapping[str, str]],
    job: str,
    loss_col: str | None,
    val_col: str | None,
    lr_cols: Sequence[str],
    norm_col: str | None,
) -> list[Record]:
    """Records from CSVLogger rows. Lightning may flush a step's values over several rows
    (the learning-rate monitor's, the module's); rows of one step merge into one record."""
    steps: dict[int, dict[str, Any]] = {}
    evals: list[Eval] = []
    for row in rows:
        step = _int(_cell(row.get("step")))
        if step is None:
            continue
        if val_col is not None and (val := _cell(row.get(val_col))) is not None:
            evals.append(Eval(job=job, step=step, time=float(step), loss=_number(val)))
        found = steps.setdefault(step, {})
        for key, col in (("loss", loss_col), ("grad_norm", norm_col)):
            if col is not None and (cell := _cell(row.get(col))) is not None:
                found[key] = _number(cell)
        lrs = tuple(v for c in lr_cols if (v := _number(_cell(row.get(c)))) is not None)
        if lrs:
            found["lr"] = lrs
    records: list[Record] = [
        Step(
            job=job,
            step=s,
            time=float(s),
            loss=v.get("loss"),
            grad_norm=v.get("grad_norm"),
            lr=v.get("lr", ()),
            grad_norm_logged="grad_norm" in v,
        )
        for s, v in steps.items()
        if "loss" in v or "grad_norm" in v
    ]
    records += evals
    # Evals after the training step they follow, as the live path sends them.
    records.sort(key=lambda r: (r.step, isinstance(r, Eval)))
    return mark_overflow_skips(records)


def mark_overflow_skips(records: list[Record]) -> list[Record]:
    """Mark non-finite grad norms the run carried on past as GradScaler skips (module docstring).

    A start-up search skips several steps in a row, so a stretch of non-finite
    norms counts when every loss in it is finite and a finite norm follows.
    """
    skips: set[int] = set()
    stretch: list[int] = []
    for i, step in enumerate(records):
        if not isinstance(step, Step):
            continue
        if not _finite(step.loss):
            stretch = []  # a non-finite loss: the run did not carry on
        elif step.grad_norm is not None and not math.isfinite(step.grad_norm):
            stretch.append(i)
        else:
            skips.update(stretch)
            stretch = []
    return [
        replace(r, skipped=True, loss_scale=math.nan) if i in skips and isinstance(r, Step) else r
        for i, r in enumerate(records)
    ]


def with_gaps(records: Sequence[Record]) -> list[Record]:
    """``records`` plus an empty step for every step between two logged ones.

    The live Trainer callback sends every optimizer step, with the loss and
    grad norm only on logged ones: this is that stream, minus what only the
    agent measures. A rule's ``for:`` counts observations of its signal, so
    the rules must raise the same alerts with or without the gaps.
    """
    out: list[Record] = []
    last: int | None = None
    for record in records:
        if isinstance(record, Step):
            if last is not None and record.step - last <= MAX_GAP:
                out += [
                    Step(job=record.job, step=s, time=float(s))
                    for s in range(last + 1, record.step)
                ]
            last = record.step if last is None else max(last, record.step)
        out.append(record)
    return out


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _cell(value: str | None) -> str | None:
    return None if value is None or not value.strip() else value


def _number(value: Any) -> float | None:
    """A float from a JSON number or a CSV cell ('nan' and 'inf' included); None if not a number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _int(value: Any) -> int | None:
    """A step number, or None (the row is skipped) outside the wire's [0, 2**62)."""
    number = _number(value)
    if number is None or not math.isfinite(number) or not 0 <= number < MAX_STEP:
        return None
    return int(number)


def _lrs(value: Any) -> tuple[float, ...]:
    lr = _number(value)
    return () if lr is None else (lr,)
