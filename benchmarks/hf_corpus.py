"""Replay the labelled real Hugging Face logs through the rules: false pages and detections.

The corpus (``../shared/data/hf-trainer-logs`` beside the repository: 51
``trainer_state.json`` files from public repositories, labelled by fixed rules
in its README before any monitor saw them) is what the Trainer callback would
have sent live. Every alert on a healthy run is a false alarm: a warning or
critical one is a false *page*. A broken run counts as detected when an alert
of a fitting category fired (label -> categories in :data:`FITTING`).

Run::

    .venv/bin/python benchmarks/hf_corpus.py            # per-run alerts, then the summary
    .venv/bin/python benchmarks/hf_corpus.py --summary  # the summary only
    .venv/bin/python benchmarks/hf_corpus.py --rules my-rules.yaml

``tests/rules/test_hf_corpus.py`` asserts the summary's goals.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gradwatch.rules import Alert, RuleSpec, load_default_rules, load_rules
from gradwatch.rules.replay import backtest

CORPUS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "hf-trainer-logs"

# What a fitting alert is for each broken label (the corpus README's codes; DESIGN.md categories).
FITTING: dict[str, frozenset[str]] = {
    "B1": frozenset({"numerical"}),
    "B2": frozenset({"dead_pipeline"}),
    "B3": frozenset({"exploding_gradients", "loss_spike"}),
    "B4": frozenset({"lr_too_high"}),
    "B5": frozenset({"lr_too_high"}),
    "B6": frozenset({"generalization_gap"}),
}
PAGES = ("warning", "critical")


@dataclass(frozen=True, slots=True)
class RunResult:
    """What fired on one labelled log."""

    file: str
    label: str  # healthy, broken or unclear
    why: str  # the label's reason, from runs.csv
    steps: int
    evals: int
    alerts: tuple[Alert, ...]

    @property
    def codes(self) -> tuple[str, ...]:
        """The broken-label codes (B1..B6) the reason names."""
        return tuple(code for code in FITTING if code in self.why)

    @property
    def pages(self) -> tuple[Alert, ...]:
        return tuple(a for a in self.alerts if a.severity in PAGES)

    @property
    def fitting(self) -> tuple[Alert, ...]:
        """Alerts whose category fits one of the label's codes."""
        wanted = frozenset().union(*(FITTING[c] for c in self.codes)) if self.codes else frozenset()
        return tuple(a for a in self.alerts if a.category in wanted)


@dataclass(frozen=True, slots=True)
class Summary:
    healthy: int
    false_page_runs: int
    false_pages: int
    info_runs: int
    infos: int
    broken: int
    detected: int
    unclear: int
    unclear_alerting: int


def evaluate(
    corpus: Path = CORPUS, rules: Sequence[RuleSpec] | None = None, *, gaps: bool = False
) -> list[RunResult]:
    """Replay every log of ``corpus/runs.csv``; raises ``FileNotFoundError`` without the corpus.

    ``gaps``: feed the unlogged steps too, as the live callback does (slower; same alerts).
    """
    rules = load_default_rules() if rules is None else rules
    results = []
    with (corpus / "runs.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        run, transitions = backtest(corpus / "runs" / row["file"], rules, gaps=gaps)
        fired = tuple(t.alert for t in transitions if t.current == "firing")
        results.append(
            RunResult(row["file"], row["label"], row["why"], run.steps, run.evals, fired)
        )
    return results


def summarize(results: Sequence[RunResult]) -> Summary:
    healthy = [r for r in results if r.label == "healthy"]
    broken = [r for r in results if r.label == "broken"]
    unclear = [r for r in results if r.label == "unclear"]
    infos = [a for r in healthy for a in r.alerts if a.severity == "info"]
    return Summary(
        healthy=len(healthy),
        false_page_runs=sum(bool(r.pages) for r in healthy),
        false_pages=sum(len(r.pages) for r in healthy),
        info_runs=sum(any(a.severity == "info" for a in r.alerts) for r in healthy),
        infos=len(infos),
        broken=len(broken),
        detected=sum(bool(r.fitting) for r in broken),
        unclear=len(unclear),
        unclear_alerting=sum(bool(r.alerts) for r in unclear),
    )


def _line(alert: Alert) -> str:
    return (
        f"    step {alert.step:>6}  {alert.severity:<8} {alert.rule} [{alert.category}]: "
        f"{alert.summary}"
    )


def report(results: Sequence[RunResult], out: object = sys.stdout, per_run: bool = True) -> Summary:
    summary = summarize(results)
    if per_run:
        for r in results:
            verdict = ""
            if r.label == "broken":
                verdict = "  DETECTED" if r.fitting else "  MISSED"
            elif r.label == "healthy" and r.pages:
                verdict = "  FALSE PAGE"
            print(f"{r.label:<8} {r.file}  ({r.steps} logs, {r.evals} evals){verdict}", file=out)
            if r.label != "healthy":
                print(f"    label: {r.why}", file=out)
            for alert in r.alerts:
                print(_line(alert), file=out)
        print(file=out)
    s = summary
    print(
        f"healthy runs: {s.healthy}; false pages (warning/critical): {s.false_pages} on "
        f"{s.false_page_runs} run(s); info alerts: {s.infos} on {s.info_runs} run(s)",
        file=out,
    )
    print(
        f"broken runs:  {s.broken}; detected with a fitting category: {s.detected}/{s.broken}",
        file=out,
    )
    print(f"unclear runs: {s.unclear}; with any alert: {s.unclear_alerting}", file=out)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="corpus folder (with runs.csv)")
    parser.add_argument("--rules", type=Path, help="rule file (default: the packaged rule pack)")
    parser.add_argument("--summary", action="store_true", help="print the summary only")
    parser.add_argument(
        "--gaps",
        action="store_true",
        help="also feed the unlogged steps between logs, as the live callback sends them",
    )
    args = parser.parse_args(argv)
    rules = load_rules(args.rules) if args.rules else None
    report(evaluate(args.corpus, rules, gaps=args.gaps), per_run=not args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
