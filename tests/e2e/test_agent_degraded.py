"""Contract C3 end to end: the agent switches a part off, the collector raises AgentDegraded.

A real agent watches a model whose embedding gets sparse gradients (its norms
cannot be read without a device sync); the agent keeps measuring the other
layers and tells the collector, which raises a warning naming the layer.
A compiled model loses only its activation statistics: an info alert.
"""

from __future__ import annotations

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


def started() -> tuple[Server, RecordingSink]:
    sink = RecordingSink()
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"),
        registry=CollectorRegistry(),
        sinks=[sink],
    )
    server.start()
    return server, sink


def test_sparse_gradients_raise_agent_degraded_naming_the_layer() -> None:
    server, sink = started()
    try:
        torch.manual_seed(0)
        model = SparseNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(
            model,
            opt,
            job="sparse",
            endpoint=server.bound_endpoint,
            flush_every=2,
            heartbeat_every=0.05,
        ) as mon:
            assert server.wait_for_messages(1, timeout=10.0)  # connected: nothing is lost
            for _ in range(6):
                loss = model(torch.randint(0, 20, (8,))).pow(2).mean()
                loss.backward()
                opt.step()
                mon.log(loss=loss)
                opt.zero_grad()
            got = sink.wait_for(fired("AgentDegraded"), timeout=10.0)
        alert = firing_alert(got, "AgentDegraded")
        assert alert.severity == "warning" and alert.category == "agent_health"
        assert alert.summary.startswith("monitoring degraded: gradient norms of sparse layers")
        assert "emb.weight" in alert.summary and alert.job == "sparse"
        assert not any(t.alert.rule == "NonFiniteGradients" for t in got)
    finally:
        server.stop(timeout=5.0)


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
        model = SparseNet()
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
