"""The workloads ``agent_overhead.py`` times, the receiver they ship to, and its memory probes.

Three models with their optimizer, batch and loss; a PULL socket on loopback
drained by a thread (the collector's side, counting only); what ``watch()``
keeps and allocates, and the process's RSS with and without the agent (run in
a fresh process by the script's ``--rss-probe``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
from memory_probe import cpu_allocated  # benchmarks/ is on sys.path when run as a script
from tiny_gpt import TinyGPT
from torch import nn

import gradwatch
from gradwatch.agent.budget import memory_budget
from gradwatch.agent.monitor import Monitor

# Steps run unwatched, then watched, by the RSS probe (the transformer's are ~100x longer).
RSS_STEPS = {"transformer": 30, "mlp": 200, "mlp6x256": 200}


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
        "transformer",
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4),
        lambda: (idx[:, :-1], idx[:, 1:]),
        lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
    )


def mlp(device: str) -> Workload:
    # 256-512-512-10: 399k parameters in 6 tensors.
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    ).to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    return Workload(
        "mlp",
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        lambda: (x, y),
        nn.functional.cross_entropy,
    )


def mlp6x256(device: str) -> Workload:
    # Six Linear(256, 256) with ReLU between: 395k parameters in 12 tensors (issue 14).
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(256, 256)] + ([nn.ReLU()] if i < 5 else [])
    model = nn.Sequential(*layers).to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 256, (64,), device=device)
    return Workload(
        "mlp6x256",
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        lambda: (x, y),
        nn.functional.cross_entropy,
    )


WORKLOADS = {"transformer": transformer, "mlp": mlp, "mlp6x256": mlp6x256}


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


def extra_memory(work: Workload, endpoint: str, steps: int = 24) -> tuple[int, int, int]:
    """Bytes ``watch()`` keeps allocated, the peak its calls allocate over ``steps``
    steps from the start (the dense early cadence: most are cadence steps), and the
    budget (agent/budget.py). CPU tensors, measured with the torch profiler. Plain SGD
    here whatever the workload's optimizer: it allocates nothing in its step, so what
    the step allocates is the agent's (its pre-hook and log())."""
    model = copy.deepcopy(work.model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    mon, _, kept = cpu_allocated(lambda: gradwatch.watch(model, opt, job="mem", endpoint=endpoint))
    peak = 0
    for _ in range(steps):
        x, y = work.batch()
        work.loss(model(x), y).backward()
        _, step_peak, _ = cpu_allocated(lambda: (opt.step(), mon.log(loss=1.0)))
        peak = max(peak, step_peak)
        opt.zero_grad(set_to_none=True)
    mon.close()
    n_layers = sum(1 for p in model.parameters() if p.requires_grad)
    acts = mon._acts.columns if mon._acts is not None else ()
    on_cpu = mon._device.type == "cpu"
    budget = memory_budget(n_layers, mon.config, act_columns=len(acts), on_cpu=on_cpu).total
    return kept, peak, budget


def _rss_kib() -> tuple[int, int]:
    """This process's resident memory now and at its peak (VmRSS, VmHWM), KiB (Linux)."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.split()[0] if value.split() else "0"
    return int(fields.get("VmRSS", 0)), int(fields.get("VmHWM", 0))


def rss_probe(name: str, steps: int, activation_stats: bool = True) -> dict[str, int]:
    """In a fresh process: RSS after ``steps`` unwatched steps, then after ``watch()`` and
    ``steps`` watched ones (the dense early cadence included), shipping to a receiver.

    Run as ``--rss-probe NAME [--no-activation-stats]``; the parent reads the JSON it
    prints. RSS counts everything the agent brings (its threads' stacks, ZeroMQ's
    buffers, the host pool), not only tensors, and whatever the allocator keeps, so it is
    an upper bound on the agent's own share. The peak is glibc's too: freed blocks of the
    forward and backward stay mapped or not depending on the order of allocations, which
    moves the transformer's peak by +5 to +30 MiB from run to run with or without
    activation statistics; ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (big
    blocks mapped and unmapped at once) makes it a measure of what is live.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = WORKLOADS[name]("cpu")
    receiver = Receiver()
    opt = work.make_opt(work.model)

    def run(mon: Monitor | None) -> None:
        for _ in range(steps):
            x, y = work.batch()
            loss = work.loss(work.model(x), y)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.log(loss=loss)
            opt.zero_grad(set_to_none=True)

    try:
        run(None)
        before, before_peak = _rss_kib()
        mon = gradwatch.watch(
            work.model,
            opt,
            job="rss",
            endpoint=f"tcp://127.0.0.1:{receiver.port}",
            activation_stats=activation_stats,
        )
        run(mon)
        after, after_peak = _rss_kib()
        mon.close()
    finally:
        receiver.close()
    return {"before": before, "after": after, "before_peak": before_peak, "after_peak": after_peak}
