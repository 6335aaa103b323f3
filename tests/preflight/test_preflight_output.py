"""The lr range test writes no file unless asked, and draws progress only on a terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gradwatch.preflight import LRRangeResult, lr_range_test  # noqa: E402  # after the torch skip

STEPS = 12


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def sweep() -> LRRangeResult:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    batch = (torch.randn(16, 4), torch.randn(16, 1))
    return lr_range_test(
        net,
        lambda ps: torch.optim.SGD(ps, lr=1.0),
        torch.nn.functional.mse_loss,
        [batch],
        start=1e-4,
        end=1e-2,
        steps=STEPS,
    )


def test_no_file_is_written_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = sweep()
    assert result.plot is None
    assert list(tmp_path.iterdir()) == []


def test_progress_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = io.StringIO()
    monkeypatch.setattr("sys.stderr", quiet)
    sweep()
    assert quiet.getvalue() == ""
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    sweep()
    assert "lr range test" in screen.getvalue() and f"/{STEPS}" in screen.getvalue()
