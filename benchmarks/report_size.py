"""Size, build time and browser render time of `gradwatch report` on a large synthetic trace.

Writes a synthetic trace (default 1,000 layers x 2,000 steps, with an lr fault;
tests/report/synthetic.py, written with the trace writer), then builds its
report ``--repeat`` times in fresh processes and renders each page in headless
Chromium, printing medians. With ``--baseline REV`` the report package as it was
at git revision REV is built and rendered side by side, alternating runs, and
the ratios are printed (issue 16 measured the unbinned report: 32 MB, 240k SVG
rects, 13.3 s to build, 15 s to render).

Build time is wall and CPU seconds of ``load_report_data`` (read + replay
through the default rules) and ``render_report`` (HTML). Render time is the
wall time of a headless Chromium screenshot, and the same minus an empty page's
(the browser's start-up).

Run from the repository root::

    .venv/bin/python benchmarks/report_size.py --baseline a0619ad
    .venv/bin/python benchmarks/report_size.py --layers 100 --steps 200 --repeat 1 --no-browser
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

# Run as a script: the shared trace generator lives in tests/report, under the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.binaries import find_binary
from tests.report.synthetic import write_synthetic_trace
from tests.report.test_report_browser import screenshot

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter per build, so no run warms another's caches. With
# GRADWATCH_REPORT_FROM set, gradwatch.report is loaded from that folder instead.
CHILD = r"""
import importlib.util, json, os, sys, time
from pathlib import Path
folder = os.environ.get("GRADWATCH_REPORT_FROM")
if folder:
    spec = importlib.util.spec_from_file_location(
        "gradwatch.report", Path(folder) / "__init__.py", submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["gradwatch.report"] = module
    spec.loader.exec_module(module)
from gradwatch.report import load_report_data, render_report
from gradwatch.rules import load_default_rules
trace, out = Path(sys.argv[1]), Path(sys.argv[2])
rules = load_default_rules()
w0, c0 = time.perf_counter(), time.process_time()
data = load_report_data(trace, rules)
w1, c1 = time.perf_counter(), time.process_time()
html = render_report(data, source=str(trace))
w2, c2 = time.perf_counter(), time.process_time()
out.write_text(html, encoding="utf-8")
print(json.dumps({"load_wall": w1 - w0, "load_cpu": c1 - c0, "render_wall": w2 - w1,
                  "render_cpu": c2 - c1, "bytes": len(html.encode()),
                  "rects": html.count("<rect")}))
"""


def build(trace: Path, out: Path, package: Path | None) -> dict[str, float]:
    env = dict(os.environ)
    if package is not None:
        env["GRADWATCH_REPORT_FROM"] = str(package)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(trace), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"building the report failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def render_seconds(chromium: str, page: Path, work: Path) -> float:
    shot = work / "shot.png"
    start = time.perf_counter()
    done = screenshot(chromium, page, shot, work / "profile")
    seconds = time.perf_counter() - start
    if done.returncode or not shot.exists():
        raise SystemExit(f"chromium failed on {page}:\n{done.stderr[-2000:]}")
    shot.unlink()
    return seconds


def extract(rev: str, into: Path) -> Path:
    """The report package as it was at ``rev`` (``git archive``), unpacked under ``into``."""
    done = subprocess.run(
        ["git", "archive", rev, "report"], capture_output=True, cwd=ROOT, check=False
    )
    if done.returncode:
        raise SystemExit(
            f"git archive {rev} report failed: {done.stderr.decode()[-500:]}; "
            "give a revision of this repository that has report/"
        )
    with tarfile.open(fileobj=BytesIO(done.stdout)) as archive:
        archive.extractall(into, filter="data")
    return into / "report"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--repeat", type=int, default=3, help="builds and renders per version (median)"
    )
    parser.add_argument(
        "--baseline", metavar="REV", help="also measure report/ at this git revision"
    )
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium render timing")
    args = parser.parse_args()
    chromium = None if args.no_browser else find_binary("chromium")
    if not args.no_browser and chromium is None:
        raise SystemExit(
            "chromium is not installed (`apt-get install -y chromium`); or pass --no-browser"
        )
    with tempfile.TemporaryDirectory(prefix="report_size_") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        trace = write_synthetic_trace(work / "trace.jsonl", layers=args.layers, steps=args.steps)
        print(
            f"trace: {args.layers} layers x {args.steps} steps, "
            f"{trace.stat().st_size / 1e6:.1f} MB, "
            f"written in {time.perf_counter() - start:.1f} s"
        )
        versions: dict[str, Path | None] = {"current": None}
        if args.baseline:
            versions = {
                f"baseline {args.baseline}": extract(args.baseline, work / "baseline"),
                **versions,
            }
        (work / "empty.html").write_text("<!DOCTYPE html><title>empty</title>", encoding="utf-8")
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
        for _ in range(args.repeat):
            for name, package in versions.items():  # alternating, so drift hits both alike
                page = work / f"{name.split()[0]}.html"
                result = build(trace, page, package)
                if chromium is not None:
                    result["chromium"] = render_seconds(chromium, page, work)
                    result["chromium_empty"] = render_seconds(chromium, work / "empty.html", work)
                runs[name].append(result)
        report(runs, args.repeat)


def report(runs: dict[str, list[dict[str, float]]], repeat: int) -> None:
    medians = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    for name, m in medians.items():
        build_wall, build_cpu = m["load_wall"] + m["render_wall"], m["load_cpu"] + m["render_cpu"]
        print(f"\n{name} (median of {repeat}):")
        print(f"  html size      {m['bytes'] / 1e6:8.2f} MB   <rect> elements {int(m['rects']):,}")
        print(
            f"  build          {build_wall:8.2f} s wall {build_cpu:7.2f} s cpu "
            f"(load+replay {m['load_wall']:.2f} s wall {m['load_cpu']:.2f} cpu; "
            f"render {m['render_wall']:.2f} s wall {m['render_cpu']:.2f} cpu)"
        )
        if "chromium" in m:
            print(
                f"  chromium       {m['chromium']:8.2f} s wall "
                f"(empty page {m['chromium_empty']:.2f} s: "
                f"{m['chromium'] - m['chromium_empty']:.2f} s for this page)"
            )
    if len(medians) == 2:
        (old_name, old), (new_name, new) = medians.items()
        print(f"\n{old_name} / {new_name}:")
        print(
            f"  size x{old['bytes'] / new['bytes']:.1f}, rects x{old['rects'] / new['rects']:.1f}, "
            f"render_report x{old['render_cpu'] / new['render_cpu']:.1f} (cpu), "
            f"build x{_build_cpu(old) / _build_cpu(new):.2f} (cpu)"
        )
        if "chromium" in old:
            net_old = old["chromium"] - old["chromium_empty"]
            net_new = new["chromium"] - new["chromium_empty"]
            print(
                f"  chromium x{old['chromium'] / new['chromium']:.1f} wall, "
                f"x{net_old / max(net_new, 1e-3):.1f} net of start-up"
            )


def _build_cpu(m: dict[str, float]) -> float:
    return m["load_cpu"] + m["render_cpu"]


if __name__ == "__main__":
    main()
