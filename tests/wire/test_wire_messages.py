"""Wire v1: round trips, and any input either decodes or raises WireError."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwatch import wire
from gradwatch.wire import Batch, Event, Heartbeat, Schema, WireError, WireVersionError
from gradwatch.wire.messages import flagged

names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
jobs = st.text(
    st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=30
).filter(str.isprintable)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    columns = tuple(draw(st.lists(names, max_size=5, unique=True)))
    layers = tuple(draw(st.lists(names, max_size=8)))
    schema = Schema(id=draw(st.integers(0, 100)), columns=columns, layers=layers)
    rows = draw(st.integers(1, 6))
    world = draw(st.integers(1, 64))
    floats = draw(
        st.lists(st.floats(width=32), min_size=rows * schema.width, max_size=rows * schema.width)
    )
    return Batch(
        job=draw(jobs),
        rank=draw(st.integers(0, world - 1)),
        world=world,
        schema_id=schema.id,
        seq=draw(st.integers(0, 2**40)),
        incarnation="a1b2",
        dropped=draw(st.integers(0, 10**9)),
        steps=tuple(draw(st.lists(st.integers(0, 2**40), min_size=rows, max_size=rows))),
        times=tuple(draw(st.lists(finite, min_size=rows, max_size=rows))),
        values=struct.pack(f"<{len(floats)}f", *floats),
        schema=schema if draw(st.booleans()) or schema.width == 0 else None,
        nonfinite=draw(st.booleans()),
    )


@given(batches())
def test_batch_round_trips(batch: Batch) -> None:
    assert wire.decode(wire.encode(batch)) == batch


@given(jobs, st.integers(0, 10), finite, st.integers(-1, 2**40), st.integers(0, 2**40))
def test_heartbeat_round_trips(job: str, rank: int, t: float, step: int, dropped: int) -> None:
    hb = Heartbeat(
        job=job, rank=rank, world=rank + 1, incarnation="x", time=t, step=step, dropped=dropped
    )
    assert wire.decode(wire.encode(hb)) == hb


def test_event_round_trips() -> None:
    ev = Event(
        job="j",
        rank=0,
        incarnation="x",
        time=1.0,
        kind="checkpoint",
        step=100,
        fields={"path": "ckpt/100.pt"},
    )
    assert wire.decode(wire.encode(ev)) == ev


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
def test_random_frames_decode_or_raise_wire_error(frames: list[bytes]) -> None:
    try:
        msg = wire.decode(frames)
    except WireError:
        return
    assert isinstance(msg, (Batch, Heartbeat, Event))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.data())
def test_mutated_frames_decode_or_raise_wire_error(batch: Batch, data: st.DataObject) -> None:
    frames = [bytearray(f) for f in wire.encode(batch)]
    for _ in range(data.draw(st.integers(1, 4))):
        frame = frames[data.draw(st.integers(0, len(frames) - 1))]
        op = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
        if op == "flip" and frame:
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del frame[data.draw(st.integers(0, len(frame))) :]
        else:
            frame.extend(data.draw(st.binary(min_size=1, max_size=16)))
    try:
        msg = wire.decode([bytes(f) for f in frames])
    except WireError:
        return
    if isinstance(msg, Batch):
        # Whatever survived mutation is still self-consistent.
        assert len(msg.values) == 4 * len(msg.steps) * wire.row_width(msg)
        if msg.schema is not None:
            assert wire.row_width(msg) == msg.schema.width


@given(
    st.dictionaries(
        st.sampled_from(
            ["job", "rank", "world", "schema", "seq", "inc", "dropped", "steps", "times"]
            + ["nonfinite"]
        ),
        st.one_of(
            st.none(),
            st.integers(-5, 5),
            finite,
            st.text(max_size=3),
            st.lists(st.integers(-2, 3), max_size=3),
        ),
        max_size=9,
    )
)
def test_hostile_header_fields_raise_wire_error(body: dict) -> None:
    frames = [b"GW\x01\x01" + json.dumps(body).encode(), b"\x00" * 8]
    try:
        msg = wire.decode(frames)
    except WireError:
        return
    assert isinstance(msg, Batch) and 0 <= msg.rank < msg.world


def test_other_version_is_a_version_error() -> None:
    frames = wire.encode(
        Heartbeat(job="j", rank=0, world=1, incarnation="x", time=0.0, step=1, dropped=0)
    )
    frames[0] = b"GW\x02" + frames[0][3:]
    with pytest.raises(WireVersionError, match="upgrade the collector"):
        wire.decode(frames)


def test_values_that_do_not_match_the_schema_are_rejected() -> None:
    schema = Schema(id=3, columns=("loss",), layers=("a", "b"))
    batch = Batch(
        job="j",
        rank=0,
        world=1,
        schema_id=3,
        seq=0,
        incarnation="x",
        dropped=0,
        steps=(1, 2),
        times=(0.0, 0.1),
        values=b"\x00" * 4 * 8,
        schema=schema,
    )
    with pytest.raises(WireError, match="needs 2 x 3"):
        wire.decode(wire.encode(batch))


def test_deeply_nested_json_is_a_wire_error_not_a_crash() -> None:
    with pytest.raises(WireError):
        wire.decode([b"GW\x01\x02" + b"[" * 100_000 + b"]" * 100_000])


def test_missing_sentinel_is_a_quiet_nan_distinct_from_arithmetic_nan() -> None:
    (missing,) = struct.unpack("<f", struct.pack("<I", wire.MISSING_BITS))
    assert missing != missing  # a NaN
    (canonical,) = struct.unpack("<I", struct.pack("<f", float("nan")))
    assert canonical != wire.MISSING_BITS
    assert wire.MISSING_BITS & 0x7FC00000 == 0x7FC00000  # quiet NaN: survives copies


def _flag_batch(nonfinite: bool) -> Batch:
    return Batch(
        "j", 0, 2, 0, 0, "i", 0, (1,), (0.0,), struct.pack("<f", 1.0), None, 2, None, nonfinite
    )


def test_nonfinite_hint_travels_only_when_set() -> None:
    plain, hinted = wire.encode(_flag_batch(False)), wire.encode(_flag_batch(True))
    assert b"nonfinite" not in plain[0]  # batches without it keep their bytes
    assert json.loads(hinted[0][4:])["nonfinite"] == 1
    assert wire.decode(hinted).nonfinite and not wire.decode(plain).nonfinite
    assert flagged(json.loads(hinted[0][4:])) and not flagged(json.loads(plain[0][4:]))


@pytest.mark.parametrize("value", [True, 2, -1, "1", 1.0])
def test_a_nonfinite_hint_other_than_1_is_refused_and_never_flags(value: object) -> None:
    head = json.loads(wire.encode(_flag_batch(True))[0][4:])
    head["nonfinite"] = value
    assert not flagged(head)
    with pytest.raises(WireError):
        wire.decode([b"GW\x01\x01" + json.dumps(head).encode(), struct.pack("<f", 1.0)])
