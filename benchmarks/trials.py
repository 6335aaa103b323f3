"""What every trial on outside training code shares: running it, scoring its alerts.

A trial (``nanogpt_trial.py``, ``mingpt_trial.py``, ``llama2c_trial.py``,
``hf_trainer_trial.py``, ...) patches a copy of someone else's training script the way a
user would attach gradwatch, runs each variant under a real ``gradwatch collector
--record`` subprocess (:func:`run_recorded`), replays the trace with the current rules
and prints one scored table (:func:`report`): on ``healthy`` every warning-or-higher
alert is a false page; each broken variant should raise one of a fitting category,
and its first next checks should contain advice that would help.

    p, args, variants = trial_args(__doc__, "nanogpt", ACCEPT, ITERS, argv)
    report(traces, "nanogpt", variants, args, ACCEPT, HELPFUL)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradwatch.demo import start_collector, stop_collector

# What fits a learning rate far too high. Seed Stage 4 adds weight runaway ("an
# exploding-gradient regime the optimizer partially absorbed") and dead units ("a learning
# rate that pushed units into a dead regime").
LR_TOO_HIGH = (
    "exploding_gradients",
    "lr_too_high",
    "loss_spike",
    "numerical",
    "update_ratio",
    "weight_runaway",
    "dead_units",
)


PAGING = ("warning", "critical")
# What the trials' scripts import but this machine lacks (benchmarks/standins/README.md).
STANDINS = Path(__file__).resolve().parent / "standins"
DATASET_BYTES = 1_000_000


def local_text(limit: int = DATASET_BYTES) -> str:
    """About ``limit`` characters of ASCII text found on this machine, in a fixed order."""
    sources = sorted(Path("/usr/share/common-licenses").glob("*"))
    stdlib = Path(os.__file__).parent
    sources += sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))
    parts: list[str] = []
    size = 0
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_bytes().decode("ascii", errors="ignore")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    data = "".join(parts)[:limit]
    if len(data) < limit // 2:
        raise SystemExit(f"only {len(data)} characters of local text found; need {limit // 2}+")
    return data


def replace_once(text: str, old: str, new: str, where: str) -> str:
    count = text.count(old)
    if count != 1:
        raise SystemExit(
            f"{where}: expected the line {old!r} once, found it {count} times; "
            "this checkout differs from the one the trial was written for"
        )
    return text.replace(old, new)


def insert_after(text: str, line: str, added: str, where: str) -> str:
    """``text`` with ``added`` right after ``line``, which must occur exactly once."""
    return replace_once(text, line, line + added, where)


def run_recorded(
    work: Path,
    traces: Path,
    job: str,
    vdir: Path,
    write: Callable[[str], list[str]],
    env: dict[str, str],
    threads: int = 1,
) -> Path:
    """Run one training script in ``vdir`` under a fresh recording collector; return its trace.

    ``write(endpoint)`` writes the patched script and returns its arguments; ``threads``:
    its OpenMP threads (one, unless a model is too slow for that on this machine).
    """
    proc, ready = start_collector(work, ["--record", str(traces)], work / "collector.log", 60.0)
    endpoint = ready["listen"]
    try:
        cmd = [sys.executable, *write(endpoint)]
        full = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            PYTHONWARNINGS="ignore",
            **env,
        )
        started = time.monotonic()
        with open(vdir / "train.log", "wb") as log:
            rc = subprocess.run(
                cmd, cwd=vdir, env=full, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        print(
            f"[{job}] {cmd[1]} exit {rc} after {time.monotonic() - started:.0f} s "
            f"(log {vdir / 'train.log'})",
            file=sys.stderr,
        )
    finally:
        stop_collector(proc)
    # A crashed script leaves a short trace that scores as a quiet run: the report says so.
    (traces / f"{job}.exit").write_text(f"{rc}\n")
    trace = traces / f"{job}.jsonl"
    if not trace.exists():
        raise SystemExit(f"no trace at {trace}; see {work / 'collector.log'}")
    (traces / f"{job}.train.log").write_bytes((vdir / "train.log").read_bytes())
    return trace


def run_patched(
    root: Path,
    work: Path,
    traces: Path,
    job: str,
    variant: str,
    patch: Callable[[str, str], str],
    args: list[str],
    *,
    main: str = "main.py",
    skip: tuple[str, ...] = (),
    prepare: Callable[[Path], None] | None = None,
    env: dict[str, str] | None = None,
    threads: int = 1,
) -> Path:
    """Train one variant of a checkout's script as :func:`run_recorded` does; return its trace.

    ``root`` is copied to ``work/variant`` (less ``.git`` and the names in ``skip``: data a
    checkout may hold that the trial replaces), ``prepare(vdir)`` adds what the
    script needs there (data, a stand-in command), and ``main`` is written as
    ``patch(text, endpoint)`` and run with ``args``, the stand-ins first on its path.
    """
    vdir = work / variant
    shutil.copytree(root, vdir, ignore=shutil.ignore_patterns(".git", *skip))
    if prepare is not None:
        prepare(vdir)

    def write(endpoint: str) -> list[str]:
        (vdir / main).write_text(patch((root / main).read_text(encoding="utf8"), endpoint))
        return [main, *args]

    full = {"PYTHONPATH": str(STANDINS), **(env or {})}
    return run_recorded(work, traces, job, vdir, write, full, threads)


# --------------------------------------------------------------------------- scoring


@dataclass
class Scored:
    variant: str
    alerts: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""

    @property
    def paging(self) -> list[dict[str, Any]]:
        return [a for a in self.alerts if a["severity"] in PAGING]


def replay(trace: Path, rules: Path | None) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "gradwatch", "replay", "--json", str(trace)]
    if rules is not None:
        cmd[4:4] = ["--rules", str(rules)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [r["alert"] for r in rows if r["transition"] == "firing"]


def score(
    variant: str,
    alerts: list[dict[str, Any]],
    accepts: Mapping[str, tuple[str, ...] | None],
    helpful: Mapping[str, tuple[str, ...]],
) -> Scored:
    """The variant's verdict: its fitting categories ``accepts`` (empty: healthy; None: no
    label, shown but not scored), its helpful advice ``helpful``."""
    s = Scored(variant, alerts)
    accept = accepts.get(variant, ())
    if accept is None:  # neither healthy nor a fault: shown, not scored
        s.verdict = f"NOT SCORED (no label): {len(s.paging)} warning-or-higher"
        return s
    if not accept:
        n = len(s.paging)
        s.verdict = "PASS: no page" if n == 0 else f"FAIL: {n} false page(s)"
        return s
    hits = sorted((a for a in s.paging if a["category"] in accept), key=lambda a: a["step"])
    if hits:
        first = hits[0]
        s.verdict = f"CAUGHT by {first['rule']} [{first['category']}] at step {first['step']}"
        useful = [a for a in hits if _helps(helpful.get(variant, ()), a)]
        s.verdict += (
            "; helpful advice "
            + (
                "first"
                if useful[:1] == [first]
                else f"from {useful[0]['rule']} at step {useful[0]['step']}"
            )
            if useful
            else "; no alert's first checks would help"
        )
    else:
        s.verdict = f"MISSED: no warning-or-higher alert in {accept}"
    return s


def _helps(words: tuple[str, ...], a: dict[str, Any]) -> bool:
    checks = list((a.get("diagnosis") or {}).get("next_checks") or [])[:3]
    return any(w in c.lower() for c in checks for w in words)


def _first_check(a: dict[str, Any]) -> str:
    d = a.get("diagnosis") or {}
    checks = d.get("next_checks") or []
    return f"verdict {d.get('verdict', '-')}; first check: {checks[0] if checks else '-'}"


def table(results: list[Scored], max_rows: int = 12) -> str:
    lines = [
        f"{'variant':<12} {'rule':<34} {'category':<20} {'severity':<9} {'step':>5}  diagnosis",
        "-" * 118,
    ]
    for r in results:
        shown = sorted(r.alerts, key=lambda a: a["step"])
        for a in shown[:max_rows]:
            lines.append(
                f"{r.variant:<12} {a['rule']:<34} {a['category']:<20} {a['severity']:<9} "
                f"{a['step']:>5}  {_first_check(a)[:120]}"
            )
        if len(shown) > max_rows:
            lines.append(f"{r.variant:<12} ... {len(shown) - max_rows} more firing(s)")
        if not shown:
            lines.append(f"{r.variant:<12} (no alert)")
        lines.append(
            f"{r.variant:<12} => {r.verdict}  ({len(r.alerts)} firing(s), "
            f"{len(r.paging)} warning-or-higher)"
        )
        lines.append("")
    return "\n".join(lines)


def trial_args(
    doc: str,
    checkout: str | None,
    variants: Mapping[str, tuple[str, ...] | None],
    iters: int,
    argv: list[str] | None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[str]]:
    """A trial's command line (a checkout positional named ``checkout``, if any), its variants."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if checkout is not None:
        p.add_argument(checkout, nargs="?", type=Path, help=f"a {checkout} checkout")
    names = ",".join(variants)
    p.add_argument("--variants", default=names, help="comma-separated, of " + names)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--keep", type=Path, help="keep traces and train logs in this folder")
    p.add_argument(
        "--replay-only",
        type=Path,
        metavar="DIR",
        help="skip training: replay the traces kept in DIR with the current rules",
    )
    p.add_argument("--rules", type=Path, help="rule file for replay (default: the packaged one)")
    p.add_argument("--json", action="store_true", help="print every firing alert as JSON too")
    args = p.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v]
    unknown = set(chosen) - set(variants)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {list(variants)}")
    return p, args, chosen


def report(
    traces: Path,
    prefix: str,
    variants: list[str],
    args: argparse.Namespace,
    accepts: Mapping[str, tuple[str, ...] | None],
    helpful: dict[str, tuple[str, ...]],
) -> None:
    """Replay each variant's trace with the current rules; print the table (and JSON)."""
    results = []
    for v in variants:
        trace = traces / f"{prefix}-{v}.jsonl"
        if not trace.exists():
            print(f"[{v}] no trace at {trace}; skipped", file=sys.stderr)
            continue
        results.append(score(v, replay(trace, args.rules), accepts, helpful))
        exit_file = traces / f"{prefix}-{v}.exit"
        code = exit_file.read_text().strip() if exit_file.exists() else "0"
        if code != "0":
            print(
                f"[{v}] the script exited with {code}: its row scores only the steps before "
                f"that (see {traces / f'{prefix}-{v}.train.log'})",
                file=sys.stderr,
            )
    print(table(results))
    if args.json:
        print(json.dumps({r.variant: r.alerts for r in results}, indent=1, default=str))


def checkout_trial(
    doc: str,
    name: str,
    marker: str,
    variants: tuple[Mapping[str, tuple[str, ...] | None], dict[str, tuple[str, ...]]],
    iters: int,
    run_variant: Callable[[Path, Path, Path, str, int], Path],
    argv: list[str] | None,
) -> int:
    """A trial of a checkout (its root has ``marker``): run each chosen variant, then score.

    ``variants``: (fitting categories, helpful advice) by variant, as ``score`` takes them;
    ``run_variant(checkout, work, traces, variant, iters)`` trains one and returns its trace.
    """
    accepts, helpful = variants
    p, args, chosen = trial_args(doc, name, accepts, iters, argv)
    if args.replay_only is not None:
        traces = args.replay_only
    else:
        root = getattr(args, name)
        if root is None or not (root / marker).exists():
            p.error(f"give the root of a {name} checkout (it has {marker}), or --replay-only")
        work = Path(tempfile.mkdtemp(prefix=f"{name}-trial-"))
        traces = args.keep or work / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        print(f"work dir {work}; gradwatch step = the script's own iteration", file=sys.stderr)
        for v in chosen:
            run_variant(root, work, traces, v, args.iters)
    report(traces, name, chosen, args, accepts, helpful)
    return 0
