"""The collector parses a message's header JSON once (issue 17): same admission, same message.

The admission check reads the job and row count before decoding; the decoder
then reuses that parse. Both must answer exactly as the two separate parses did,
for valid headers and for anything a hostile sender may put in the frame.
"""

from __future__ import annotations

import struct

import pytest

from gradwatch.collector.limits import job_rows, peek
from gradwatch.wire import Batch, Event, Heartbeat, Schema, WireError, decode, encode
from gradwatch.wire.messages import (
    KIND_BATCH,
    MAGIC,
    MAX_HEADER_BYTES,
    VERSION,
    header_object,
)

SCHEMA = Schema(id=1, columns=("loss",), layers=("w",))
MESSAGES = [
    Batch("j", 2, 4, 1, 0, "inc", 0, (7, 8), (1.0, 2.0), b"\x00" * 16, SCHEMA, shards=2),
    Batch("j", 2, 4, 1, 1, "inc", 0, (9,), (3.0,), b"\x00" * 8, None),
    Heartbeat(job="j", rank=1, world=4, incarnation="inc", time=5.0, step=3, dropped=0),
    Event(job="j", rank=0, incarnation="inc", time=1.0, kind="data_change", step=2, fields={}),
]
PREAMBLE = struct.pack("<2sBB", MAGIC, VERSION, KIND_BATCH)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_decoding_with_the_parsed_header_gives_the_same_message(message: object) -> None:
    frames = encode(message)  # type: ignore[arg-type]  # one of the three kinds
    header = header_object(frames[0])
    assert isinstance(header, dict)
    assert decode(frames, header) == decode(frames) == message
    assert job_rows(header) == peek(frames[0])


@pytest.mark.parametrize(
    "head",
    [
        PREAMBLE + b'{"job": "j", "steps": [1, 2, 3]}',
        PREAMBLE + b'{"job": 3, "steps": "x"}',
        PREAMBLE + b"[1, 2]",  # not an object
        PREAMBLE + b"{not json",
        PREAMBLE + b"\xef\xbb\xbf" + b'{"job": "bom", "steps": [1]}',  # a UTF-8 BOM
        PREAMBLE + '{"job": "utf16", "steps": [1]}'.encode("utf-16-le"),
        PREAMBLE + b'{"job": "\xff\xfe", "steps": []}',  # not UTF-8
        PREAMBLE + b"[" * 100_000,  # nested deeper than the parser recurses (and oversized)
        PREAMBLE + b'{"job": "big", "pad": "' + b"x" * MAX_HEADER_BYTES + b'"}',
        PREAMBLE[:2],
        b"",
    ],
)
def test_admission_reads_every_header_as_peek_does(head: bytes) -> None:
    header = header_object(head)
    # What the server's receive loop does: the parsed header, else peek's own parse.
    assert (peek(head) if header is None else job_rows(header)) == peek(head)
    if header is None:  # then decode parses it itself and refuses it
        with pytest.raises(WireError):
            decode([head])
