"""The load benchmark's senders patch headers; the bytes must be the agent encoder's.

benchmarks/loadgen.py builds each rank's batch header once and patches only the
per-flush fields (seq, dropped, steps, times, the nonfinite hint); the collector
must receive exactly what ``wire.encode_batch`` makes for that batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gradwatch.wire import Batch, encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from loadgen import HeaderTemplate  # benchmarks/ is not a package: on sys.path above

jobs = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=30)
times = st.floats(allow_nan=False, allow_infinity=False, width=64)


@given(
    job=jobs,
    world=st.integers(1, 1 << 20),
    data=st.data(),
    seq=st.integers(0, 2**40),
    dropped=st.integers(0, 2**40),
    rows=st.integers(1, 12),
    first=st.integers(0, 2**40),
    inc=st.text(min_size=1, max_size=64),
    shards=st.none() | st.integers(1, 64),
    nonfinite=st.booleans(),
)
def test_patched_headers_are_the_encoders_bytes(
    job: str,
    world: int,
    data: st.DataObject,
    seq: int,
    dropped: int,
    rows: int,
    first: int,
    inc: str,
    shards: int | None,
    nonfinite: bool,
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    steps = tuple(range(first, first + rows))
    when = tuple(data.draw(st.lists(times, min_size=rows, max_size=rows)))
    template = HeaderTemplate(job, rank, world, 0, inc, shards)
    patched = template.header(seq, dropped, HeaderTemplate.steps_times(steps, when), nonfinite)
    batch = Batch(
        job, rank, world, 0, seq, inc, dropped, steps, when, b"", None, shards, None, nonfinite
    )
    assert patched == encode_batch(batch)[0]
