"""Activation statistics: forward hooks armed for cadence steps only, shipped with the
weight norms."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent import activations, acttargets
from gradwatch.collector.ingest import Ingest
from gradwatch.rules.step import Stats
from gradwatch.wire import Batch, Heartbeat, decode, encode
from gradwatch.wire import columns as wc

# Generous bounds for a loaded machine: waits end as soon as their condition holds.
WAIT_S = 30.0


def connected(sock: zmq.Socket, mon: gradwatch.Monitor) -> None:
    """Wait for ``mon``'s first heartbeat. The agent's socket drops what it sends before its
    connection is made (``IMMEDIATE``, by design), so a test that closes a monitor a few
    milliseconds after ``watch()`` loses its statistics on a loaded machine unless it waits
    here. A heartbeat of an earlier monitor on the same socket does not count."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode(sock.recv_multipart())
            if isinstance(msg, Heartbeat) and msg.incarnation == mon.incarnation:
                return
    raise AssertionError(f"the monitor did not connect within {WAIT_S} s")


def run(
    model: nn.Module,
    sock: zmq.Socket,
    endpoint: str,
    steps: int,
    stats_every: int,
    n_in: int = 8,
    **kw,
) -> gradwatch.Monitor:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the init as it is
    mon = gradwatch.watch(
        model,
        opt,
        job="act",
        endpoint=endpoint,
        flush_every=2,
        stats_every=stats_every,
        heartbeat_every=0.05,
        early_stats=False,
        **kw,
    )
    connected(sock, mon)
    for _ in range(steps):
        model(torch.randn(64, n_in)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    assert mon.stats.stats_dropped == 0, "a cadence sample was dropped (not connected?)"
    return mon


def received_stats(sock: zmq.Socket, n: int) -> list[Stats]:
    """The next ``n`` cadence statistics on ``sock``; call it after the monitor's close() and
    a check of its ``stats_sent``, so they are on their way and only the transfer is awaited."""
    ingest, out = Ingest(), []
    deadline = time.monotonic() + WAIT_S
    while len(out) < n:
        assert time.monotonic() < deadline, f"{len(out)} of {n} cadence statistics arrived"
        if not sock.poll(100):
            continue
        msg = decode(sock.recv_multipart())
        if isinstance(msg, Batch) and msg.schema_id == wc.STATS_SCHEMA_ID:
            out.extend(ingest.feed(encode(msg)).stats)
    return out


def test_tanh_net_with_10x_init_reports_high_saturation(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Sigmoid(), nn.Linear(64, 1)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0)
    mon = run(model, sock, endpoint, steps=4, stats_every=2)
    stats = received_stats(sock, 2)
    assert [s.step for s in stats] == [2, 4] and mon.stats.disabled is None
    for s in stats:
        by_module = {a.module: a for a in s.act}
        assert set(by_module) == {"1", "3"}
        tanh, sig = by_module["1"], by_module["3"]
        assert (tanh.kind, sig.kind) == ("tanh", "sigmoid")
        assert tanh.sat_frac is not None and tanh.sat_frac > 0.6
        assert sig.sat_frac is not None and sig.sat_frac > 0.25
        assert tanh.zero_frac is None and 0.8 < tanh.std < 1.0


def test_relu_net_with_large_negative_bias_reports_dead_units(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    run(model, sock, endpoint, steps=3, stats_every=1)
    stats = received_stats(sock, 3)
    assert [s.step for s in stats] == [1, 2, 3]  # stats_every=1: armed from the start
    for s in stats:
        (relu,) = s.act
        assert relu.module == "1" and relu.kind == "relu" and relu.sat_frac is None
        assert relu.zero_frac == pytest.approx(1.0)
        assert relu.mean == 0.0 and relu.std == 0.0


def test_statistics_match_a_direct_computation(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
    seen: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, a, y: seen.append(y.detach().clone()))
    run(model, sock, endpoint, steps=2, stats_every=2)
    (s,) = received_stats(sock, 1)
    y = seen[1]
    (relu,) = s.act
    assert relu.mean == pytest.approx(y.mean().item(), rel=1e-4)
    assert relu.std == pytest.approx(y.std(unbiased=False).item(), rel=1e-4)
    assert relu.zero_frac == pytest.approx((y == 0).float().mean().item())


def test_hooks_run_on_cadence_forward_passes_only(pull, monkeypatch) -> None:
    _, endpoint = pull
    calls: list[int] = []
    original = activations.measure

    def counting(y, row, pre=None):
        calls.append(step_now[0])
        original(y, row, pre)

    monkeypatch.setattr(activations, "measure", counting)
    step_now = [0]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model, opt, job="act", endpoint=endpoint, stats_every=5, early_stats=False
    )
    for i in range(1, 13):
        step_now[0] = i
        model(torch.randn(4, 8)).sum().backward()
        assert bool(model[1]._forward_hooks) == (i % 5 == 0)
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    assert calls == [5, 5, 10, 10]  # two modules, on cadence steps 5 and 10 only
    assert not model[1]._forward_hooks and not model[3]._forward_hooks


@pytest.mark.parametrize(
    ("layers", "measured"),
    [
        # A binary classifier's probability and a generator's [-1, 1] pixels: outputs.
        ([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid()], ["1"]),
        ([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh()], ["1"]),
        ([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Softmax(dim=-1)], ["1"]),
        # A hidden tanh, and a ReLU registered last (usually the hidden one, reused): kept.
        ([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)], ["1"]),
        ([nn.Linear(4, 8), nn.Linear(8, 1), nn.ReLU()], ["2"]),
    ],
)
def test_an_output_sigmoid_tanh_or_softmax_is_not_measured(
    layers: list[nn.Module], measured: list[str]
) -> None:
    # A healthy nn.Sigmoid + BCELoss classifier paged ActivationsSaturated at step 63:
    # a confident output is no saturated hidden unit.
    assert [t.name for t in acttargets.find_targets(nn.Sequential(*layers))] == measured


def test_module_cap_and_opt_out(pull) -> None:
    model = nn.Sequential(*[nn.ReLU() for _ in range(5)])
    hooks = activations.ActHooks.attach(model, torch.device("cpu"), None, max_modules=3)
    assert hooks is not None
    assert [c.split("/")[1] for c in hooks.columns[::3]] == ["0", "1", "2"]
    _, endpoint = pull
    lin = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = gradwatch.watch(
        lin, opt, job="act", endpoint=endpoint, stats_every=1, activation_stats=False
    )
    assert not lin[1]._forward_hooks
    mon.close()


def test_compiled_model_warns_once_and_skips_activations(pull, caplog) -> None:
    _, endpoint = pull
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled = torch.compile(model, backend="aot_eager")  # not run: attaching is what is tested
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        mon = gradwatch.watch(compiled, opt, job="act", endpoint=endpoint, stats_every=1)
    warned = [r for r in caplog.records if "compiled" in r.getMessage()]
    assert len(warned) == 1 and "activation statistics are off" in warned[0].getMessage()
    assert mon._acts is None and not model[1]._forward_hooks
    mon.close()


def test_update_ratios_ship_on_cadence_steps_and_are_opt_out(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(
        model,
        opt,
        job="act",
        endpoint=endpoint,
        flush_every=2,
        stats_every=2,
        heartbeat_every=0.05,
        early_stats=False,
    )
    connected(sock, mon)
    expected = {}
    for step in range(1, 5):
        model(torch.randn(16, 8)).pow(2).mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        expected[step] = [
            ((p.detach() - b).norm() / p.detach().norm()).item()
            for p, b in zip(model.parameters(), before, strict=True)
        ]
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    assert (mon.stats.stats_sent, mon.stats.stats_dropped) == (2, 0)
    stats = received_stats(sock, 2)
    for s in stats:
        assert s.update_ratios is not None
        assert list(s.update_ratios) == pytest.approx(expected[s.step], rel=1e-4)

    lin = nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mon = gradwatch.watch(
        lin,
        opt,
        job="act",
        endpoint=endpoint,
        stats_every=1,
        update_ratios=False,
        heartbeat_every=0.05,
    )
    connected(sock, mon)  # the first monitor's messages are read up to this one's heartbeat
    lin(torch.randn(2, 2)).sum().backward()
    opt.step()
    mon.log(loss=1.0)
    mon.close()
    assert (mon.stats.stats_sent, mon.stats.stats_dropped) == (1, 0)
    (s,) = received_stats(sock, 1)
    assert s.update_ratios is None and s.weight_norms is not None


def test_a_spread_sample_ships_its_statistics_worked_out_by_the_shipper(pull) -> None:
    # A model of 2.1M elements is read in 8 phases, so a sample 12 steps from the next
    # is spread over them (agent/spreadplan.py) and ships host copies that the shipper
    # thread works out (agent/hostpart.py): what arrives over the wire is complete.
    sock, endpoint = pull
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024),
        nn.Tanh(), nn.Linear(1024, 1),
    )  # fmt: skip
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU unit dead
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = gradwatch.watch(
        model, opt, job="act", endpoint=endpoint, stats_every=12, early_stats=False
    )
    assert mon._wstats is not None and mon._wstats.phases > 1
    for _ in range(35):  # samples at 12 and 24, each done within its 12 steps
        model(torch.randn(64, 8)).square().mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    assert mon._parts and mon._parts[-1].ship  # the samples were spread
    mon.close()
    assert mon.stats.stats_sent == 2 and mon.stats.stats_dropped == 0
    stats = received_stats(sock, 2)
    assert [s.step for s in stats] == [12, 24]
    for s in stats:
        by_module = {a.module: a for a in s.act}
        assert by_module["1"].zero_frac == pytest.approx(1.0)
        assert by_module["3"].zero_frac is not None and 0.0 <= by_module["3"].zero_frac < 0.5
        assert by_module["5"].sat_frac is not None and by_module["5"].std > 0.0
        assert s.update_ratios is not None and s.weight_norms is not None
        assert np.isfinite(s.weight_norms).all() and (s.weight_norms > 0).all()
        # Dead ReLUs pass no gradient back, and the next weight sees only zeros: no
        # update to 0.weight, 0.bias, 2.weight (ratio 0); every later one measured,
        # positive and small (lr 1e-3).
        assert np.isfinite(s.update_ratios).all() and (s.update_ratios[:3] == 0).all()
        assert (s.update_ratios[3:] > 0).all()
        assert (s.update_ratios < 0.1).all()
