"""``gradwatch report TRACE -o report.html [--rules FILE]``: the HTML post-mortem of a trace.

Exit status: 0 when the report was written; 2 for an unreadable or invalid
trace, a bad rule file, or an output path that cannot be written. When stderr
is a terminal, a progress bar there counts the trace's bytes read and replayed
(nothing is drawn into a pipe or a log).

Example::

    from gradwatch.report.cli import report_main
    report_main(["traces/run-42.jsonl", "-o", "report.html"])
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gradwatch.progress import progress_lines
from gradwatch.report import write_report
from gradwatch.rules import RuleFileError, load_default_rules, load_rules
from gradwatch.wire.trace import TraceError


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradwatch report",
        description="Write a self-contained HTML post-mortem of a recorded trace: loss, "
        "learning rate, gradient norms, per-layer heatmap, activations, loss scale, and every "
        "alert with its diagnosis.",
    )
    parser.add_argument(
        "trace", type=Path, help="a trace recorded with `gradwatch collector --record DIR`"
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("report.html"),
        help="where to write the HTML (default: report.html)",
    )
    parser.add_argument(
        "--rules",
        type=Path,
        default=None,
        help="rule file to replay with (default: the packaged rules)",
    )
    return parser


def report_main(argv: Sequence[str]) -> int:
    args = report_parser().parse_args(list(argv))
    try:
        rules = load_rules(args.rules) if args.rules is not None else load_default_rules()
    except RuleFileError as exc:
        print(f"gradwatch report: {exc}", file=sys.stderr)
        return 2
    try:
        with progress_lines(args.trace, f"report {args.trace.name}") as lines:
            out = write_report(lines, args.output, rules, source=str(args.trace))
    except TraceError as exc:
        print(
            f"gradwatch report: {exc}\nIs {args.trace} a trace written by "
            "`gradwatch collector --record`?",
            file=sys.stderr,
        )
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(
            f"gradwatch report: {exc}; check the trace path and that the output folder is writable",
            file=sys.stderr,
        )
        return 2
    print(f"gradwatch report: wrote {out}")
    return 0
