"""Ingest: wire frames in, Steps out; bad input counted, never raised."""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwatch.collector.ingest import Ingest
from gradwatch.wire import MISSING_BITS, Batch, Event, Heartbeat, Schema, encode

COLUMNS = ("loss", "lr/0", "lr/1", "skipped", "loss_scale", "s/grad_norm", "s/tokens")
LAYERS = ("embed.weight", "fc.weight", "fc.bias")


def values(rows: Sequence[Sequence[float | None]]) -> bytes:
    """Rows of float32, ``None`` written as the MISSING bit pattern."""
    arr = np.array([[np.nan if v is None else v for v in row] for row in rows], "<f4")
    bits = arr.view("<u4")
    bits[np.array([[v is None for v in row] for row in rows], bool)] = MISSING_BITS
    return arr.tobytes()


def batch(
    rows: Sequence[Sequence[float | None]],
    *,
    steps: Sequence[int] | None = None,
    seq: int = 0,
    job: str = "run-1",
    rank: int = 0,
    inc: str = "inc-a",
    dropped: int = 0,
    schema_id: int = 1,
    columns: Sequence[str] = COLUMNS,
    layers: Sequence[str] = LAYERS,
    send_schema: bool = True,
    dtype: str = "float32",
) -> list[bytes]:
    steps = tuple(steps if steps is not None else range(1, len(rows) + 1))
    schema = Schema(schema_id, tuple(columns), tuple(layers), dtype) if send_schema else None
    return encode(
        Batch(
            job,
            rank,
            max(rank + 1, 2),
            schema_id,
            seq,
            inc,
            dropped,
            steps,
            tuple(float(s) for s in steps),
            values(rows),
            schema,
        )
    )


def test_decodes_every_column_kind() -> None:
    ingest = Ingest()
    out = ingest.feed(batch([[2.5, 0.1, 0.01, 0.0, 1024.0, 7.0, 512.0, 3.0, 4.0, 0.0]]))
    (step,) = out.steps
    assert (step.job, step.step, step.rank, step.time) == ("run-1", 1, 0, 1.0)
    assert step.loss == 2.5
    assert step.lr == (pytest.approx(0.1), pytest.approx(0.01))
    assert step.skipped is False and step.loss_scale == 1024.0
    assert step.grad_norm == 7.0  # the pre-clip scalar wins over the layers' norm (5.0)
    assert dict(step.scalars) == {"tokens": 512.0}
    assert step.layers == LAYERS
    assert step.layer_norms.dtype == np.float64
    assert step.layer_norms.tolist() == [3.0, 4.0, 0.0]
    assert ingest.stats().messages["batch"] == 1


def test_missing_cells_are_none_never_zero() -> None:
    out = Ingest().feed(
        batch(
            [
                [None, None, 0.01, None, None, None, None, 3.0, None, 4.0],
                [1.0, 0.1, 0.01, 1.0, 8.0, None, 5.0, None, None, None],
            ]
        )
    )
    first, second = out.steps
    assert first.loss is None and first.loss_scale is None and first.skipped is False
    assert first.lr == ()  # one group not measured: the step's lr is not measured
    assert dict(first.scalars) == {}
    assert first.layers == ("embed.weight", "fc.bias")
    assert first.layer_norms.tolist() == [3.0, 4.0]
    assert first.grad_norm == 5.0  # scalar missing: computed from the measured layers
    assert second.skipped is True and second.loss_scale == 8.0
    assert second.layers == () and second.layer_norms.size == 0
    assert second.grad_norm is None


def test_real_nan_is_not_missing_and_grad_norm_is_float64() -> None:
    columns = ("loss",)
    out = Ingest().feed(
        batch(
            [[float("nan"), 3e38, 3e38], [1.0, float("inf"), 1.0]],
            columns=columns,
            layers=("a", "b"),
        )
    )
    first, second = out.steps
    assert first.loss is not None and math.isnan(first.loss)
    # Squares overflow float32 but not float64: the total stays finite.
    assert first.grad_norm == pytest.approx(float(np.float32(3e38)) * math.sqrt(2))
    assert math.isinf(second.grad_norm)


def test_schema_cache_per_incarnation_and_unknown_schema() -> None:
    ingest = Ingest()
    row = [[1.0, 0.1, 0.1, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    assert len(ingest.feed(batch(row)).steps) == 1
    assert len(ingest.feed(batch(row, seq=1, send_schema=False)).steps) == 1
    # A restarted agent (new incarnation) must resend its schema.
    assert ingest.feed(batch(row, inc="inc-b", send_schema=False)).steps == ()
    assert ingest.stats().rejected["unknown_schema"] == 1
    assert len(ingest.feed(batch(row, inc="inc-b", seq=1)).steps) == 1
    ingest.forget("run-1")
    assert ingest.feed(batch(row, seq=2, send_schema=False)).steps == ()
    assert ingest.stats().rejected["unknown_schema"] == 2


def test_seq_gaps_count_lost_batches() -> None:
    ingest = Ingest()
    row = [[1.0]]
    for seq in (5, 6, 9, 9, 10):  # first seen at 5: nothing before it is "lost" to us
        ingest.feed(batch(row, seq=seq, columns=(), layers=("a",)))
    ingest.feed(batch(row, seq=0, inc="inc-b", columns=(), layers=("a",)))
    assert ingest.stats().lost_batches == {"run-1": 2}


def test_agent_dropped_deltas_from_batches_and_heartbeats() -> None:
    ingest = Ingest()
    for seq, dropped in enumerate((0, 3, 3, 10)):
        ingest.feed(batch([[1.0]], seq=seq, dropped=dropped, columns=(), layers=("a",)))
    ingest.feed(encode(Heartbeat("run-1", 0, 2, "inc-a", 0.0, 4, 12)))
    ingest.feed(encode(Heartbeat("run-1", 0, 2, "inc-b", 0.0, 0, 2)))  # restarted agent
    ingest.feed(encode(Heartbeat("run-2", 1, 2, "inc-c", 0.0, 0, 1)))
    stats = ingest.stats()
    assert stats.agent_dropped == {"run-1": 14, "run-2": 1}
    assert stats.messages == {"batch": 4, "heartbeat": 3, "event": 0}


def test_two_live_agents_taking_turns_as_one_rank_are_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # pytorch/examples' mnist_hogwild with watch() in each process and no rank=: both
    # report as rank 0, their heartbeats alternate.
    ingest = Ingest()
    with caplog.at_level(logging.WARNING, logger="gradwatch.collector.ingest"):
        for i, inc in enumerate(["inc-a", "inc-b"] * 3):
            ingest.feed(encode(Heartbeat("hog", 0, 1, inc, float(i), i, 0)))
    assert ingest.stats().twin_agents == {"hog": 3}  # every switch from the second return on
    (warned,) = [r.getMessage() for r in caplog.records]
    assert "job 'hog' rank 0 is reported by two live agents" in warned
    assert "own rank= and world=" in warned


def test_a_restarted_agent_is_no_twin(caplog: pytest.LogCaptureFixture) -> None:
    # A restart moves a rank to a new incarnation for good, however often it happens.
    ingest = Ingest()
    with caplog.at_level(logging.WARNING, logger="gradwatch.collector.ingest"):
        for i, inc in enumerate(["inc-a", "inc-a", "inc-b", "inc-b", "inc-c", "inc-c"]):
            ingest.feed(encode(Heartbeat("run", 0, 1, inc, float(i), i, 0)))
        # One late heartbeat of the dying agent is not two live ones either.
        ingest.feed(encode(Heartbeat("run", 0, 1, "inc-b", 9.0, 5, 0)))
    assert not caplog.records
    assert ingest.stats().twin_agents == {}


def test_heartbeats_and_events_pass_through() -> None:
    ingest = Ingest()
    hb = Heartbeat("run-1", 0, 1, "inc-a", 1.0, 4, 0)
    ev = Event("run-1", 0, "inc-a", 2.0, "checkpoint", 100, {"path": "ckpt/100.pt"})
    assert ingest.feed(encode(hb)).heartbeats == (hb,)
    assert ingest.feed(encode(ev)).events == (ev,)


def test_dtype_max_follows_the_schema_dtype() -> None:
    (step,) = Ingest().feed(batch([[1.0]], columns=(), layers=("a",), dtype="float16")).steps
    assert step.dtype_max == 65504.0


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"junk"], "malformed"),
        ([b""], "malformed"),
        ([b"GW\x01\x01{}"] * 5, "malformed"),
        ([b"GW\x07\x02{}"], "version"),
        ([b"GW\x01\x09{}"], "malformed"),
    ],
)
def test_bad_frames_are_counted_by_reason(frames: list[bytes], reason: str) -> None:
    ingest = Ingest()
    assert ingest.feed(frames).steps == ()
    assert ingest.stats().rejected[reason] == 1


def test_width_mismatch_with_cached_schema_is_malformed() -> None:
    ingest = Ingest()
    ingest.feed(batch([[1.0, 2.0]], columns=(), layers=("a", "b")))
    ingest.feed(batch([[1.0, 2.0, 3.0]], seq=1, columns=(), layers=("a", "b"), send_schema=False))
    assert ingest.stats().rejected["malformed"] == 1


def test_oversized_is_counted_before_decoding() -> None:
    ingest = Ingest(max_message_bytes=1024)
    assert (
        ingest.feed(batch([[1.0] * 300], columns=(), layers=tuple(map(str, range(300))))).steps
        == ()
    )
    assert ingest.stats().rejected["oversized"] == 1


def test_rejections_are_logged_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    ingest = Ingest()
    with caplog.at_level(logging.WARNING, logger="gradwatch.collector.ingest"):
        for _ in range(2000):
            ingest.feed([b"junk"])
    assert ingest.stats().rejected["malformed"] == 2000
    assert len(caplog.records) == 3  # the 1st, 1000th and 2000th
    assert "malformed: 1000 so far" in caplog.records[1].getMessage()


def _valid_frames() -> list[list[bytes]]:
    return [
        batch([[1.0, 0.1, 0.1, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]),
        encode(Heartbeat("run-1", 0, 1, "inc-a", 1.0, 4, 0)),
        encode(Event("run-1", 0, "inc-a", 2.0, "eval", 100, {"loss": 1.0})),
    ]


frames_strategy = st.one_of(
    st.lists(st.binary(max_size=64), min_size=0, max_size=5),
    st.lists(
        st.binary(max_size=8).map(lambda b: b"GW\x01" + b[:1] + b"{" + b[1:]),
        min_size=1,
        max_size=4,
    ),
    st.tuples(
        st.sampled_from(range(3)), st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 2)
    ).map(lambda t: _mutate(*t)),
)


def _mutate(which: int, position: int, byte: int, frame: int) -> list[bytes]:
    frames = [bytearray(f) for f in _valid_frames()[which]]
    target = frames[frame % len(frames)]
    if target:
        target[position % len(target)] = byte
    return [bytes(f) for f in frames]


@settings(max_examples=300, deadline=None, database=None)
@given(frames_strategy)
def test_any_frames_never_raise(frames: list[bytes]) -> None:
    ingest = Ingest()
    out = ingest.feed(frames)
    stats = ingest.stats()
    assert sum(stats.messages.values()) + sum(stats.rejected.values()) >= 1
    for step in out.steps:
        assert len(step.layers) == step.layer_norms.size


def test_struct_helper_matches_missing_bits() -> None:
    # The test helper itself must produce the wire's MISSING pattern.
    assert struct.unpack("<I", values([[None]]))[0] == MISSING_BITS
