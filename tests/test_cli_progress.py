"""Progress bars: drawn on a terminal's stderr only; replay keeps its output and messages."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from gradwatch.collector.replay import run_replay
from gradwatch.progress import NoBar, progress, progress_lines
from tests.test_cli import write_trace


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_no_bar_unless_the_stream_is_a_terminal() -> None:
    assert isinstance(progress(10, "work", stream=io.StringIO()), NoBar)
    screen = Terminal()
    with progress(10, "work", unit="step", stream=screen) as bar:
        bar.update(10)
    assert "work" in screen.getvalue() and "/10 " in screen.getvalue()  # tqdm throttles redraws


def test_no_bar_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    assert isinstance(progress(10, "work", stream=Terminal()), NoBar)


def test_progress_lines_counts_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("a\nbb\nccc\n")
    screen = Terminal()
    with progress_lines(path, "read", stream=screen) as lines:
        assert list(lines) == ["a\n", "bb\n", "ccc\n"]
    assert "read" in screen.getvalue() and "9" in screen.getvalue()


def test_replay_draws_progress_only_on_a_terminal(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", 200)
    piped_out, piped_err = io.StringIO(), io.StringIO()
    assert run_replay(trace, out=piped_out, err=piped_err) == 0
    assert piped_err.getvalue() == ""
    screen_out, screen = io.StringIO(), Terminal()
    assert run_replay(trace, out=screen_out, err=screen) == 0
    assert f"replay {trace.name}" in screen.getvalue()
    assert screen_out.getvalue() == piped_out.getvalue()  # results never mix with the bar


def test_a_bad_trace_is_still_named_in_the_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type":"header","version":1,"job":"j","layers":[]}\n{"type":"step"}\n')
    err = io.StringIO()
    assert run_replay(bad, strict=True, out=io.StringIO(), err=err) == 2
    assert f"{bad}:2: step: missing" in err.getvalue()
