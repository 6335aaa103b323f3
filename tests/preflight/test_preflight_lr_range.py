"""Stage 5 on least squares, where the divergence boundary is known: SGD on
0.5 * mean((Xw - y)^2) diverges above lr = 2 / lambda_max(X^T X / n)."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from torch import nn  # noqa: E402  # after importorskip

from gradwatch.preflight import LRRangeResult, lr_range_test  # noqa: E402  # after importorskip

N, D, BATCH = 256, 10, 32
FACTOR = 3.0


def problem() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """Minibatches of a least-squares problem whose full-batch Hessian has lambda_max = 1."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(N, D, generator=g))
    v, _ = torch.linalg.qr(torch.randn(D, D, generator=g))
    x = u @ torch.diag(torch.linspace(0.3, 1.0, D) * math.sqrt(N)) @ v.T
    y = x @ torch.randn(D, generator=g) + 0.1 * torch.randn(N, generator=g)
    lam = float(torch.linalg.eigvalsh(x.T @ x / N).max())
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, N, BATCH)], 2.0 / lam


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out.squeeze(-1) - target).pow(2).mean()


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(D, 1, bias=False)


def direct_boundary(batches: list, steps: int = 30) -> float:
    """The smallest lr on a 1.1x grid (from 0.5, well below it) where a short fixed-lr SGD run
    blows up."""
    lr = 0.5
    while lr < 100:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        first = None
        for i in range(steps):
            x, y = batches[i % len(batches)]
            loss = loss_fn(net(x), y)
            value = loss.item()
            first = value if first is None else first
            if not math.isfinite(value) or value > 4 * first:
                return lr
            opt.zero_grad()
            loss.backward()
            opt.step()
        lr *= 1.1
    raise AssertionError("no fixed lr below 100 diverged")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29]), "bad IHDR CRC"
    assert data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_the_boundary_matches_theory_and_a_direct_sweep(tmp_path: Path) -> None:
    batches, theory = problem()
    direct = direct_boundary(batches)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.0)
    weight = net.weight.detach().clone()
    result = lr_range_test(
        net, opt, loss_fn, batches, start=1e-4, end=100.0, steps=100, plot=tmp_path / "lr_range.png"
    )
    assert isinstance(result, LRRangeResult)
    assert result.boundary is not None
    assert theory / FACTOR <= result.boundary <= theory * FACTOR, (result.boundary, theory)
    assert direct / FACTOR <= result.boundary <= direct * FACTOR, (result.boundary, direct)
    assert result.suggested_lr == pytest.approx(result.boundary / 10)
    assert result.min_loss_lr is not None and result.min_loss_lr < result.boundary
    assert len(result.lrs) < 100  # the sweep stops at the boundary
    assert result.lrs[0] == pytest.approx(1e-4)
    # The originals are untouched: weights, optimizer lr, no gradient.
    assert torch.equal(net.weight, weight) and net.weight.grad is None
    assert opt.param_groups[0]["lr"] == 0.01
    assert result.plot == tmp_path / "lr_range.png"
    width, height = png_size(result.plot)
    assert width > 300 and height > 200 and result.plot.stat().st_size > 5000
    text = str(result)
    assert (
        "instability boundary at lr" in text and "suggested lr" in text and "lr_range.png" in text
    )


def test_a_factory_optimizer_without_a_plot_and_a_sweep_that_never_diverges() -> None:
    batches, _ = problem()
    result = lr_range_test(
        model(),
        lambda params: torch.optim.SGD(params, lr=1.0),
        loss_fn,
        batches,
        start=1e-4,
        end=0.5,
        steps=40,
        plot=None,
    )
    assert result.boundary is None and result.suggested_lr is None and result.plot is None
    assert len(result.lrs) == 40 and result.lrs[-1] == pytest.approx(0.5)
    assert result.smoothed[-1] < result.smoothed[0]
    assert "no instability boundary found" in str(result) and "extend `end`" in str(result)


def test_a_callable_batch_source_and_bad_arguments() -> None:
    batches, _ = problem()
    result = lr_range_test(
        model(),
        lambda ps: torch.optim.SGD(ps, lr=1.0),
        loss_fn,
        lambda: batches[0],
        start=1e-3,
        end=1e3,
        steps=60,
        plot=None,
    )
    assert result.boundary is not None
    with pytest.raises(ValueError, match="0 < start < end"):
        lr_range_test(
            model(), lambda ps: torch.optim.SGD(ps, lr=1.0), loss_fn, batches, start=1.0, end=0.1
        )
    with pytest.raises(ValueError, match="not this model's"):
        lr_range_test(
            model(), torch.optim.SGD(model().parameters(), lr=1.0), loss_fn, batches, plot=None
        )
    with pytest.raises(ValueError, match="batches is empty"):
        lr_range_test(model(), lambda ps: torch.optim.SGD(ps, lr=1.0), loss_fn, [], plot=None)
