"""The model's towers from the loss's graph (agent/towers.py), and a loss declared unsupervised,
from the agent to the collector's records."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Categorical

import gradwatch
import gradwatch.agent.towers as towers_module
from gradwatch.agent.towers import towers_of
from tests.agent.test_agent_census import MiniGPT, collect, connected


class ActorCritic(nn.Module):
    """CleanRL's PPO agent: a critic and an actor MLP side by side, critic first."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        dist = Categorical(logits=self.actor(x))
        action = dist.sample()
        advantage = torch.randn(x.shape[0])
        policy = -(dist.log_prob(action) * advantage).mean() - 0.01 * dist.entropy().mean()
        value = 0.5 * (self.critic(x).view(-1) - torch.randn(x.shape[0]) * 50).pow(2).mean()
        return policy + value


def graph_loss(model: nn.Module, loss: torch.Tensor) -> tuple[int, ...]:
    loss.backward()
    return towers_of(loss, list(model.parameters()), ())


def test_an_actor_beside_a_critic_is_two_towers() -> None:
    model = ActorCritic()
    assert graph_loss(model, model.loss(torch.randn(8, 4))) == (0, 0, 0, 0, 1, 1, 1, 1)


def test_heads_on_a_shared_trunk_and_a_residual_stack_are_one_tower() -> None:
    trunk, pi, v = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 1)
    model = nn.ModuleList([trunk, pi, v])
    h = torch.relu(trunk(torch.randn(5, 4)))
    assert graph_loss(model, pi(h).logsumexp(-1).mean() + v(h).pow(2).mean()) == ()
    gpt = MiniGPT()  # tied embedding and head, residual blocks, a custom RMSNorm
    idx = torch.randint(0, 16, (2, 4))
    assert graph_loss(gpt, gpt(idx).logsumexp(-1).mean()) == ()


def test_a_scalar_that_scales_two_towers_joins_nothing() -> None:
    # A CLIP-style logit scale multiplies the product of two towers: it reaches both, and
    # by its use alone would make them one. Of role "other", it joins nothing (-1).
    image, text = nn.Linear(6, 4), nn.Linear(5, 4)
    scale = nn.Parameter(torch.tensor(2.0))
    logits = scale.exp() * (image(torch.randn(3, 6)) @ text(torch.randn(3, 5)).T)
    loss = nn.functional.cross_entropy(logits, torch.arange(3))
    loss.backward()
    params = [image.weight, image.bias, text.weight, text.bias, scale]
    roles = ("weight", "bias", "weight", "bias", "other")
    assert towers_of(loss, params, roles) == (0, 0, 1, 1, -1)
    assert towers_of(loss, params, ()) == ()  # joined by the scale when roles are unknown


def test_parameters_the_loss_does_not_reach_are_in_no_tower() -> None:
    a, b, unused = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    x = torch.randn(2, 3)
    loss = a(x).sum() + b(x).sum()
    loss.backward()
    params = [*a.parameters(), *unused.parameters(), *b.parameters()]
    assert towers_of(loss, params, ()) == (0, 0, -1, -1, 1, 1)


def test_no_graph_or_one_too_large_gives_no_towers(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ActorCritic()
    loss = model.loss(torch.randn(8, 4))
    assert towers_of(loss.detach(), list(model.parameters()), ()) == ()
    assert towers_of(1.5, list(model.parameters()), ()) == ()
    monkeypatch.setattr(towers_module, "MAX_NODES", 5)
    assert graph_loss(model, loss) == ()


def test_the_census_carries_the_towers_and_a_loss_declared_unsupervised(pull) -> None:
    sock, endpoint = pull
    torch.manual_seed(0)
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = gradwatch.watch(
        model,
        opt,
        job="ppo",
        endpoint=endpoint,
        flush_every=2,
        heartbeat_every=0.05,
        supervised_loss=False,
    )
    connected(sock, mon)
    for step in range(4):
        loss = model.loss(torch.randn(8, 4))
        loss.backward()
        opt.step()
        # The first log passes a float (no graph): the towers wait for a loss with one.
        mon.log(loss=loss.item() if step == 0 else loss)
        opt.zero_grad()
    mon.close()
    _, stats = collect(sock, mon)
    censuses = [s for s in stats if s.census is not None]
    assert censuses and all(s.census.supervised_loss is False for s in censuses)  # type: ignore[union-attr]
    first = censuses[0]
    assert first.step == 1 and first.census.towers == ()  # type: ignore[union-attr]
    later = [s for s in censuses if s.step >= 2]
    assert (
        later
        and all(
            s.census.towers == (0, 0, 0, 0, 1, 1, 1, 1)  # type: ignore[union-attr]
            and s.layers[:4]
            == ("critic.0.weight", "critic.0.bias", "critic.2.weight", "critic.2.bias")
            for s in later
        )
    )


def test_supervised_loss_must_be_a_bool() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="supervised_loss must be True or False"):
        gradwatch.watch(model, None, job="j", supervised_loss="no")  # type: ignore[arg-type]


def test_a_graph_that_cannot_be_walked_costs_a_warning_not_the_step(caplog) -> None:
    from gradwatch.agent.census import ModelCensus

    class Odd:
        grad_fn = object()  # no next_functions: not an autograd node

    model = ActorCritic()
    census = ModelCensus.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    census.find_towers(Odd(), list(model.parameters()))
    assert not census.towers_due  # tried once, not on every step
    assert census.take() is not None and census.take().towers == ()  # type: ignore[union-attr]
    assert "reading the model's towers from the loss's graph failed" in caplog.text
