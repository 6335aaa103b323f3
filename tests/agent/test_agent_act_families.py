"""GELU, SiLU/SwiGLU, softmax and functional activations report their dead or saturated shares."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F
import zmq
from torch import nn

import gradwatch
from gradwatch.agent import acttargets
from gradwatch.agent.activations import ActHooks
from gradwatch.agent.actstats import GELU_DEAD_INPUT, SILU_DEAD_INPUT
from gradwatch.agent.acttargets import kind_of
from gradwatch.collector.ingest import Ingest
from gradwatch.rules.step import Stats
from gradwatch.wire import Batch, Heartbeat, decode, encode
from gradwatch.wire import columns as wc

WAIT_MS = 5000


def measured(model: nn.Module, x: torch.Tensor, **kw) -> dict[str, tuple[float, ...]]:
    """Arm the hooks for one forward pass; module -> (mean, std, share) by column name."""
    hooks = ActHooks.attach(model, torch.device("cpu"), on_error=None, **kw)
    assert hooks is not None
    hooks.arm()
    with torch.no_grad():
        model(x)
    values = hooks.export().values().tolist()
    hooks.disarm()
    out: dict[str, list[float]] = {}
    for column, value in zip(hooks.columns, values, strict=True):
        module, kind, _ = column[len(wc.ACT_PREFIX) :].rsplit("/", 2)
        out.setdefault(f"{module}/{kind}", []).append(value)
    return {k: tuple(v) for k, v in out.items()}


class SwiGLU(nn.Module):
    """LLaMA's MLP: down(act(gate(x)) * up(x)), the activation a SiLU module (as in HF)."""

    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden)
        self.up_proj = nn.Linear(d, hidden)
        self.down_proj = nn.Linear(hidden, d)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class NewGELUActivation(nn.Module):
    """Hugging Face's GPT-2 activation: a custom class, known by its name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class FunctionalMLP(nn.Module):
    """An MLP that calls its activation functionally: no module to hook but the next Linear."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(8, 256), nn.Linear(256, 8), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(F.gelu(h) if self.act == "gelu" else F.silu(h))


def test_gelu_dead_share_is_its_flat_negative_tail() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.GELU())
    x = torch.randn(512, 8)
    healthy = measured(model, x)["1/gelu"]
    pre = model[0](x)
    assert healthy[2] == pytest.approx((pre < GELU_DEAD_INPUT).float().mean().item(), abs=0.01)
    assert healthy[2] < 0.05
    with torch.no_grad():
        model[0].bias.fill_(-8.0)  # a learning rate that pushed every unit far negative
    dead = measured(model, x)["1/gelu"]
    pre = model[0](x)
    assert dead[2] == pytest.approx((pre < GELU_DEAD_INPUT).float().mean().item(), abs=0.01)
    assert dead[2] > 0.9


def test_swiglu_gate_reports_dead_silu_units() -> None:
    torch.manual_seed(0)
    model = SwiGLU()
    x = torch.randn(256, 16)
    assert measured(model, x)["act_fn/silu"][2] < 0.05
    with torch.no_grad():
        model.gate_proj.bias.fill_(-12.0)  # every gate closed: the product is ~0
    gate = model.gate_proj(x)
    share = measured(model, x)["act_fn/silu"][2]
    assert share == pytest.approx((gate < SILU_DEAD_INPUT).float().mean().item(), abs=0.01)
    assert share > 0.9


def test_library_activation_classes_are_known_by_name() -> None:
    assert kind_of(NewGELUActivation()) == "gelu"
    assert kind_of(nn.GELU(approximate="tanh")) == "gelu"
    assert kind_of(type("SiLUActivation", (nn.Module,), {})()) == "silu"
    assert kind_of(SwiGLU()) is None  # a gated block's output is a product, not an activation
    model = nn.Sequential(nn.Linear(4, 64), NewGELUActivation())
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    assert measured(model, torch.randn(32, 4))["1/gelu"][2] > 0.9


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_saturation_is_the_share_of_one_hot_rows(dim: int) -> None:
    torch.manual_seed(0)
    scores = torch.randn(4, 8, 8, 8)  # batch, heads, query, key (dim=1: heads as rows' axis)
    model = nn.Sequential(nn.Identity(), nn.Softmax(dim=dim))
    mean, std, share = measured(model, scores)["1/softmax"]
    assert share < 0.02 and mean == pytest.approx(1 / 8, abs=1e-6)
    collapsed = measured(model, scores * 100.0)["1/softmax"][2]
    rows = torch.softmax(scores * 100.0, dim=dim).movedim(dim, -1).reshape(-1, 8)
    assert collapsed == pytest.approx((rows.amax(-1) > 0.99).float().mean().item(), abs=1e-6)
    assert collapsed > 0.8


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_functional_activation_is_measured_at_the_next_modules_input(act: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FunctionalMLP(act))
    with torch.no_grad():
        model[0].fc1.bias[:192].fill_(-20.0)  # 3/4 of the units dead
    stats = measured(model, torch.randn(128, 8), inputs={"*.fc2": act})
    assert set(stats) == {f"0.fc2:input/{act}"}
    assert stats[f"0.fc2:input/{act}"][2] == pytest.approx(0.75, abs=0.02)


def _builtin_layers(activation: object) -> nn.Module:
    """torch's own encoder and decoder layers, as nn.Transformer builds them."""
    enc = nn.TransformerEncoderLayer(16, 2, 64, dropout=0.0, activation=activation)
    dec = nn.TransformerDecoderLayer(16, 2, 64, dropout=0.0, activation=activation)
    return nn.ModuleDict({"enc": enc, "dec": dec})


@pytest.mark.parametrize("activation", ["relu", "gelu", F.gelu])
def test_torchs_transformer_layers_are_measured_without_being_named(activation: object) -> None:
    # Their ReLU/GELU is a function (no module to hook) and linear2 takes it only after
    # dropout: linear1's output goes through the activation (pre:), as for a SwiGLU gate.
    torch.manual_seed(0)
    kind = "relu" if activation == "relu" else "gelu"
    layers = _builtin_layers(activation)
    names = [(t.name, t.kind, t.pre) for t in acttargets.find_targets(layers)]
    assert names == [("enc.linear1:pre", kind, True), ("dec.linear1:pre", kind, True)]
    enc = layers["enc"]
    x = torch.randn(12, 4, 16)  # (sequence, batch, features)
    seen: list[torch.Tensor] = []
    enc.linear1.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    cut = 0.0 if kind == "relu" else GELU_DEAD_INPUT  # ReLU: exact zeros; GELU: its tail

    def share_and_truth() -> tuple[float, float]:
        share = measured(enc, x)[f"linear1:pre/{kind}"][2]
        return share, (seen[-1] <= cut).float().mean().item()

    share, truth = share_and_truth()
    assert share == pytest.approx(truth, abs=0.02) and truth < 0.6
    with torch.no_grad():
        enc.linear1.bias[:48].fill_(-30.0)  # 3/4 of the feed-forward units dead
    share, truth = share_and_truth()
    assert share == pytest.approx(truth, abs=0.02) and truth >= 0.75


def test_a_module_activation_or_a_name_given_takes_the_place_of_the_built_in_one() -> None:
    gelu = nn.TransformerEncoderLayer(16, 2, 64, activation=nn.GELU())  # a child module
    assert [t.name for t in acttargets.find_targets(nn.Sequential(gelu))] == ["0.activation"]
    named = acttargets.find_targets(_builtin_layers("relu"), {"enc.linear1": "pre:gelu"})
    assert [(t.name, t.kind) for t in named] == [
        ("enc.linear1:pre", "gelu"),  # what the user said, once
        ("dec.linear1:pre", "relu"),
    ]
    odd = nn.TransformerEncoderLayer(16, 2, 64, activation=lambda y: y * torch.sigmoid(y))
    assert acttargets.find_targets(nn.Sequential(odd)) == []  # an unknown function: unnamed


class GatedMLP(nn.Module):
    """LLaMA's SwiGLU feed-forward: w2(F.silu(w1(x)) * w3(x)); no layer takes the SiLU's output."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(8, 256), nn.Linear(256, 8), nn.Linear(8, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def test_a_gate_is_measured_from_the_layer_whose_output_the_activation_takes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(GatedMLP())
    with torch.no_grad():
        model[0].w1.bias[:64].fill_(-20.0)  # a quarter of the gate's units dead
    x = torch.randn(128, 8)
    stats = measured(model, x, inputs={"*.w1": "pre:silu"})
    assert set(stats) == {"0.w1:pre/silu"}
    assert stats["0.w1:pre/silu"][2] == pytest.approx(0.25, abs=0.02)  # the flat tail
    # The same statistics as a SiLU module fed the same pre-activations: the same sample.
    with torch.no_grad():
        pre = model[0].w1(x)
    assert stats["0.w1:pre/silu"] == pytest.approx(
        measured(nn.Sequential(nn.SiLU()), pre)["0/silu"], rel=1e-6
    )
    with pytest.raises(ValueError, match="pre:silu"):
        ActHooks.attach(model, torch.device("cpu"), on_error=None, inputs={"*.w1": "pre:softmax"})


def connected(sock: zmq.Socket) -> None:
    while True:
        assert sock.poll(WAIT_MS), "the agent did not connect in time"
        if isinstance(decode(sock.recv_multipart()), Heartbeat):
            return


def test_new_families_reach_the_collector_as_act_stats(pull, caplog) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32),
        nn.GELU(),
        SwiGLU(32, 64),
        nn.Linear(32, 8),
        FunctionalMLP("gelu"),
        nn.Linear(8, 4),
        nn.Softmax(dim=-1),
        nn.Linear(4, 2),  # a softmax inside the model: an output one is not measured
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        mon = gradwatch.watch(
            model,
            opt,
            job="act",
            endpoint=endpoint,
            flush_every=2,
            stats_every=2,
            heartbeat_every=0.05,
            activation_modules={"4.fc2": "gelu", "no.such.*": "silu"},
        )
    assert "'no.such.*' matches no module" in caplog.text
    connected(sock)
    for _ in range(4):
        model(torch.randn(64, 8)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    ingest, stats = Ingest(), []
    while not stats:  # the first sample with activations (a forced or early one may have none)
        assert sock.poll(WAIT_MS), "no cadence statistics with activations arrived in time"
        msg = decode(sock.recv_multipart())
        if isinstance(msg, Batch) and msg.schema_id == wc.STATS_SCHEMA_ID:
            stats = [s for s in ingest.feed(encode(msg)).stats if isinstance(s, Stats) and s.act]
    kinds = {a.module: (a.kind, a.zero_frac, a.sat_frac) for a in stats[0].act}
    assert kinds.keys() == {"1", "2.act_fn", "4.fc2:input", "6"}
    assert kinds["1"][0] == "gelu" and kinds["2.act_fn"][0] == "silu"
    assert kinds["6"][0] == "softmax" and kinds["6"][2] is not None and kinds["6"][1] is None
    assert all(z is not None and 0.0 <= z <= 1.0 for k, z, _ in kinds.values() if k != "softmax")


def test_a_bad_activation_kind_is_refused_at_watch() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="activation_modules"):
        gradwatch.watch(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            job="x",
            endpoint="tcp://127.0.0.1:1",
            activation_modules={"*": "swish"},
        )


def test_the_new_families_make_no_syncing_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.agent.test_agent_nosync import SYNCING, SyncDetector

    found = SyncDetector(threading.get_ident())
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, found.wrap(name, getattr(torch.Tensor, name)))
    model = nn.Sequential(
        nn.Linear(8, 32),
        nn.GELU(),
        SwiGLU(32, 64),
        nn.Linear(32, 8),
        FunctionalMLP("silu"),
        nn.Linear(8, 4),
        nn.Softmax(dim=0),
        nn.Linear(4, 2),  # a softmax inside the model: an output one is not measured
    )
    hooks = ActHooks.attach(model, torch.device("cpu"), on_error=None, inputs={"*.fc2": "silu"})
    assert hooks is not None
    hooks.arm()
    model(torch.randn(16, 8)).sum().backward()
    hooks.export().values()
    hooks.disarm()
    assert found.calls == []
    assert len(hooks.columns) == 4 * 3  # gelu, silu, fc2 input, softmax: each mean, std, share


def test_a_model_with_no_activation_module_is_told_the_checks_are_off(caplog) -> None:
    # llama2.c's SwiGLU calls F.silu: silence would read as "no dead units".
    model = nn.Sequential(FunctionalMLP("silu"), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        mon = gradwatch.watch(model, opt, job="fn", endpoint="tcp://127.0.0.1:1")
    mon.close()
    assert mon._acts is None
    assert "saturation and dead-unit checks are off" in caplog.text
    assert "activation_modules=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        named = gradwatch.watch(
            model, opt, job="fn", endpoint="tcp://127.0.0.1:1", activation_modules={"0.fc2": "silu"}
        )
    named.close()
    assert named._acts is not None and "checks are off" not in caplog.text
