"""Layer roles (contract C1) and the model census (contract C2), from the agent to the
rules' records."""

from __future__ import annotations

import pytest
import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent.census import ModelCensus, is_norm, mode_matters
from gradwatch.collector.ingest import Ingest
from gradwatch.rules.step import Stats, Step
from gradwatch.wire import Heartbeat, decode, encode

WAIT_MS = 5000


class RMSNorm(nn.Module):
    """A custom normalisation module, as LLaMA code writes one: known by its class name."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MiniGPT(nn.Module):
    """nanoGPT's shape: token embedding tied to the head, LayerNorms, Dropout(p=0.0)."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(4, d),
                "drop": nn.Dropout(0.0),
                "h": nn.ModuleList(
                    nn.ModuleDict(
                        {
                            "ln_1": nn.LayerNorm(d),
                            "c_fc": nn.Linear(d, 4 * d),
                            "c_proj": nn.Linear(4 * d, d),
                            "drop": nn.Dropout(0.0),
                        }
                    )
                    for _ in range(2)
                ),
                "ln_f": RMSNorm(d),
            }
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1])))
        for block in t.h:
            x = x + block.drop(block.c_proj(torch.relu(block.c_fc(block.ln_1(x)))))
        return self.lm_head(t.ln_f(x))


def test_roles_of_a_gpt_with_tied_embeddings() -> None:
    model = MiniGPT()
    census = ModelCensus.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    names = [name for name, _ in model.named_parameters()]
    roles = dict(zip(names, census.roles(p for _, p in model.named_parameters()), strict=True))
    assert roles["transformer.wte.weight"] == "tied"  # named once: named_parameters() dedups
    assert roles["transformer.wpe.weight"] == "embedding"
    assert roles["transformer.h.0.ln_1.weight"] == roles["transformer.h.0.ln_1.bias"] == "norm"
    assert roles["transformer.ln_f.weight"] == "norm"  # custom class ending in Norm
    assert roles["transformer.h.1.c_fc.weight"] == "weight"
    assert roles["transformer.h.1.c_fc.bias"] == "bias"
    c = census.take()
    assert c.tied == (("transformer.wte.weight", "lm_head.weight"),)
    total = sum(p.numel() for p in model.parameters())  # tied tensor once
    assert (c.params_total, c.params_trainable, c.params_frozen, c.params_not_in_optimizer) == (
        total,
        total,
        0,
        0,
    )
    model.eval()  # only Dropout(p=0.0): nothing whose mode changes the output
    c = census.take()
    assert c.eval_modules == () and c.model_training is False


def test_frozen_backbone_and_parameters_outside_the_optimizer() -> None:
    model = nn.Sequential()
    model.add_module("backbone", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    model.add_module("neck", nn.Linear(4, 4))
    model.add_module("head", nn.Linear(4, 2))
    model.backbone.requires_grad_(False)
    model.neck.bias.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)  # neck.weight forgotten
    census = ModelCensus.attach(model, opt)
    c = census.take()
    backbone = sum(p.numel() for p in model.backbone.parameters())
    assert c.frozen_modules == (("backbone", backbone), ("neck.bias", 4))
    assert c.params_frozen == backbone + 4
    assert c.not_in_optimizer == ("neck.weight",) and c.params_not_in_optimizer == 16
    assert c.params_trainable == 10
    assert 0 < c.frozen_share < 1
    assert census.take() is c  # nothing changed: the cached census
    model.backbone.requires_grad_(True)
    opt.add_param_group({"params": list(model.backbone.parameters()) + [model.neck.weight]})
    c = census.take()
    assert (c.params_frozen, c.frozen_modules, c.not_in_optimizer) == (4, (("neck.bias", 4),), ())


def test_only_modules_whose_mode_changes_the_output_count() -> None:
    assert mode_matters(nn.BatchNorm1d(3)) and mode_matters(nn.Dropout(0.1))
    assert not mode_matters(nn.Dropout(0.0))
    assert not mode_matters(nn.BatchNorm1d(3, track_running_stats=False))
    assert mode_matters(nn.MultiheadAttention(4, 2, dropout=0.1))
    assert not mode_matters(nn.MultiheadAttention(4, 2))
    assert not mode_matters(nn.LSTM(3, 3, num_layers=1, dropout=0.0))
    assert not mode_matters(nn.LayerNorm(3))
    assert is_norm(nn.GroupNorm(1, 4)) and is_norm(RMSNorm(3)) and not is_norm(nn.Linear(2, 2))
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.2), nn.Dropout(0.0))
    census = ModelCensus.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[1].eval()  # a frozen-BN fine-tune: the root keeps training
    c = census.take()
    assert (c.eval_modules, c.model_training) == (("1",), True)
    assert c.eval_norms_only  # only normalisation statistics frozen (norm_eval)
    model.eval()
    c = census.take()
    assert c.eval_modules == ("1", "2") and not c.eval_norms_only


def test_a_census_that_fails_switches_itself_off_with_one_warning(caplog) -> None:
    class Odd(nn.Linear):
        def named_modules(self, *args, **kwargs):  # a model the walk cannot handle
            raise RuntimeError("no walking here")

    model = Odd(2, 2)
    with caplog.at_level("WARNING", logger="gradwatch"):
        census = ModelCensus.attach(model, torch.optim.SGD([model.weight], lr=0.1))
    assert census.roles([model.weight]) == () and census.take() is None
    assert "census failed while walking" in caplog.text and "no walking here" in caplog.text
    good = nn.Linear(2, 2)
    census = ModelCensus.attach(good, torch.optim.SGD(good.parameters(), lr=0.1))
    census._optimizer = None  # type: ignore[assignment]  # breaks the next take()
    assert census.take() is None and census.take() is None


# ---------------------------------------------------------------- end to end


def connected(sock: zmq.Socket, mon: gradwatch.Monitor) -> None:
    for _ in range(100):
        assert sock.poll(WAIT_MS), "the agent did not connect in time"
        msg = decode(sock.recv_multipart())
        if isinstance(msg, Heartbeat) and msg.incarnation == mon.incarnation:
            return
    raise AssertionError("no heartbeat from the monitor")


def collect(sock: zmq.Socket, mon: gradwatch.Monitor) -> tuple[list[Step], list[Stats]]:
    """Everything the monitor sent up to its close, as the collector decodes it."""
    ingest, steps, stats = Ingest(), [], []
    while True:
        assert sock.poll(WAIT_MS), "the agent's 'closed' note did not arrive in time"
        msg = decode(sock.recv_multipart())
        out = ingest.feed(encode(msg))
        steps += out.steps
        stats += out.stats
        if any(e.kind == "note" and e.fields.get("note") == "closed" for e in out.events):
            return steps, stats


def census_watch(
    model: nn.Module, opt: torch.optim.Optimizer, sock: zmq.Socket, endpoint: str
) -> gradwatch.Monitor:
    """Watched with plain statistics every 50 steps, flushing every 2; connected."""
    mon = gradwatch.watch(
        model,
        opt,
        job="census",
        endpoint=endpoint,
        flush_every=2,
        stats_every=50,
        heartbeat_every=0.05,
        early_stats=False,
    )
    connected(sock, mon)
    return mon


def train(model: nn.Module, mon: gradwatch.Monitor, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randint(0, 16, (2, 4))).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()


def test_roles_and_census_reach_the_collector_and_eval_mode_is_noticed_at_once(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = MiniGPT()
    model.transformer.h[0].drop.p = 0.1  # one dropout whose mode matters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = census_watch(model, opt, sock, endpoint)
    train(model, mon, opt, 3)
    model.eval()  # left on by mistake: training continues in eval mode
    train(model, mon, opt, 3)
    mon.close()
    steps, stats = collect(sock, mon)
    assert steps and all(
        s.layer_roles[s.layers.index("transformer.wte.weight")] == "tied" for s in steps
    )
    assert all(len(s.layer_roles) == len(s.layers) for s in steps)
    forced = [s for s in stats if s.census is not None and not s.census.model_training]
    assert [s.step for s in forced] == [4]  # the first step trained in eval mode
    census = forced[0].census
    assert census is not None and census.eval_modules == ("transformer.h.0.drop",)
    assert census.tied == (("transformer.wte.weight", "lm_head.weight"),)


def test_a_model_in_eval_mode_from_the_start_is_sampled_at_step_1(pull) -> None:
    sock, endpoint = pull
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = census_watch(model, opt, sock, endpoint)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    _, stats = collect(sock, mon)
    assert [s.step for s in stats] == [1]
    census = stats[0].census
    assert census is not None and census.model_training is False
    assert census.eval_modules == ("1",) and stats[0].layers == tuple(
        name for name, _ in model.named_parameters()
    )


def test_log_eval_does_not_name_dropout_that_cannot_change_the_output(pull) -> None:
    sock, endpoint = pull
    model = MiniGPT()  # 3 Dropout(p=0.0), as nanoGPT's default config has 13
    model.transformer.h[1].drop.p = 0.2
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(model, opt, job="census", endpoint=endpoint, heartbeat_every=0.05)
    connected(sock, mon)
    model.train()  # eval logged after estimate_loss() put the model back in train mode
    mon.log_eval(loss=1.0)
    mon.close()
    ingest, evals = Ingest(), []
    while not evals:
        assert sock.poll(WAIT_MS), "the eval event did not arrive in time"
        evals = list(ingest.feed(sock.recv_multipart()).evals)
    assert evals[0].train_mode_modules == ("transformer.h.1.drop",)


def test_a_sample_cut_short_at_close_keeps_the_census_of_its_training_step(pull) -> None:
    """pytorch/examples' word_language_model closes after its last evaluation: a sample
    spread over steps and cut short there shipped a census taken then, with the model in
    eval mode, and TrainingInEvalMode paged a healthy run. The census is its step's."""
    sock, endpoint = pull
    torch.manual_seed(0)
    # Over 2 x 65,536 weights: the sample after step 50 is spread over the next steps.
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = census_watch(model, opt, sock, endpoint)
    for _ in range(52):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 64))  # the loop's last evaluation, then it closes
    mon.close()
    _, stats = collect(sock, mon)
    assert [s.step for s in stats][-1] == 50  # the sample cut short did ship
    assert all(s.census is not None and s.census.model_training for s in stats)
    assert all(s.census is not None and s.census.eval_modules == () for s in stats)


def test_each_layers_param_group_reaches_the_collector_aligned_with_its_layers(pull) -> None:
    # Discriminative rates (a backbone at lr/100 under its head): the rules weigh a lag by
    # the rate of the layer's own group, which only the agent can see.
    sock, endpoint = pull
    torch.manual_seed(0)
    model = MiniGPT()
    head = list(model.lm_head.parameters())
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = torch.optim.SGD([{"params": head, "lr": 1e-2}, {"params": rest, "lr": 1e-4}])
    mon = census_watch(model, opt, sock, endpoint)
    train(model, mon, opt, 50)  # the first sample: step 50
    mon.close()
    steps, stats = collect(sock, mon)
    census = next(s.census for s in stats if s.census is not None)
    layers = next(s.layers for s in stats if s.census is not None)
    tied = {id(p) for p in head}  # lm_head's weight is the tied embedding: in group 0
    expected = tuple(0 if id(p) in tied else 1 for p in model.parameters() if p.requires_grad)
    assert len(census.groups) == len(layers) and census.groups == expected
    assert steps[0].lr == pytest.approx((1e-2, 1e-4))  # float32 on the wire
    # One group: nothing to say, nothing sent.
    one = ModelCensus.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    taken = one.take(None, list(model.parameters()))
    assert taken is not None and taken.groups == ()
