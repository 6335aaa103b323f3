"""``gradwatch demo``: a real fault caught end to end on loopback.

A collector daemon (a subprocess, as in production), a local webhook receiver,
and a small real training job with the agent attached. The fault is real: SGD on
a least-squares problem with a learning rate above its stability limit
2/λmax(H). The gradient norm grows geometrically until float32 overflows; the
collector's rules see the growth first (with a projection of when it overflows)
and then the non-finite loss, and the alerts reach the webhook while the job
runs. Nothing is faked: every number below was measured by the agent.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

JOB = "demo"
READY_TIMEOUT_S = 30.0
ALERT_TIMEOUT_S = 10.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradwatch demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=140, help="training steps (default 140)")
    parser.add_argument("--lr", type=float, default=0.8,
                        help="learning rate; the problem is stable below ~0.64 (default 0.8)")
    parser.add_argument("--step-time", type=float, default=0.02,
                        help="seconds each step stands in for a real model's compute")
    args = parser.parse_args(argv)
    return Demo(args.steps, args.lr, args.step_time).run()


class Demo:
    def __init__(self, steps: int, lr: float, step_time: float) -> None:
        self.steps = steps
        self.lr = lr
        self.step_time = step_time
        self.shown: set[tuple[str, str]] = set()
        self.stable_below = 0.0

    def run(self) -> int:
        from gradwatch.collector.receiver import WebhookReceiver

        print("gradwatch demo: a learning rate above SGD's stability limit, caught live\n")
        with tempfile.TemporaryDirectory(prefix="gradwatch-demo-") as tmp, \
                WebhookReceiver() as receiver:
            collector, ready = _start_collector(Path(tmp), receiver.url)
            try:
                print(f"[1/4] collector  pid {collector.pid}, ingest {ready['listen']}, "
                      f"metrics {ready['metrics_url']}")
                print(f"[2/4] webhook    receiver at {receiver.url}")
                started = time.monotonic()
                self._train(ready["listen"], receiver)
                self._await_alerts(receiver)
                print("[4/4] metrics    scraped from the collector's /metrics:")
                _print_metrics(ready["metrics_url"])
                return self._summary(receiver, time.monotonic() - started)
            finally:
                collector.terminate()
                try:
                    collector.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    collector.kill()

    def _train(self, endpoint: str, receiver: Any) -> None:
        import torch

        import gradwatch

        torch.manual_seed(0)
        features = torch.randn(512, 32)
        targets = features @ torch.randn(32, 1) + 0.1 * torch.randn(512, 1)
        # MSE's Hessian is 2/n XᵀX: gradient descent is stable only for lr < 2/λmax.
        lam = torch.linalg.eigvalsh(2 * features.T @ features / len(features)).max()
        self.stable_below = 2 / float(lam)
        model = torch.nn.Linear(32, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)
        print(f"[3/4] training   least squares, 32 features, SGD lr={self.lr} "
              f"(stable only below 2/λmax = {self.stable_below:.2f}); {self.steps} steps\n")
        with gradwatch.watch(model, optimizer, job=JOB, endpoint=endpoint) as mon:
            for step in range(1, self.steps + 1):
                idx = torch.randint(0, len(features), (64,))
                loss = torch.nn.functional.mse_loss(model(features[idx]), targets[idx])
                loss.backward()
                optimizer.step()
                mon.log(loss=loss)
                optimizer.zero_grad()
                if step % 10 == 0:
                    # The demo's own progress line reads the loss on the host; the
                    # agent itself never does.
                    print(f"   step {step:4d}  loss {loss.item():10.3g}")
                self._show_new_alerts(receiver)
                time.sleep(self.step_time)
        print()

    def _await_alerts(self, receiver: Any) -> None:
        def numerical_arrived(bodies: list[dict[str, Any]]) -> bool:
            return any(b.get("category") == "numerical" for b in bodies)

        receiver.wait_for(numerical_arrived, timeout=ALERT_TIMEOUT_S)
        self._show_new_alerts(receiver)

    def _show_new_alerts(self, receiver: Any) -> None:
        for body in receiver.bodies:
            key = (str(body.get("id")), str(body.get("state")))
            if key in self.shown:
                continue
            self.shown.add(key)
            mark = "!!" if body.get("severity") == "critical" else " !"
            print(f"   {mark} webhook got {body.get('state')} {body.get('rule')} "
                  f"[{body.get('category')}, {body.get('severity')}] from step {body.get('step')}: "
                  f"{body.get('summary')}")

    def _summary(self, receiver: Any, elapsed: float) -> int:
        firing = [b for b in receiver.bodies if b.get("state") == "firing"]
        categories = sorted({str(b.get("category")) for b in firing})
        print(f"\n{len(firing)} alert(s) delivered in {elapsed:.1f} s: {', '.join(categories)}")
        for body in firing:
            print(f"\n{body.get('rule')}: evidence {json.dumps(body.get('evidence'), default=str)}")
            diagnosis = body.get("diagnosis") or {}
            if diagnosis:
                print(f"  diagnosis [{diagnosis.get('verdict')}]: {diagnosis.get('summary')}")
                for check in list(diagnosis.get("next_checks") or [])[:3]:
                    print(f"    next: {check}")
        if "numerical" not in categories:
            print("\nthe numerical alert did not arrive: see the collector's log above", file=sys.stderr)
            return 1
        print(f"\nWhat to do in a real run: lower the learning rate (here, below "
              f"{self.stable_below:.2f}), add warm-up or clipping, and roll back to a "
              "checkpoint saved before the growth began.")
        return 0


def _start_collector(tmp: Path, webhook_url: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    ready_file = tmp / "ready.json"
    cmd = [sys.executable, "-m", "gradwatch", "collector", "--listen", "tcp://127.0.0.1:*",
           "--metrics-addr", "127.0.0.1:0", "--webhook", webhook_url,
           "--ready-file", str(ready_file), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready_file.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the collector exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the collector was not ready within {READY_TIMEOUT_S:.0f} s")
        # Polling a file the child writes once: there is no event to wait on
        # across processes without more machinery than a demo deserves.
        time.sleep(0.05)
    return proc, json.loads(ready_file.read_text())


def _print_metrics(url: str) -> None:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    wanted = ("gradwatch_job_step", "gradwatch_job_grad_norm", "gradwatch_job_loss",
              "gradwatch_alerts_firing", "gradwatch_ingest_messages_total")
    for line in text.splitlines():
        if line.startswith(wanted):
            name, _, value = line.rpartition(" ")
            number = float(value)
            print(f"   {name} {value if math.isfinite(number) else number}")
