"""Trace format v1: round trips, NaN as strings, every bad line reported with its number."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwatch.wire import (
    TraceAct,
    TraceError,
    TraceEval,
    TraceEvent,
    TraceHeader,
    TraceHeartbeat,
    TraceReader,
    TraceStats,
    TraceStep,
    encode_record,
    validate_trace,
)

HEADER = TraceHeader(job="run-42", layers=("0.weight", "0.bias"))
HEAD = encode_record(HEADER)
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
maybe = st.none() | floats


def same(a: float | None, b: float | None) -> bool:
    return a is b or (
        a is not None and b is not None and (a == b or (math.isnan(a) and math.isnan(b)))
    )


def read(*lines: str, strict: bool = True) -> list[object]:
    return list(TraceReader([HEAD, *lines], strict=strict))


@given(
    loss=maybe,
    norms=st.tuples(maybe, maybe),
    lr=st.lists(floats, max_size=3),
    scale=maybe,
    time=maybe,
    step=st.integers(0, 2**53),
    rank=st.integers(0, 4096),
)
def test_step_round_trip(
    loss: float | None,
    norms: tuple[float | None, float | None],
    lr: list[float],
    scale: float | None,
    time: float | None,
    step: int,
    rank: int,
) -> None:
    rec = TraceStep(
        step=step,
        rank=rank,
        time=time,
        loss=loss,
        lr=tuple(lr),
        grad_norm=loss,
        layer_grad_norms=norms,
        loss_scale=scale,
        skipped=True,
        scalars={"tok/s": 1.5},
    )
    line = encode_record(rec)
    json.loads(line)  # strict JSON: NaN and Inf travel as strings
    assert "NaN" not in line and "Infinity" not in line
    (back,) = read(line)
    assert isinstance(back, TraceStep)
    assert (back.step, back.rank, back.skipped, dict(back.scalars)) == (
        step,
        rank,
        True,
        {"tok/s": 1.5},
    )
    assert same(back.loss, loss) and same(back.time, time) and same(back.loss_scale, scale)
    assert all(same(a, b) for a, b in zip(back.layer_grad_norms, norms, strict=True))
    assert len(back.lr) == len(lr) and all(same(a, b) for a, b in zip(back.lr, lr, strict=True))


def test_other_records_round_trip() -> None:
    records = [
        TraceStats(
            step=5,
            time=2.5,
            layer_weight_norms=(1.0, None),
            update_ratios=(1e-3, math.inf),
            act=(
                TraceAct("act.0", "relu", 0.3, 0.5, zero_frac=0.5),
                TraceAct("act.1", "tanh", 0.0, 0.9, sat_frac=0.1),
            ),
        ),
        TraceEval(step=100, loss=2.5, metrics={"acc": 0.7}, train_mode_modules=("bn1",)),
        TraceEvent(step=100, kind="checkpoint", fields={"path": "ckpt/100.pt"}),
        TraceHeartbeat(rank=3, time=12.0, step=99),
        TraceStep(step=7, layers=("x",), layer_grad_norms=(0.5,)),
    ]
    back = read(*(encode_record(r) for r in records))
    assert back[1:] == records[1:]
    stats = back[0]
    # `records` is typed as the record union; records[0] is the TraceStats built above.
    assert isinstance(stats, TraceStats) and stats.act == records[0].act  # type: ignore[attr-defined]
    assert stats.layer_weight_norms == (1.0, None) and stats.update_ratios == (1e-3, math.inf)


def test_design_example_lines_read() -> None:
    lines = [
        '{"type": "header", "version": 1, "job": "run-42", "layers": ["0.weight", "0.bias"]}',
        '{"type": "step", "step": 12, "rank": 0, "loss": 2.31, "lr": 0.1, "grad_norm": 1.2, '
        '"layer_grad_norms": [1.0, "nan"]}',
        '{"type": "eval", "step": 100, "loss": 2.5}',
        '{"type": "event", "step": 100, "kind": "checkpoint", "path": "ckpt/100.pt"}',
    ]
    reader = TraceReader(lines)
    step, ev, event = list(reader)
    assert reader.header == HEADER
    assert (
        isinstance(step, TraceStep) and step.lr == (0.1,) and math.isnan(step.layer_grad_norms[1])
    )
    assert isinstance(ev, TraceEval) and ev.loss == 2.5
    assert isinstance(event, TraceEvent) and event.fields == {"path": "ckpt/100.pt"}


def test_folded_step_line_gives_a_step_and_a_stats_record() -> None:
    line = (
        '{"type":"step","step":50,"loss":1.0,"layer_weight_norms":[2.0,0.1],'
        '"act":{"act.0":{"kind":"relu","mean":0.3,"std":0.5,"zero_frac":0.55}}}'
    )
    step, stats = read(line)
    assert isinstance(step, TraceStep) and isinstance(stats, TraceStats)
    assert stats.layer_weight_norms == (2.0, 0.1) and stats.act[0].zero_frac == 0.55


BAD = [
    ('{"type":"step","rank":0}', "step: missing"),
    ('{"type":"step","step":-1}', "step: expected a whole number in [0, 2**62)"),
    # Over int64: the rules keep steps in int64 arrays (an OverflowError before).
    ('{"type":"step","step":9253405579682588672,"loss":1.0}', "in [0, 2**62)"),
    ('{"type":"step","step":1,"loss":"lots"}', "loss: expected a number"),
    ('{"type":"step","step":1,"layer_grad_norms":[1.0]}', "1 values for 2 layers"),
    ('{"type":"step","step":1,"loss":true}', "loss: expected a number"),
    (
        '{"type":"stats","step":1,"act":{"a":{"kind":"relu","zero_frac":1.5}}}',
        "fraction from 0 to 1",
    ),
    ('{"type":"bogus","step":1}', "unknown record type 'bogus'"),
    ('{"type":"header","version":1,"job":"x"}', "a second header"),
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
]


def test_strict_reader_raises_at_the_first_bad_line_with_its_number() -> None:
    good = encode_record(TraceStep(step=1))
    with pytest.raises(TraceError) as info:
        list(TraceReader([HEAD, good, "", BAD[0][0], good], source="t.jsonl"))
    assert info.value.problems == ((4, "step: missing"),)
    assert str(info.value).startswith("1 bad line in trace t.jsonl:\nt.jsonl:4: step: missing")
    assert isinstance(info.value, ValueError)


def test_lenient_reader_skips_counts_and_keeps_going() -> None:
    good = encode_record(TraceStep(step=1))
    lines = [HEAD] + [line for bad, _ in BAD for line in (bad, good)]
    reader = TraceReader(lines, strict=False)
    assert len(list(reader)) == len(BAD)
    assert reader.skipped == len(BAD)
    for (_, message), (_, expected) in zip(reader.problems, BAD, strict=True):
        assert expected in message
    assert [line for line, _ in reader.problems] == list(range(2, 2 + 2 * len(BAD), 2))


def test_validate_lists_every_bad_line() -> None:
    with pytest.raises(TraceError) as info:
        validate_trace([HEAD, BAD[0][0], BAD[1][0]], source="x")
    assert [line for line, _ in info.value.problems] == [2, 3]
    assert validate_trace([HEAD]) == HEADER


@pytest.mark.parametrize(
    ("first", "message"),
    [
        ('{"type":"step","step":1}', "the first line must be the header"),
        ('{"type":"header","version":2,"job":"x","layers":[]}', "unsupported trace version 2"),
        ('{"type":"header","version":1,"job":"","layers":[]}', "job: expected a non-empty string"),
    ],
)
def test_a_bad_header_is_fatal_even_when_lenient(first: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        list(TraceReader([first], strict=False))


def test_an_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="the trace is empty"):
        list(TraceReader(["", "  "]))
