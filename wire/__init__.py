"""gradwatch wire format v1 (stdlib only). Spec: docs/wire.md."""

from gradwatch.wire.messages import (
    KIND_BATCH,
    KIND_EVENT,
    KIND_HEARTBEAT,
    MISSING_BITS,
    VERSION,
    Batch,
    Event,
    Heartbeat,
    Message,
    Schema,
    WireError,
    WireVersionError,
    decode,
    decode_schema,
    encode,
    encode_batch,
    encode_event,
    encode_heartbeat,
    encode_schema,
    row_width,
)
from gradwatch.wire.trace import (
    TRACE_VERSION,
    TraceAct,
    TraceError,
    TraceEval,
    TraceEvent,
    TraceHeader,
    TraceHeartbeat,
    TraceReader,
    TraceRecord,
    TraceStats,
    TraceStep,
    encode_record,
    validate_trace,
)

__all__ = [
    "KIND_BATCH", "KIND_EVENT", "KIND_HEARTBEAT", "MISSING_BITS", "VERSION",
    "Batch", "Event", "Heartbeat", "Message", "Schema", "WireError", "WireVersionError",
    "decode", "decode_schema", "encode", "encode_batch", "encode_event", "encode_heartbeat",
    "encode_schema", "row_width",
    "TRACE_VERSION", "TraceAct", "TraceError", "TraceEval", "TraceEvent", "TraceHeader",
    "TraceHeartbeat", "TraceReader", "TraceRecord", "TraceStats", "TraceStep", "encode_record",
    "validate_trace",
]
