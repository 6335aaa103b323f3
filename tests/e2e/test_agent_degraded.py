"""Contract C3 end to end: the agent switches a part off, the collector raises AgentDegraded.

A real agent watches a model whose every layer gets sparse gradients (their
norms cannot be read without a device sync): its gradient signal is gone, and
the collector raises a warning naming the layer. With dense layers beside the
sparse one, the agent keeps measuring those and the gap is the model's design:
an info alert, as for a compiled model, which loses only its activation
statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch import nn

import gradwatch
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.rules.replay import replay
from tests.recording_sink import RecordingSink, fired, firing_alert


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).squeeze(-1)


class AllSparse(nn.Module):
    """Nothing but a sparse embedding: no layer's gradient norm can be read."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum(-1)


def started() -> tuple[Server, RecordingSink]:
    sink = RecordingSink()
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"),
        registry=CollectorRegistry(),
        sinks=[sink],
    )
    server.start()
    return server, sink


def run_sparse(model: nn.Module, job: str, rule: str) -> tuple[Any, ...]:
    """Train ``model`` 6 steps watched by a live collector until ``rule`` fires."""
    server, sink = started()
    try:
        torch.manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(
            model, opt, job=job, endpoint=server.bound_endpoint, flush_every=2, heartbeat_every=0.05
        ) as mon:
            assert server.wait_for_messages(1, timeout=10.0)  # connected: nothing is lost
            for _ in range(6):
                loss = model(torch.randint(0, 20, (8,))).pow(2).mean()
                loss.backward()
                opt.step()
                mon.log(loss=loss)
                opt.zero_grad()
            got = sink.wait_for(fired(rule), timeout=10.0)
        return tuple(got)
    finally:
        server.stop(timeout=5.0)


def test_sparse_layers_beside_dense_ones_raise_only_an_info_alert() -> None:
    # A recommender's sparse embedding is the model's design, on every healthy run: it
    # paged AgentDegraded at step 0 before 2026-12-06.
    got = run_sparse(SparseNet(), "mixed", "AgentStatisticOff")
    alert = firing_alert(list(got), "AgentStatisticOff")
    assert alert.severity == "info" and "emb.weight" in alert.summary
    assert not any(t.alert.rule == "AgentDegraded" for t in got)


def test_sparse_gradients_raise_agent_degraded_naming_the_layer() -> None:
    got = run_sparse(AllSparse(), "sparse", "AgentDegraded")
    alert = firing_alert(list(got), "AgentDegraded")
    assert alert.severity == "warning" and alert.category == "agent_health"
    assert alert.summary.startswith("monitoring degraded: gradient norms of sparse layers")
    assert "emb.weight" in alert.summary and alert.job == "sparse"
    assert not any(t.alert.rule == "NonFiniteGradients" for t in got)


def test_a_compiled_model_raises_only_an_info_alert() -> None:
    server, sink = started()
    try:
        torch.manual_seed(0)
        model = torch.compile(
            nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), backend="eager"
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with gradwatch.watch(
            model,
            opt,
            job="compiled",
            endpoint=server.bound_endpoint,
            flush_every=2,
            heartbeat_every=0.05,
        ) as mon:
            # The notice queued at attach had no peer yet; the agent sends it again at the
            # first step after it connected, so train until then (bounded).
            for _ in range(2000):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                mon.log(loss=loss)
                opt.zero_grad()
                if mon.stats.events_sent:
                    break
            sink.wait_for(fired("AgentStatisticOff"), timeout=10.0)
        alert = firing_alert(sink.transitions, "AgentStatisticOff")
        assert alert.severity == "info" and "activation statistics" in alert.summary
        assert not any(t.alert.rule == "AgentDegraded" for t in sink.transitions)
    finally:
        server.stop(timeout=5.0)


def test_a_recorded_trace_replays_the_agent_degraded_alert(tmp_path) -> None:
    sink = RecordingSink()
    server = Server(
        CollectorConfig(
            listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", record_dir=tmp_path
        ),
        registry=CollectorRegistry(),
        sinks=[sink],
    )
    server.start()
    try:
        torch.manual_seed(0)
        model = AllSparse()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(
            model,
            opt,
            job="sparse-rec",
            endpoint=server.bound_endpoint,
            flush_every=2,
            heartbeat_every=0.05,
        ) as mon:
            assert server.wait_for_messages(1, timeout=10.0)  # connected: nothing is lost
            for _ in range(4):
                model(torch.randint(0, 20, (8,))).pow(2).mean().backward()
                opt.step()
                mon.log(loss=1.0)
                opt.zero_grad()
            sink.wait_for(fired("AgentDegraded"), timeout=10.0)
    finally:
        server.stop(timeout=5.0)
    replayed = replay(tmp_path / "sparse-rec.jsonl")
    alert = firing_alert(replayed, "AgentDegraded")
    assert "emb.weight" in alert.summary
