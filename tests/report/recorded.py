"""A real recorded trace for the report tests: agent-driven training -> collector -> ``record_dir``.

The loop trains a small tanh/ReLU MLP with cadence statistics every 10 steps,
an evaluation every 20, a checkpoint every 25, and poisons one input with NaN
at ``NAN_STEP`` so the rules fire a numerical alert with a diagnosis. Importing
this module needs no torch (recording does), so the other report tests run without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server

if TYPE_CHECKING:
    import torch

JOB = "report-e2e"
STEPS = 60
NAN_STEP = 47
TIMEOUT_S = 30.0


def _model() -> torch.nn.Module:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )


def record_trace(directory: Path) -> Path:
    """Run the loop against an in-process collector recording into ``directory``; the trace path."""
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", record_dir=directory
    )
    server = Server(config, registry=CollectorRegistry())
    server.start()
    try:
        stats = _train(server.bound_endpoint)
        sent = stats.batches_sent + stats.heartbeats_sent + stats.events_sent + stats.stats_sent
        assert server.wait_for_messages(sent, timeout=TIMEOUT_S), (
            "collector did not receive every message"
        )
    finally:
        assert server.stop(10), "collector did not stop in time"
    return directory / f"{JOB}.jsonl"


def _train(endpoint: str) -> Any:
    # Imported here: the report tests that need no recording also run where torch is absent.
    import torch

    import gradwatch

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(1)
    mon = gradwatch.watch(
        model, optimizer, job=JOB, endpoint=endpoint, flush_every=10, stats_every=10
    )
    with mon:
        for step in range(1, STEPS + 1):
            x = torch.randn(32, 8, generator=generator)
            if step == NAN_STEP:
                x[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), x[:, :2].sum(1, keepdim=True))
            loss.backward()
            optimizer.step()
            mon.log(loss=loss)
            optimizer.zero_grad()
            if step % 20 == 0:
                model.eval()
                with torch.no_grad():
                    xv = torch.randn(64, 8, generator=generator)
                    mon.log_eval(
                        loss=torch.nn.functional.mse_loss(model(xv), xv[:, :2].sum(1, keepdim=True))
                    )
                model.train()
            if step % 25 == 0:
                mon.checkpoint_saved(step, f"ckpt/{step}.pt")
    return mon.stats
