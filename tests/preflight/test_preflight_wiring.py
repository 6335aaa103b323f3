"""Stage 6: BatchNorm and Dropout at evaluation, on models whose wiring is known."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402  # after importorskip
from torch.nn import functional as F  # noqa: E402  # after importorskip

from gradwatch.preflight import WiringReport, wiring  # noqa: E402  # after importorskip


class Net(nn.Module):
    def __init__(self, track: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16, track_running_stats=track)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


class EvalKeepsTraining(Net):
    def train(self, mode: bool = True) -> EvalKeepsTraining:
        self.training = mode  # the bug: the mode never reaches the children
        return self


class FrozenBatchNorm(Net):
    def train(self, mode: bool = True) -> FrozenBatchNorm:
        super().train(mode)
        self.bn.eval()  # a BatchNorm pinned to eval, even in training
        return self


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(x, 0.5, training=True))  # the bug: ignores self.training


@pytest.fixture()
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def trained(model: nn.Module, batch: tuple) -> nn.Module:
    """A few training forwards so the running statistics are not the initial ones."""
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(batch[0] * 2 + 1)
    return model


@pytest.mark.parametrize("mode", [True, False])
def test_a_healthy_model_is_clean_and_left_as_it_was(batch: tuple, mode: bool) -> None:
    model = trained(Net(), batch)
    model.train(mode)
    stats = model.bn.running_mean.clone()
    report = wiring(model, batch, F.cross_entropy)
    assert isinstance(report, WiringReport)
    assert report.ok, str(report)
    assert report.batchnorm == ("bn",) and report.dropout == ("drop",)
    assert str(report) == "wiring OK: 1 BatchNorm, 1 Dropout module(s) checked"
    assert model.training is mode and model.bn.training is mode
    assert torch.equal(model.bn.running_mean, stats)


def test_an_eval_that_keeps_batchnorm_training_is_caught(batch: tuple) -> None:
    report = wiring(trained(EvalKeepsTraining(), batch), batch, F.cross_entropy)
    assert not report.ok
    assert report.modules("eval-mode") == ("bn", "drop")
    assert report.modules("batchnorm-stats") == ("bn",)
    assert report.modules("batchnorm-batch") == ("bn",)
    assert report.modules("dropout") == ("drop",)
    assert "[eval-mode] bn: still in training mode after model.eval()" in str(report)


def test_batchnorm_without_running_stats_uses_batch_statistics_at_eval(batch: tuple) -> None:
    report = wiring(trained(Net(track=False), batch), batch)
    assert report.modules() == ("bn",)
    assert report.modules("batchnorm-batch") == ("bn",)


def test_dropout_active_at_eval_is_caught_even_without_a_module(batch: tuple) -> None:
    report = wiring(FunctionalDropout(), batch, F.cross_entropy)
    assert report.modules("determinism") == ("<model>", "<loss>")
    assert "no BatchNorm/Dropout module found" in str(report)


def test_a_module_not_returned_to_training_mode_is_named(batch: tuple) -> None:
    report = wiring(trained(FrozenBatchNorm(), batch), batch)
    assert report.modules() == ("bn",)
    assert report.modules("train-mode") == ("bn",)


def test_a_batch_too_small_to_check_is_explained() -> None:
    report = wiring(Net(), (torch.randn(2, 8), torch.zeros(2, dtype=torch.long)))
    assert "pass at least 4 examples" in str(report)
