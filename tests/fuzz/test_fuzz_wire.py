"""Hostile wire messages: ``decode`` yields a message or raises WireError; ``Ingest`` counts once.

Mutations happen at the header-JSON level (the byte-level ones are in tests/wire):
wrong types, huge numbers, NaN literals, deep nesting, extra and missing keys,
column counts that disagree with the values frame, ranks outside the world,
job names with control characters.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwatch.collector.ingest import REASONS, Ingest
from gradwatch.wire import (
    KIND_BATCH,
    KIND_EVENT,
    KIND_HEARTBEAT,
    Batch,
    Event,
    Heartbeat,
    WireError,
    decode,
)
from tests.fuzz.hostile import dumps, json_values, mutated_object, nested

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PREAMBLE = struct.Struct("<2sBB")

SCHEMA = {"id": 1, "columns": ["loss", "lr/0"], "layers": ["a", "b"], "dtype": "float32"}
BATCH = {
    "job": "run-1",
    "rank": 0,
    "world": 2,
    "schema": 1,
    "seq": 3,
    "inc": "inc-a",
    "dropped": 0,
    "steps": [10, 11],
    "times": [1.0, 2.0],
}
HEARTBEAT = {
    "job": "run-1",
    "rank": 1,
    "world": 2,
    "inc": "inc-a",
    "time": 3.0,
    "step": 11,
    "dropped": 0,
}
EVENT = {
    "job": "run-1",
    "rank": 0,
    "inc": "inc-a",
    "time": 3.0,
    "kind": "eval",
    "step": 11,
    "fields": {"loss": 1.5, "acc": "nan", "train_mode_modules": ["drop"]},
}
VALID = {KIND_BATCH: BATCH, KIND_HEARTBEAT: HEARTBEAT, KIND_EVENT: EVENT}


def header(kind: int, body: Any, version: int = 1) -> bytes:
    # surrogatepass: a lone surrogate in a string becomes invalid UTF-8, as a hostile peer sends.
    return PREAMBLE.pack(b"GW", version, kind) + dumps(body).encode("utf-8", "surrogatepass")


def values(rows: int, width: int) -> bytes:
    return struct.pack(f"<{rows * width}f", *([0.5] * (rows * width)))


def primed_ingest() -> Ingest:
    """An Ingest that already knows schema 1 of run-1/0/inc-a, so schema-less batches decode."""
    ingest = Ingest()
    ingest.feed([header(KIND_BATCH, BATCH), json.dumps(SCHEMA).encode(), values(2, 4)])
    assert ingest.stats().messages["batch"] == 1
    return ingest


def check(frames: list[bytes]) -> None:
    """The two properties every fuzz test here asserts."""
    try:
        message = decode(frames)
    except WireError:
        message = None
    else:
        assert isinstance(message, (Batch, Heartbeat, Event))
    ingest = primed_ingest()
    before = ingest.stats()
    ingest.feed(frames)  # must not raise
    after = ingest.stats()
    rejected = {r: after.rejected[r] - before.rejected[r] for r in REASONS}
    received = {k: after.messages[k] - before.messages[k] for k in after.messages}
    assert rejected["internal"] == 0, "a valid message crashed the collector"
    assert sum(rejected.values()) <= 1 and all(v >= 0 for v in rejected.values())
    if message is None:
        assert sum(rejected.values()) == 1 and sum(received.values()) == 0
    else:
        # Accepted, or counted as a message and then rejected for its schema: never both twice.
        assert sum(received.values()) == 1


@st.composite
def hostile_messages(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from([KIND_BATCH, KIND_HEARTBEAT, KIND_EVENT]))
    body = draw(mutated_object(VALID[kind]))
    frames = [header(kind, body)]
    if kind == KIND_BATCH:
        if draw(st.booleans()):
            frames.append(dumps(draw(mutated_object(SCHEMA))).encode("utf-8", "surrogatepass"))
        frames.append(values(draw(st.integers(0, 3)), draw(st.integers(0, 5))))
    return frames


@FUZZ
@given(hostile_messages())
def test_mutated_headers_decode_or_raise_wire_error_and_count_once(frames: list[bytes]) -> None:
    check(frames)


@FUZZ
@given(
    st.sampled_from([KIND_BATCH, KIND_HEARTBEAT, KIND_EVENT, 0, 4, 255]),
    st.sampled_from([0, 1, 2, 255]),
    json_values,
    st.integers(0, 3),
)
def test_any_json_header_any_kind_and_version(
    kind: int, version: int, body: Any, extra: int
) -> None:
    check([header(kind, body, version)] + [values(1, 2)] * extra)


@FUZZ
@given(
    st.integers(0, 4),
    st.integers(0, 6),
    st.lists(st.text(max_size=4), max_size=6),
    st.lists(st.text(max_size=4), max_size=6),
    st.booleans(),
)
def test_column_counts_that_disagree_with_the_values_frame(
    rows: int, width: int, columns: list[str], layers: list[str], send_schema: bool
) -> None:
    body = {**BATCH, "steps": list(range(rows)), "times": [0.0] * rows}
    schema = {**SCHEMA, "columns": columns, "layers": layers}
    frames = [header(KIND_BATCH, body)]
    if send_schema:
        frames.append(json.dumps(schema).encode())
    check(frames + [values(rows, width)])


@FUZZ
@given(
    st.sampled_from(["rank", "world"]),
    st.one_of(
        st.integers(-(2**70), 2**70), st.sampled_from([-1, 2**20, 2**20 + 1, 2**63, 10**400])
    ),
)
def test_negative_and_huge_ranks(key: str, value: int) -> None:
    check([header(KIND_HEARTBEAT, {**HEARTBEAT, key: value})])


@FUZZ
@given(
    st.text(st.characters(max_codepoint=0x9F), min_size=1, max_size=8).filter(
        lambda s: not s.isprintable()
    )
)
def test_job_names_with_control_characters_are_refused(job: str) -> None:
    frames = [header(KIND_HEARTBEAT, {**HEARTBEAT, "job": job})]
    with pytest.raises(WireError, match="printable"):
        decode(frames)
    check(frames)


@pytest.mark.parametrize("key", ["time", "times"])
@pytest.mark.parametrize("number", [10**400, -(10**400), 2**1024])
def test_integers_beyond_float_range_are_wire_errors(key: str, number: int) -> None:
    # Regression: math.isfinite(10**400) raised OverflowError out of decode().
    kind, body = (
        (KIND_HEARTBEAT, {**HEARTBEAT, "time": number})
        if key == "time"
        else (KIND_BATCH, {**BATCH, "times": [0.0, number]})
    )
    frames = [header(kind, body)] + ([values(2, 4)] if kind == KIND_BATCH else [])
    with pytest.raises(WireError, match="finite number"):
        decode(frames)
    check(frames)


@pytest.mark.parametrize(
    "text",
    [
        nested(100_000),
        nested(50_000, '{"a":', "}"),
        '{"job": NaN}',
        '{"time": Infinity}',
        "\ufeff{}",
        "{}" * 40_000,
    ],
    ids=["deep-list", "deep-object", "nan", "infinity", "bom", "long"],
)
def test_pathological_header_text(text: str) -> None:
    check([PREAMBLE.pack(b"GW", 1, KIND_HEARTBEAT) + text.encode()])
