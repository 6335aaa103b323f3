"""Watching leaves the model as the user had it: picklable, copyable, savable, convertible.

Each test changes or copies a watched model mid-run the way ordinary code
does and asserts the loop runs on and the agent keeps reporting (issue 20).
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.agent.hooks import Inert
from tests.agent.receiver import Received, receive, wait_connected


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    mon: gradwatch.Monitor,
    steps: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 6, dtype=dtype)).pow(2).mean()
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()


class Watched:
    """A monitor on a real PULL socket, connected before the loop starts."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer | None, pull, **kwargs) -> None:
        self.sock, endpoint = pull
        kwargs.setdefault("stats_every", 2)  # activation hooks are armed every other step
        self.mon = gradwatch.watch(
            model,
            opt,
            job="attach",
            endpoint=endpoint,
            flush_every=4,
            heartbeat_every=0.05,
            **kwargs,
        )
        self._seen = wait_connected(self.sock)

    def received(self) -> Received:
        self.mon.close()
        return receive(self.sock, self.mon, self._seen)


def watched(model: nn.Module, opt: torch.optim.Optimizer | None, pull, **kwargs) -> Watched:
    return Watched(model, opt, pull, **kwargs)


def hooks_of(model: nn.Module) -> list[object]:
    return [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]


def all_hooks(model: nn.Module) -> list[object]:
    return [h for m in model.modules() for h in hooks_of(m)]


# torch.load's default (weights_only=True since torch 2.6), allowlisting the model's
# own classes only: how pytorch/examples' word_language_model reloads the best model it
# saved whole each epoch. A gradwatch class in the file failed that load.
MLP_CLASSES = [nn.Sequential, nn.Linear, nn.ReLU, nn.Dropout]


def test_save_load_deepcopy_and_pickle_mid_run_behave_as_unwatched(pull) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = watched(model, opt, pull, phase_clock=True)  # hooks on the model itself too
    mon = w.mon
    train(model, opt, mon, 3)  # the next step is a cadence step: activation hooks armed
    assert hooks_of(model) and hooks_of(model[1])  # the phase clock's and the ReLU's
    buf = io.BytesIO()
    torch.save(model, buf)  # word_language_model saves the whole model each epoch
    buf.seek(0)
    with torch.serialization.safe_globals(MLP_CLASSES):
        loaded = torch.load(buf)
    copies = [loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    x = torch.randn(4, 6)
    model.eval()
    for other in copies:
        other.eval()
        assert all_hooks(other) == []  # left out, not carried along
        assert torch.equal(other(x), model(x))
    # A hook dict pickled by itself still gets the inert stand-in, which the default
    # load accepts while gradwatch is imported.
    buf = io.BytesIO()
    torch.save(model._forward_pre_hooks, buf)
    buf.seek(0)
    assert all(isinstance(h, Inert) for h in torch.load(buf).values())
    model.train()
    copy.deepcopy(opt)
    pickle.dumps(opt)  # a hook on the optimizer would make both fail
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf)["model"])
    train(model, opt, mon, 3)
    got = w.received()
    assert mon.stats.disabled is None
    assert sorted(got.steps) == list(range(1, 7))
    assert not got.kinds("degraded")


def test_a_model_saved_while_watched_loads_where_gradwatch_is_not(pull, tmp_path) -> None:
    """The file names no gradwatch class: a process that never imports gradwatch loads it
    with torch.load's default, allowlisting the model's own classes only."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watched(model, opt, pull)
    train(model, opt, w.mon, 3)  # the activation hooks are armed for the next step
    path = tmp_path / "model.pt"
    torch.save(model, path)
    assert b"gradwatch" not in path.read_bytes()
    model.eval()
    expected = model(torch.ones(2, 6)).tolist()
    w.received()
    names = ", ".join(f"nn.{c.__name__}" for c in MLP_CLASSES)
    code = (
        "import sys, torch\nfrom torch import nn\n"
        f"with torch.serialization.safe_globals([{names}]):\n"
        f"    m = torch.load({str(path)!r})\n"
        "m.eval()\n"
        "print(m(torch.ones(2, 6)).tolist(), 'gradwatch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == f"{expected} False"


def test_compile_before_and_after_watch(pull) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager")
    w = watched(compiled, opt, pull)
    mon = w.mon
    train(compiled, opt, mon, 2)
    after = torch.compile(model, backend="eager")  # the agent's hooks are on the inner model
    train(after, opt, mon, 2)
    got = w.received()
    assert mon.stats.disabled is None and sorted(got.steps) == [1, 2, 3, 4]
    assert got.layers[0] == "0.weight"  # the compile wrapper's prefix is not a layer name
    assert all(v is not None and v > 0 for v in got.steps[4].layers)
    # Activation statistics are off for a compiled model: the collector is told (info),
    # at the first step once connected (the notice at attach had no peer yet).
    notices = got.kinds("degraded")
    assert notices and all(
        n.fields["off"] == "activation statistics" and n.fields["optional"] for n in notices
    )


def test_dtype_changes_after_watch_keep_every_signal(pull, caplog) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watched(model, opt, pull)
    mon = w.mon
    train(model, opt, mon, 2)
    model.double()
    train(model, opt, mon, 3, dtype=torch.float64)
    model.half().float()
    train(model, opt, mon, 2)
    got = w.received()
    assert mon.stats.disabled is None and sorted(got.steps) == list(range(1, 8))
    for step in (3, 5, 7):
        assert all(v is not None and v > 0 for v in got.steps[step].layers), step
    # Nothing switched off: the weight-statistics sampler norms float64 weights too.
    assert not got.kinds("degraded")
    assert "internal error" not in caplog.text


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).squeeze(-1)


def test_sparse_gradients_switch_off_only_their_layers_and_the_collector_hears(pull) -> None:
    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD takes sparse gradients
    w = watched(model, opt, pull)
    mon = w.mon
    for _ in range(4):
        loss = model(torch.randint(0, 20, (8,))).pow(2).mean()
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    got = w.received()
    assert mon.stats.disabled is None and sorted(got.steps) == [1, 2, 3, 4]
    emb, weight, bias = got.steps[4].layers
    assert emb is None  # not measured: MISSING, never 0
    assert weight is not None and weight > 0 and bias is not None and bias > 0
    notices = got.kinds("degraded")  # once (twice if it raced the first heartbeat)
    assert 1 <= len(notices) <= 2
    # The dense layers are still read: a gap in coverage by design (info), not an incident.
    assert all(n.fields["optional"] is True and "emb.weight" in n.fields["reason"] for n in notices)


def test_an_internal_failure_tells_the_collector_and_closes_the_rank(
    pull, monkeypatch, caplog
) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watched(model, opt, pull)
    mon = w.mon
    train(model, opt, mon, 2)

    class Broken:  # a bug of the agent's own: nothing about the model changed
        names = mon._reader.names

        def read_into(self, row: torch.Tensor) -> None:
            raise RuntimeError("injected")

    monkeypatch.setattr(mon, "_reader", Broken())
    with caplog.at_level(logging.ERROR):
        train(model, opt, mon, 2)  # the loop runs on
    assert mon.stats.disabled is not None and "injected" in mon.stats.disabled
    events = w.received().events
    assert [e.kind for e in events][-2:] == ["degraded", "note"]
    assert events[-2].fields["off"] == "monitoring" and "injected" in events[-2].fields["reason"]
    assert events[-1].fields["note"] == "closed"


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"model": None}, TypeError, "model"),
        ({"job": 42}, TypeError, "job"),
        ({"endpoint": 5555}, TypeError, "endpoint"),
        ({"flush_every": "10"}, TypeError, "flush_every"),
        ({"stats_every": 2.5}, TypeError, "stats_every"),
        ({"enabled": "yes"}, TypeError, "enabled"),
        ({"optimizer": "sgd"}, TypeError, "optimizer"),
        ({"start_step": -1}, ValueError, "start_step"),
        ({"flush_every": 0}, ValueError, "flush_every"),
        ({"job": None}, TypeError, "job"),
    ],
)
def test_watch_argument_errors_name_the_argument(kwargs, error, named) -> None:
    args = {"model": nn.Linear(2, 1), "job": "j", "endpoint": "tcp://127.0.0.1:1"}
    args.update(kwargs)
    with pytest.raises(error, match=named) as info:
        gradwatch.watch(**args)
    assert not isinstance(info.value, AttributeError)
