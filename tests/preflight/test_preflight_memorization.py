"""Stage 1 on models where the answer is known: a healthy MLP memorises; each broken
pipeline fails and names what to check."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402  # after importorskip
from torch.nn import functional as F  # noqa: E402  # after importorskip

from gradwatch.preflight import MemorizationResult, memorization  # noqa: E402  # after importorskip


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


@pytest.fixture()
def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)


def test_a_healthy_mlp_memorises_and_exits_early_without_touching_the_model(data: tuple) -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = memorization(model, F.cross_entropy, data, steps=300)
    assert isinstance(result, MemorizationResult)
    assert result.passed, str(result)
    assert result.loss_ratio <= 1e-3 and result.final_loss <= 1e-3 * result.initial_loss
    assert result.steps < 300  # early exit once the ratio passes
    assert not result.hints and not result.frozen and not result.no_grad
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert str(result).startswith("memorization PASSED")


def test_labels_shuffled_every_step_fail_with_the_pipeline_hint(data: tuple) -> None:
    x, y = data
    g = torch.Generator().manual_seed(2)

    def pipeline() -> tuple[torch.Tensor, torch.Tensor]:
        return x, y[torch.randperm(len(y), generator=g)]  # the bug: labels move against inputs

    result = memorization(mlp(), F.cross_entropy, pipeline, steps=150)
    assert not result.passed
    assert result.hints[0].startswith("data pipeline") and "shuffles labels" in result.hints[0]
    assert "FAILED" in str(result) and "shuffles labels" in str(result)


def test_a_detached_loss_fails_with_the_detached_graph_hint(data: tuple) -> None:
    result = memorization(mlp(), lambda out, y: F.cross_entropy(out.detach(), y), data)
    assert not result.passed and result.steps == 0
    assert result.hints[0].startswith("detached graph")


class HalfDetached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 3)
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)).detach())  # the bug: the encoder never learns


def test_parameters_no_gradient_reaches_are_named(data: tuple) -> None:
    torch.manual_seed(0)
    result = memorization(HalfDetached(), F.cross_entropy, data, steps=150)
    assert result.no_grad == ("encoder.weight", "encoder.bias")
    assert not result.passed  # a 3-wide random feature layer cannot memorise 12 labels
    assert any(h.startswith("detached graph") and "encoder.weight" in h for h in result.hints)


def test_a_frozen_model_fails_and_names_the_frozen_parameters(data: tuple) -> None:
    model = mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    result = memorization(model, F.cross_entropy, data)
    assert not result.passed
    assert result.frozen == ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")
    assert result.hints[0].startswith("frozen parameters") and "0.weight" in result.hints[0]


def test_a_flipped_loss_sign_fails_with_the_loss_wiring_hint(data: tuple) -> None:
    result = memorization(mlp(), lambda out, y: -F.cross_entropy(out, y), data, steps=100)
    assert not result.passed
    assert result.final_loss < result.initial_loss < 0
    assert result.hints[0].startswith("loss wiring") and "sign looks flipped" in result.hints[0]


def test_sgd_and_a_factory_optimizer_work_and_bad_input_is_explained(data: tuple) -> None:
    assert memorization(mlp(), F.cross_entropy, data, optimizer="sgd", lr=0.1).passed
    factory = memorization(
        mlp(), F.cross_entropy, data, optimizer=lambda ps, lr: torch.optim.Adam(ps, lr=lr), lr=1e-2
    )
    assert factory.passed
    with pytest.raises(ValueError, match="unknown optimizer"):
        memorization(mlp(), F.cross_entropy, data, optimizer="lion")
    with pytest.raises(ValueError, match="one scalar"):
        memorization(mlp(), lambda out, y: F.cross_entropy(out, y, reduction="none"), data)
