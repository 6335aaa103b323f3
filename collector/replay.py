"""``gradwatch replay FILE``: the alerts the rules would have raised over a trace or training log.

FILE is a trace the collector recorded (JSON Lines), or a training log the
user already has, for backtesting before turning paging on: a Hugging Face
``trainer_state.json`` (or ``.json.gz``) or a Lightning ``CSVLogger``
``metrics.csv`` (see :mod:`gradwatch.rules.imports`), told apart by name.

Prints one row per transition (``firing`` or ``resolved``) as a table, or one
JSON object per line with ``--json``: ``{"transition", "previous", "alert"}``
where ``alert`` is ``Alert.to_dict()`` with ``last_good_checkpoint`` filled
from the trace's checkpoint events. Exit status: 0 when the trace was read
(alerts or not); 2 for an unreadable or invalid trace (``--strict``) or log,
or a bad rule file. When stderr is a terminal, a progress bar there counts the
trace's bytes read (nothing is drawn into a pipe or a log).

Example::

    from gradwatch.collector.replay import run_replay
    run_replay(Path("traces/run-42.jsonl"), json_lines=True)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from gradwatch.progress import progress_lines
from gradwatch.rules import RuleFileError, RuleSpec, Transition, load_default_rules, load_rules
from gradwatch.rules.imports import HistoryError, history_format, read_history
from gradwatch.rules.replay import Replay, replay_records
from gradwatch.wire.trace import TraceError

COLUMNS = ("STEP", "STATE", "SEVERITY", "RULE", "CATEGORY", "RANK", "SUMMARY")


def format_table(transitions: Sequence[Transition]) -> str:
    """A fixed-width table of transitions, one per line, with a header row."""
    rows = [COLUMNS] + [
        (
            str(t.alert.step),
            t.current,
            t.alert.severity,
            t.alert.rule,
            t.alert.category,
            "-" if t.alert.rank is None else str(t.alert.rank),
            t.alert.summary,
        )
        for t in transitions
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def json_line(transition: Transition) -> str:
    """One transition as strict JSON."""
    body = {
        "transition": transition.current,
        "previous": transition.previous,
        "alert": transition.alert.to_dict(),
    }
    return json.dumps(body, allow_nan=False, ensure_ascii=False)


def run_replay(
    path: Path,
    rules_path: Path | None = None,
    *,
    json_lines: bool = False,
    strict: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Replay ``path`` and print the alerts; see the module docstring for the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        rules = load_rules(rules_path) if rules_path is not None else load_default_rules()
    except RuleFileError as exc:
        print(f"gradwatch replay: {exc}", file=err)
        return 2
    if history_format(path) is not None:
        return _replay_history(path, rules, json_lines, out, err)
    run = Replay(rules, strict=strict)
    try:
        with progress_lines(path, f"replay {path.name}", stream=err) as lines:
            transitions = run.run(lines)
    except TraceError as exc:
        named = TraceError(exc.problems, str(path))  # lines carry no name: the message gets it back
        print(f"gradwatch replay: {named}\nRerun without --strict to skip bad lines.", file=err)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"gradwatch replay: cannot read {path}: {exc}", file=err)
        return 2
    transitions = [
        replace(
            t, alert=replace(t.alert, last_good_checkpoint=run.last_good_checkpoint(t.alert.onset))
        )
        for t in transitions
    ]
    if json_lines:
        for transition in transitions:
            print(json_line(transition), file=out)
    else:
        job = run.header.job if run.header is not None else "?"
        fired = sum(t.current == "firing" for t in transitions)
        print(f"job {job}: {run.records} records, {fired} alert(s) fired", file=out)
        if transitions:
            print(format_table(transitions), file=out)
    if run.skipped:
        first = "; ".join(f"line {line}: {message}" for line, message in run.problems[:3])
        print(f"gradwatch replay: skipped {run.skipped} bad line(s) ({first})", file=err)
    return 0


def _replay_history(
    path: Path, rules: Sequence[RuleSpec], json_lines: bool, out: TextIO, err: TextIO
) -> int:
    """Replay a training log (trainer_state.json, metrics.csv) as the live path fed it."""
    try:
        run = read_history(path)
    except HistoryError as exc:
        print(f"gradwatch replay: {exc}", file=err)
        return 2
    transitions = replay_records(run.records, rules)
    if json_lines:
        for transition in transitions:
            print(json_line(transition), file=out)
        return 0
    fired = sum(t.current == "firing" for t in transitions)
    print(
        f"job {run.job} ({run.format}): {run.steps} logged steps, {run.evals} evals, "
        f"{fired} alert(s) fired",
        file=out,
    )
    if transitions:
        print(format_table(transitions), file=out)
    return 0
