"""Hostile traces: strict mode raises TraceError with a line number, lenient mode skips and counts.

Also ``gradwatch replay`` on garbage: a non-zero exit and a message, never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwatch.cli import main as cli_main
from gradwatch.wire import TraceError, TraceReader
from gradwatch.wire.trace import TraceHeader
from tests.fuzz.hostile import dumps, json_values, mutated_object, nested

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = {"type": "header", "version": 1, "job": "run-1", "layers": ["a", "b"]}
RECORDS = [
    {
        "type": "step",
        "step": 1,
        "rank": 0,
        "time": 1.0,
        "loss": 2.5,
        "lr": [0.1, 0.01],
        "grad_norm": 1.0,
        "layer_grad_norms": [0.5, None],
        "scalars": {"tok": 3},
    },
    {
        "type": "stats",
        "step": 1,
        "layer_weight_norms": [1.0, 2.0],
        "update_ratios": ["nan", 0.1],
        "act": {"fc": {"kind": "relu", "mean": 0.1, "std": 1.0, "zero_frac": 0.5}},
    },
    {
        "type": "eval",
        "step": 2,
        "loss": "inf",
        "metrics": {"acc": 0.9},
        "train_mode_modules": ["d"],
    },
    {"type": "event", "step": 2, "kind": "checkpoint", "path": "c.pt"},
    {"type": "heartbeat", "rank": 1, "time": 3.0, "step": 2},
]


def garble(draw: st.DrawFn, line: str) -> str:
    """One byte-ish level mutation of a line: truncate, splice garbage, BOM, CRLF, NaN literal."""
    op = draw(st.sampled_from(["truncate", "splice", "bom", "crlf", "nan", "huge", "keep"]))
    if op == "truncate":
        return line[: draw(st.integers(0, len(line)))]
    if op == "splice":
        at = draw(st.integers(0, len(line)))
        junk = draw(st.binary(max_size=12)).decode("latin-1")
        return line[:at] + junk + line[at:]
    if op == "bom":
        return "\ufeff" + line
    if op == "crlf":
        return line + "\r\n"
    if op == "nan":
        return line.replace("2.5", draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"])))
    if op == "huge":
        return line.replace("2.5", "1" + "0" * draw(st.sampled_from([400, 5000])))
    return line


@st.composite
def hostile_traces(draw: st.DrawFn) -> list[str]:
    lines = [dumps(HEADER)]
    for _ in range(draw(st.integers(0, 6))):
        record = draw(st.sampled_from(RECORDS))
        if draw(st.booleans()):
            record = draw(mutated_object(record))
        lines.append(garble(draw, dumps(record)))
    if draw(st.integers(0, 9)) == 0:
        lines[0] = garble(draw, lines[0])
    if draw(st.integers(0, 9)) == 0:
        lines.insert(draw(st.integers(1, len(lines))), dumps(draw(json_values)))
    return lines


def read(lines: list[str], strict: bool) -> tuple[TraceReader, list[object], TraceError | None]:
    reader = TraceReader(lines, strict=strict, source="t.jsonl")
    records: list[object] = []
    try:
        records.extend(reader)
    except TraceError as exc:
        return reader, records, exc
    return reader, records, None


@FUZZ
@given(hostile_traces())
def test_strict_raises_trace_error_with_a_line_and_lenient_skips_and_counts(
    lines: list[str],
) -> None:
    _, _, error = read(lines, strict=True)
    if error is not None:
        assert error.problems and all(1 <= line <= len(lines) for line, _ in error.problems)
        assert f"t.jsonl:{error.problems[0][0]}:" in str(error)
    lenient, records, header_error = read(lines, strict=False)
    if header_error is not None:
        # Without a readable header no line can be read: both modes refuse, at line 1-ish.
        assert error is not None and header_error.problems[0][0] == error.problems[0][0]
        return
    assert lenient.skipped == len(lenient.problems) <= len(lines)
    assert (lenient.skipped == 0) == (error is None)
    if error is not None:
        assert lenient.problems[0] == error.problems[0]  # the same first bad line
    assert all(not isinstance(r, TraceHeader) for r in records)


@FUZZ
@given(st.lists(st.one_of(st.text(max_size=40), json_values.map(dumps)), max_size=6))
def test_any_lines_at_all(lines: list[str]) -> None:
    for strict in (True, False):
        read(lines, strict)  # TraceError or records; anything else propagates and fails


@pytest.mark.parametrize(
    "bad",
    [
        nested(100_000),
        '{"type":"step","step":1,"loss":1' + "0" * 400 + "}",
        '{"type":"step","step":' + "9" * 5000 + "}",
        "\x00\xff\xfe",
        "[]",
        '{"type":"stats","step":1,"act":{"m":{"mean":1,"std":1,"zero_frac":NaN}}}',
    ],
    ids=lambda text: text[:30],
)
def test_pathological_lines(bad: str) -> None:
    # Regression: deep nesting raised RecursionError and 1e400-as-an-integer OverflowError.
    lines = [dumps(HEADER), bad, dumps(RECORDS[0])]
    lenient, records, error = read(lines, strict=False)
    assert error is None and records[-1] == next(iter(TraceReader([lines[0], lines[2]])))
    if lenient.skipped:
        assert lenient.problems[0][0] == 2
        with pytest.raises(TraceError, match="t.jsonl:2:"):
            list(TraceReader(lines, strict=True, source="t.jsonl"))
    else:
        assert len(list(TraceReader(lines, strict=True))) == len(records)


def test_an_integer_beyond_float_range_reads_as_infinity_like_1e999() -> None:
    line = '{"type":"step","step":1,"loss":1' + "0" * 400 + "}"
    (step,) = TraceReader([dumps(HEADER), line])
    (same,) = TraceReader([dumps(HEADER), '{"type":"step","step":1,"loss":1e999}'])
    assert step.loss == same.loss == float("inf")


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\x01\xff garbage \xfe" * 50,
        b"",
        b"not json\n",
        b'{"type":"header","version":99,"job":"j"}\n',
        json.dumps(HEADER).encode() + b"\n{broken\n",
    ],
    ids=["binary", "empty", "text", "version", "broken"],
)
def test_replay_cli_on_garbage_exits_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    trace = tmp_path / "garbage.jsonl"
    trace.write_bytes(content)
    assert cli_main(["replay", "--strict", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradwatch replay: ") and "garbage.jsonl" in err
    assert "Traceback" not in err


def test_replay_cli_entry_point_in_a_real_process(tmp_path: Path) -> None:
    trace = tmp_path / "garbage.jsonl"
    trace.write_bytes(b"\x00\x01\xff garbage \xfe" * 50)
    result = subprocess.run(
        [sys.executable, "-m", "gradwatch", "replay", str(trace)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"gradwatch replay: cannot read {trace}")


@pytest.mark.parametrize("first", ["null", "[]", "1", '"header"', "NaN"])
def test_a_header_that_is_not_an_object_is_a_trace_error_at_line_1(first: str) -> None:
    # Regression: a non-object header line raised AttributeError.
    for strict in (True, False):
        with pytest.raises(TraceError, match="t.jsonl:1: the first line must be the header"):
            list(TraceReader([first, dumps(RECORDS[0])], strict=strict, source="t.jsonl"))
