"""Scored fault suite: real PyTorch faults and healthy controls through agent -> collector -> rules.

Runs every scenario of ``tests/scenarios/`` (``families.ALL_SCENARIOS``: the
original suite, then the fault families with their healthy twins; CPU, seconds
each) and prints, per category: recall (detected/total, any severity), paged (caught by a
warning-or-higher alert), median and max steps
from the fault's onset to the alert's step, and "other alerts" (alerts of another
category that began before the expected one); then false alarms on healthy
controls (an alert above the severity the control allows). The families held out
from rule design (``families.HELD_OUT``) get a table of their own.
``--json`` prints the full per-scenario results as JSON instead.

    python benchmarks/fault_suite.py [--json] [-k SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from scenarios.families import ALL_SCENARIOS, HELD_OUT
from scenarios.scenario_lib import Result, run_scenario


def table(results: list[Result]) -> str:
    by_cat: dict[str, list[Result]] = defaultdict(list)
    controls = [r for r in results if r.scenario.category is None]
    for r in results:
        if r.scenario.category is not None:
            by_cat[r.scenario.category].append(r)
    lines = [
        f"{'category':<22}{'recall':>8}{'paged':>7}{'median':>8}{'max':>6}{'other':>7}  missed",
        "-" * 85,
    ]
    tot = det = pag = oth = 0
    for cat in sorted(by_cat):
        rs = by_cat[cat]
        lat = [r.latency for r in rs if r.latency is not None]
        d = sum(r.detected for r in rs)
        p = sum(_paged(r) for r in rs)
        o = sum(len(r.other) for r in rs)
        tot, det, pag, oth = tot + len(rs), det + d, pag + p, oth + o
        missed = ",".join(r.scenario.name for r in rs if not r.detected)
        lines.append(
            f"{cat:<22}{f'{d}/{len(rs)}':>8}{p:>7}"
            f"{(f'{statistics.median(lat):g}' if lat else '-'):>8}"
            f"{(str(max(lat)) if lat else '-'):>6}{o:>7}  {missed}"
        )
    lines.append("-" * 85)
    every = [r.latency for rs in by_cat.values() for r in rs if r.latency is not None]
    lines.append(
        f"{'all faults':<22}{f'{det}/{tot}':>8}{pag:>7}"
        f"{(f'{statistics.median(every):g}' if every else '-'):>8}"
        f"{(str(max(every)) if every else '-'):>6}{oth:>7}"
    )
    fa = [r for r in controls if r.false_alarm]
    lines.append(
        f"controls: {len(fa)}/{len(controls)} with a false alarm"
        + "".join(f"\n  {r.scenario.name}: " + _alerts(r.other) for r in fa)
    )
    others = [r for r in results if r.scenario.category and r.other]
    for r in others:
        lines.append(f"  other alerts in {r.scenario.name}: " + _alerts(r.other))
    return "\n".join(lines)


def _paged(r: Result) -> bool:
    """Caught by a warning-or-higher alert of an accepted category (an info note does not page)."""
    return any(
        f.category in r.scenario.accepted and f.severity in ("warning", "critical") for f in r.fired
    )


def _alerts(fired: list) -> str:
    return ", ".join(f"{f.rule}[{f.category}/{f.severity}]@{f.step}" for f in fired)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print per-scenario results as JSON")
    p.add_argument("-k", default="", help="only scenarios whose name contains this")
    p.add_argument("-v", action="store_true", help="one line per scenario as it finishes")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for s in ALL_SCENARIOS:
        if args.k in s.name:
            r = run_scenario(s)
            results.append(r)
            if args.v:
                print(
                    f"{s.name:<40} {s.category!s:<20} det={r.detected!s:<5} "
                    f"lat={r.latency} {r.seconds:5.1f}s fired=" + _alerts(r.fired),
                    file=sys.stderr,
                )
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        shown = [r for r in results if r.scenario.name not in HELD_OUT]
        held = [r for r in results if r.scenario.name in HELD_OUT]
        if shown:
            print(table(shown))
        if held:
            print("\nheld out from rule design (families.HELD_OUT):")
            print(table(held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
