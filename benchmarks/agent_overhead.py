"""Step-time overhead of the gradwatch agent on CPU.

Three variants of the same training step run interleaved round-robin in one
process, so drift in the machine (thermal, other load) hits them equally:

* ``baseline`` -- no monitoring;
* ``agent``    -- ``gradwatch.watch`` at default settings, shipping to a PULL
  socket on loopback that a receiver thread drains (the collector's part);
* ``naive``    -- what people write by hand: every parameter's grad norm
  read with ``.item()`` every step.

Two workloads: a small GPT-style transformer (4 layers, d_model 256, 4 heads,
seq 128, vocab 1000, batch 8, AdamW) and a ~0.4M-parameter MLP (batch 64,
SGD). Prints median and p90 step times and the overhead versus baseline:
"overhead" compares whole-run medians, "paired" is the median over rounds
of each round's ratio (it cancels slow drift in machine load).
Targets at default settings: <= 0.5% (transformer), <= 3% (MLP).

    python benchmarks/agent_overhead.py            # several hundred steps each
    python benchmarks/agent_overhead.py --quick    # a minute or so
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent.monitor import Monitor
from tiny_gpt import TinyGPT  # benchmarks/ is on sys.path when run as a script

VARIANTS = ("baseline", "agent", "naive")

# Time spent inside the agent's two training-thread entry points, measured
# directly: a low-noise companion to the step-time medians, which on a busy
# machine wobble by more than the agent costs. It misses indirect costs
# (cache pollution, the shipper thread), which the medians include.
_INSIDE: dict[str, list[float]] = {"pre-hook": [], "log": []}


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _INSIDE[name].append(time.perf_counter() - t0)

    return timed


Monitor._pre_hook = _timed("pre-hook", Monitor._pre_hook)  # type: ignore[method-assign]
Monitor.log = _timed("log", Monitor.log)  # type: ignore[method-assign]


@dataclass
class Workload:
    name: str
    model: nn.Module
    make_opt: Callable[[nn.Module], torch.optim.Optimizer]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def transformer(device: str) -> Workload:
    model = TinyGPT().to(device)
    idx = torch.randint(0, 1000, (8, 129), device=device)
    return Workload(
        "transformer", model, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4),
        lambda: (idx[:, :-1], idx[:, 1:]),
        lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))


def mlp(device: str) -> Workload:
    # 256-512-512-10: 399k parameters in 6 tensors.
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10)).to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    return Workload("mlp", model, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                    lambda: (x, y), nn.functional.cross_entropy)


class Receiver:
    """The collector's side of the socket: drain and count, nothing else."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.messages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
                self.messages += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(linger=0)
        self.ctx.term()


def make_step(work: Workload, variant: str, endpoint: str, sync: Callable[[], None]
              ) -> tuple[Callable[[], None], Callable[[], None]]:
    model = copy.deepcopy(work.model)
    opt = work.make_opt(model)
    params = [p for p in model.parameters() if p.requires_grad]
    mon = gradwatch.watch(model, opt, job=f"bench-{work.name}", endpoint=endpoint) \
        if variant == "agent" else None
    sink: list[float] = []

    def step() -> None:
        x, y = work.batch()
        loss = work.loss(model(x), y)
        loss.backward()
        opt.step()
        if mon is not None:
            mon.log(loss=loss)
        elif variant == "naive":
            sink[:] = [p.grad.norm().item() for p in params]
            sink.append(loss.item())
        opt.zero_grad(set_to_none=True)
        sync()

    return step, (mon.close if mon is not None else lambda: None)


def measure(work: Workload, steps: int, warmup: int, chunk: int, endpoint: str,
            sync: Callable[[], None]) -> dict[str, list[float]]:
    runners = {v: make_step(work, v, endpoint, sync) for v in VARIANTS}
    for step, _ in runners.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    paired: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for calls in _INSIDE.values():
        calls.clear()
    while len(times["baseline"]) < steps:
        chunk_medians = {}
        for variant, (step, _) in runners.items():  # round-robin, chunk steps each
            ts = []
            for _ in range(chunk):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            times[variant] += ts
            chunk_medians[variant] = statistics.median(ts)
        for variant, med in chunk_medians.items():
            paired[variant].append(med / chunk_medians["baseline"] - 1)
    inside = {name: (statistics.median(calls), sum(calls) / len(calls))
              for name, calls in _INSIDE.items()}
    for _, close in runners.values():
        close()
    return {"times": times, "paired": paired, "inside": inside}


def report(name: str, result: dict[str, Any]) -> None:
    times, paired = result["times"], result["paired"]
    base = statistics.median(times["baseline"])
    print(f"\n{name}: {len(times['baseline'])} steps per variant")
    print(f"  {'variant':<9} {'median ms':>10} {'p90 ms':>9} {'overhead':>9} {'paired':>8}")
    for variant, ts in times.items():
        med = statistics.median(ts)
        p90 = statistics.quantiles(ts, n=10)[-1]
        pair = statistics.median(paired[variant]) * 100
        print(f"  {variant:<9} {med * 1e3:>10.3f} {p90 * 1e3:>9.3f} "
              f"{(med / base - 1) * 100:>+8.2f}% {pair:>+7.2f}%")
    med = sum(m for m, _ in result["inside"].values())
    mean = sum(m for _, m in result["inside"].values())
    parts = ", ".join(f"{name} {m * 1e6:.0f}" for name, (m, _) in result["inside"].items())
    print(f"  inside the agent, measured directly: median {med * 1e6:.0f} us/step ({parts}) "
          f"= {med / base * 100:.2f}%; mean {mean * 1e6:.0f} us = {mean / base * 100:.2f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--only", choices=("transformer", "mlp"), help="run one workload")
    ap.add_argument("--transformer-steps", type=int, default=300)
    ap.add_argument("--mlp-steps", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    receiver = Receiver()
    endpoint = f"tcp://127.0.0.1:{receiver.port}"
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU; agent ships to {endpoint}")
    plan = [(transformer, 30 if args.quick else args.transformer_steps, 3 if args.quick else 10, 5),
            (mlp, 300 if args.quick else args.mlp_steps, 50, 50)]
    try:
        for build, steps, warmup, chunk in plan:
            work = build("cpu")
            if args.only and work.name != args.only:
                continue
            report(work.name, measure(work, steps, warmup, chunk, endpoint, lambda: None))
    finally:
        receiver.close()
    print(f"\nreceiver got {receiver.messages} messages")


if __name__ == "__main__":
    main()
