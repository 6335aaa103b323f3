"""``gradwatch demo``: the seed's debugging procedure on its worked example, end to end.

A collector daemon (a subprocess, as in production) records every job and
posts alerts to a local webhook receiver. The job is the seed's worked example
(:mod:`gradwatch.seed_example`): a 6-layer tanh MLP with Xavier init scaled
10x, SGD at lr 0.1, 300 steps memorizing 12 examples, then the full set. The
story, in the seed's order:

1. Stage 1 preflight (memorization) on the broken model;
2. the monitored run: the alert and its diagnosis arrive while it trains;
3. the fix (the correct init), its preflight and its monitored run;
4. the post-mortem report of both runs (self-contained HTML).

Nothing is faked: every number printed is measured in this run. Where the
seed's narrative and the measurement differ (the broken model *passes* the
memorization test here), the demo says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 30.0
ALERT_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 15.0
BROKEN, FIXED = "seed-broken-init", "seed-fixed-init"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradwatch demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gradwatch-demo"),
        help="folder for the recorded traces and reports (default ./gradwatch-demo)",
    )
    parser.add_argument(
        "--full-steps",
        type=int,
        default=300,
        help="steps on the full set after memorization (default 300)",
    )
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.002,
        help="seconds each step stands in for a real model's compute",
    )
    args = parser.parse_args(argv)
    return Demo(args.out, args.full_steps, args.step_time).run()


class Demo:
    def __init__(self, out: Path, full_steps: int, step_time: float) -> None:
        self.out = out
        self.full_steps = full_steps
        self.step_time = step_time
        self.shown: set[tuple[str, str]] = set()

    def run(self) -> int:
        from gradwatch.collector.receiver import WebhookReceiver

        print(
            "gradwatch demo: the seed's procedure on its worked example "
            "(6-layer tanh MLP, Xavier init x10, SGD lr 0.1)\n"
        )
        started = time.monotonic()
        traces = self.out / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        with WebhookReceiver() as receiver:
            collector, ready = start_collector(
                self.out, ["--webhook", receiver.url, "--record", str(traces)]
            )
            try:
                print(
                    f"[1/5] collector   pid {collector.pid}, ingest {ready['listen']}, metrics "
                    f"{ready['metrics_url']}, recording to {traces}/; webhook {receiver.url}"
                )
                self._job(BROKEN, 10.0, "[2/5]", ready["listen"], receiver)
                broken = self._await(receiver, BROKEN, "saturation")
                self._explain(broken)
                self._job(FIXED, 1.0, "[3/5]", ready["listen"], receiver)
                fixed = [
                    b
                    for b in receiver.bodies
                    if b.get("job") == FIXED and b.get("state") == "firing"
                ]
                print(
                    f"      {len(fixed)} alert(s) on the fixed run"
                    + ("" if fixed else ": the correct init trains clean")
                )
                _print_metrics(ready["metrics_url"])
            finally:
                stop_collector(collector)
        return self._report(traces, broken, fixed, time.monotonic() - started)

    # ------------------------------------------------------------ one job

    def _job(self, job: str, init_scale: float, label: str, endpoint: str, receiver: Any) -> None:
        import torch

        import gradwatch
        from gradwatch import seed_example as seed
        from gradwatch.preflight import memorization

        torch.manual_seed(0)
        x, y = seed.tabular()
        model = seed.seed_model(init_scale)
        print(f"\n{label} job {job!r}: Xavier init x{init_scale:g}")
        check = memorization(model, seed.fragile_nll, (x[: seed.SUBSET], y[: seed.SUBSET]))
        print("      Stage 1 preflight: " + str(check).replace("\n", "\n      "))
        if check.passed and init_scale != 1.0:
            print(
                "      (the seed expects this broken model to fail; measured, it memorizes 12 "
                "points easily: saturated tanh units act as fixed binary features. Stage 1 is "
                "necessary, not sufficient; the monitored run is what catches it.)"
            )
        total = seed.SUBSET_STEPS + self.full_steps
        print(
            f"      monitored run: {seed.SUBSET_STEPS} steps on {seed.SUBSET} examples, then "
            f"{self.full_steps} on the full set (announced with mon.data_changed)"
        )
        monitors: list[Any] = []

        def watch(m: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
            monitors.append(gradwatch.watch(m, opt, job=job, endpoint=endpoint, stats_every=10))
            return monitors[-1]

        def progress(step: int, loss: float) -> None:
            if step % 100 == 0 or step == total:
                print(f"      step {step:4d}  loss {loss:10.4g}")
            self._show_new_alerts(receiver)
            if self.step_time:
                time.sleep(self.step_time)

        try:
            seed.run(model, x, y, watch, full_steps=self.full_steps, on_step=progress)
        finally:
            for mon in monitors:
                mon.close()

    def _await(self, receiver: Any, job: str, category: str) -> list[dict[str, Any]]:
        def arrived(bodies: list[dict[str, Any]]) -> bool:
            return any(b.get("job") == job and b.get("category") == category for b in bodies)

        receiver.wait_for(arrived, timeout=ALERT_TIMEOUT_S)
        self._show_new_alerts(receiver)
        return [b for b in receiver.bodies if b.get("job") == job and b.get("state") == "firing"]

    def _show_new_alerts(self, receiver: Any) -> None:
        for body in receiver.bodies:
            key = (str(body.get("id")), str(body.get("state")))
            if key in self.shown:
                continue
            self.shown.add(key)
            mark = "!!" if body.get("severity") == "critical" else " !"
            print(
                f"   {mark} webhook got {body.get('state')} {body.get('rule')} "
                f"[{body.get('category')}, {body.get('severity')}] from step {body.get('step')}: "
                f"{body.get('summary')}"
            )

    @staticmethod
    def _explain(firing: list[dict[str, Any]]) -> None:
        for body in firing[:1]:
            diagnosis = body.get("diagnosis") or {}
            print(f"      evidence: {json.dumps(body.get('evidence'), default=str)[:300]}")
            print(f"      diagnosis: {diagnosis.get('summary', '(none)')}")
            for check in list(diagnosis.get("next_checks") or [])[:3]:
                print(f"        next: {check}")

    # ------------------------------------------------------------ the end

    def _report(
        self,
        traces: Path,
        broken: list[dict[str, Any]],
        fixed: list[dict[str, Any]],
        elapsed: float,
    ) -> int:
        from gradwatch.report import write_report

        print("\n[5/5] post-mortem reports (self-contained HTML; open in a browser):")
        for job in (BROKEN, FIXED):
            trace = traces / f"{job}.jsonl"
            if not trace.exists():
                print(f"      no trace was recorded for {job} at {trace}", file=sys.stderr)
                return 1
            path = write_report(trace, self.out / f"report-{job}.html")
            print(f"      {path.resolve()}")
        caught = any(b.get("category") == "saturation" for b in broken)
        print(
            f"\ndone in {elapsed:.0f} s: the broken init raised {len(broken)} alert(s) "
            f"({', '.join(sorted({str(b.get('category')) for b in broken})) or 'none'}), "
            f"the fix raised {len(fixed)}."
        )
        if not caught or fixed:
            print(
                "the demo's expected outcome did not happen: see the collector's log above",
                file=sys.stderr,
            )
            return 1
        return 0


def start_collector(
    out: Path,
    args: Sequence[str],
    log: Path | None = None,
    timeout: float = READY_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A ``gradwatch collector`` subprocess on loopback ports of its choosing, with ``args``
    added (``--webhook URL``, ``--record DIR``), once its ready file in ``out`` says where
    it listens (``listen``, ``metrics_url``); its output goes to ``log`` when given, and
    ``env`` is added to its environment (``GRADWATCH_*`` settings). Also used by
    benchmarks/trials.py and benchmarks/load_measure.py."""
    ready_file = out / "collector-ready.json"
    ready_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "gradwatch",
        "collector",
        "--listen",
        "tcp://127.0.0.1:*",
        "--metrics-addr",
        "127.0.0.1:0",
        *args,
        "--ready-file",
        str(ready_file),
        "--log-level",
        "warning",
    ]
    see = f"; see {log}" if log is not None else ""
    full = None if env is None else {**os.environ, **env}
    if log is None:
        proc = subprocess.Popen(cmd, env=full)
    else:
        with open(log, "ab") as sink:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=full)
    deadline = time.monotonic() + timeout
    # The collector writes the file whole, then renames it (collector/server.py).
    while not ready_file.exists():
        if proc.poll() is not None:
            raise SystemExit(
                f"the collector exited with code {proc.returncode} before it was ready{see}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the collector was not ready within {timeout:.0f} s{see}")
        # Polling a file the child writes once: there is no event to wait on
        # across processes without more machinery than a demo deserves.
        time.sleep(0.05)
    return proc, json.loads(ready_file.read_text())


def stop_collector(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, so the collector drains and closes its trace files; killed if it hangs."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _print_metrics(url: str) -> None:
    print("\n[4/5] metrics scraped from the collector's /metrics (what Prometheus sees):")
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    wanted = ("gradwatch_job_step", "gradwatch_job_loss", "gradwatch_alerts_firing")
    for line in text.splitlines():
        if line.startswith(wanted):
            print(f"      {line}")
