"""Wire format v1: the messages an agent sends to a collector over ZeroMQ.

Every message is a ZeroMQ multipart message. Frame 0 is the header: a 4-byte
preamble (``b"GW"``, the format version, the message kind) followed by a
compact UTF-8 JSON object. Numbers that scale with the model (per-layer
values) never travel as JSON: they travel as packed little-endian float32 in
their own frame, one row per step, so decoding 1,000 values costs a
``frombuffer`` rather than a JSON parse. See docs/wire.md for the full spec.

Stdlib only: this module sits at the bottom of the import graph.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gradwatch.wire.census import Census, CensusError, census_body, census_of, roles_of
from gradwatch.wire.fields import (
    MAX_RANK,
    MAX_STEP,
    WireError,
    WireVersionError,
    float_field,
    float_list,
    int_field,
    int_list,
    job_field,
    json_object,
    names_field,
    optional_int,
    str_field,
    world_field,
)

MAGIC: Final = b"GW"
VERSION: Final = 1

KIND_BATCH: Final = 1
KIND_HEARTBEAT: Final = 2
KIND_EVENT: Final = 3

# A quiet NaN with a payload: "this cell was not measured this step". Real NaNs
# produced by arithmetic carry the canonical payload, so the two never mix, and
# the agent can fill a whole device row with it in one kernel.
MISSING_BITS: Final = 0x7FC04757

MAX_HEADER_BYTES: Final = 64 * 1024
MAX_SCHEMA_BYTES: Final = 8 * 1024 * 1024
MAX_ROWS: Final = 65_536
MAX_COLUMNS: Final = 1 << 20
# "data_change": the job changed its data or task on purpose; rules re-baseline from its step.
DATA_CHANGE: Final = "data_change"
# "degraded": the agent switched part of itself off (contract C3); fields say why and what.
DEGRADED: Final = "degraded"
# "weights_written": the watched weights were written outside the optimizer before this
# step's update (a checkpoint loaded, a re-initialisation: agent/fence.py); fields.params.
WEIGHTS_WRITTEN: Final = "weights_written"
EVENT_KINDS: Final = frozenset(
    {"eval", "checkpoint", "train_mode", "note", DATA_CHANGE, DEGRADED, WEIGHTS_WRITTEN}
)
# A "note" event with this ``fields.note``: the agent closed (the job ended on this rank).
CLOSED_NOTE: Final = "closed"

# Optional batch header field: 1 when the sender saw a NaN/Inf in the values (a hint).
NONFINITE_FIELD: Final = "nonfinite"

_PREAMBLE = struct.Struct("<2sBB")


@dataclass(frozen=True, slots=True)
class Schema:
    """Names of a batch's columns, sent once per schema rather than every step.

    A row of a batch is ``len(columns) + len(layers)`` float32 values: the
    named columns first (``loss``, ``lr/0``, ``s/<scalar>``...), then one
    value per layer, in model order. Layer values are gradient L2 norms of
    the rank's shard: square them to get the rank's sum of squares, and add
    sums of squares across ranks to combine shards exactly.
    """

    id: int
    columns: tuple[str, ...]
    layers: tuple[str, ...]
    dtype: str = "float32"
    # Each layer's role (gradwatch.wire.census.ROLES), aligned with ``layers``;
    # empty when the agent did not say (older agents).
    layer_roles: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        return len(self.columns) + len(self.layers)


@dataclass(frozen=True, slots=True)
class Batch:
    """``len(steps)`` consecutive-in-time rows of one rank's signals.

    ``values`` holds ``len(steps) * schema width`` little-endian float32.
    ``dropped`` is the agent's cumulative count of steps it could not ship
    (cumulative so that one lost report does not lose the count).
    """

    job: str
    rank: int
    world: int
    schema_id: int
    seq: int
    incarnation: str
    dropped: int
    steps: tuple[int, ...]
    times: tuple[float, ...]
    values: bytes
    schema: Schema | None = None
    # How many ranks each replica's gradients are split across, so receivers
    # can assemble a step: 1 replicated (DDP: any one rank holds the whole
    # gradient), ``world`` fully sharded (FSDP/ZeRO: add every rank's sum of
    # squares), in between hybrid (rank r holds shard ``r % shards``). None:
    # not declared (an older agent); receivers then judge each rank alone.
    shards: int | None = None
    # A cadence-statistics batch's model census (docs/wire.md); None: not sent.
    census: Census | None = None
    # The sender saw a non-finite value (NaN/Inf, never MISSING) in ``values``: a hint
    # that buys the batch priority at the collector (docs/wire.md), never a verdict.
    nonfinite: bool = False


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent by the agent's shipper thread on a timer, whether steps advance or not."""

    job: str
    rank: int
    world: int
    incarnation: str
    time: float
    step: int
    dropped: int
    # The step whose forward pass has begun (``step + 1``) or ``step`` when the
    # rank sits between steps (its data loader, an eval); None if not tracked.
    # In a hung collective every rank's ``step`` is equal: the ranks that
    # already began the next step are waiting for the one that did not.
    started: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happens at a step but is not a step: eval, checkpoint..."""

    job: str
    rank: int
    incarnation: str
    time: float
    kind: str
    step: int
    fields: Mapping[str, Any] = field(default_factory=dict)


Message = Batch | Heartbeat | Event


# ---------------------------------------------------------------- encoding


def _header(kind: int, body: Mapping[str, Any]) -> bytes:
    text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    return _PREAMBLE.pack(MAGIC, VERSION, kind) + text.encode()


def encode_schema(schema: Schema) -> bytes:
    body: dict[str, Any] = {
        "id": schema.id,
        "columns": list(schema.columns),
        "layers": list(schema.layers),
        "dtype": schema.dtype,
    }
    if schema.layer_roles:
        body["layer_roles"] = list(schema.layer_roles)
    return json.dumps(body, separators=(",", ":")).encode()


def encode_batch(batch: Batch) -> list[bytes]:
    """Frames of a batch: header, optional schema, values."""
    body = {
        "job": batch.job,
        "rank": batch.rank,
        "world": batch.world,
        "schema": batch.schema_id,
        "seq": batch.seq,
        "inc": batch.incarnation,
        "dropped": batch.dropped,
        "steps": list(batch.steps),
        "times": list(batch.times),
    }
    if batch.shards is not None:
        body["shards"] = batch.shards
    if batch.census is not None:
        body["census"] = census_body(batch.census)
    if batch.nonfinite:
        body[NONFINITE_FIELD] = 1  # absent otherwise: the bytes of other batches are unchanged
    frames = [_header(KIND_BATCH, body)]
    if batch.schema is not None:
        frames.append(encode_schema(batch.schema))
    frames.append(bytes(batch.values))
    return frames


def encode_heartbeat(hb: Heartbeat) -> list[bytes]:
    body = {
        "job": hb.job,
        "rank": hb.rank,
        "world": hb.world,
        "inc": hb.incarnation,
        "time": hb.time,
        "step": hb.step,
        "dropped": hb.dropped,
    }
    if hb.started is not None:
        body["started"] = hb.started
    return [_header(KIND_HEARTBEAT, body)]


def encode_event(ev: Event) -> list[bytes]:
    body = {
        "job": ev.job,
        "rank": ev.rank,
        "inc": ev.incarnation,
        "time": ev.time,
        "kind": ev.kind,
        "step": ev.step,
        "fields": dict(ev.fields),
    }
    return [_header(KIND_EVENT, body)]


def encode(msg: Message) -> list[bytes]:
    if isinstance(msg, Batch):
        return encode_batch(msg)
    if isinstance(msg, Heartbeat):
        return encode_heartbeat(msg)
    return encode_event(msg)


# ---------------------------------------------------------------- decoding


def header_object(head: bytes) -> dict[str, Any] | None:
    """The JSON object a header frame carries after its preamble, as ``decode`` reads it.

    None where ``decode`` would refuse the frame for its size or its JSON. The
    collector reads a message's job before decoding it (its admission check);
    handing this object to ``decode(frames, header=...)`` parses the JSON once.
    """
    if not _PREAMBLE.size <= len(head) <= MAX_HEADER_BYTES:
        return None
    try:
        return json_object(head[_PREAMBLE.size :], "header")
    except WireError:
        return None


def decode(frames: Sequence[bytes | memoryview], header: dict[str, Any] | None = None) -> Message:
    """Decode one multipart message, or raise ``WireError``.

    Any input at all either yields a valid message or raises ``WireError``
    (property-tested): the collector may feed it whatever arrives on a socket.
    ``header``: ``header_object(frames[0])`` when the caller already has it.
    """
    if not 1 <= len(frames) <= 3:
        raise WireError(f"expected 1 to 3 frames, got {len(frames)}")
    head = bytes(frames[0])
    if len(head) < _PREAMBLE.size:
        raise WireError("header frame shorter than its 4-byte preamble")
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header frame of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    magic, version, kind = _PREAMBLE.unpack_from(head)
    if magic != MAGIC:
        raise WireError("not a gradwatch message (bad magic); is another program sending here?")
    if version != VERSION:
        raise WireVersionError(
            f"wire version {version} is not supported (this build speaks {VERSION}); "
            "upgrade the collector or pin the agent to a matching gradwatch release"
        )
    body = json_object(head[_PREAMBLE.size :], "header") if header is None else header
    if kind == KIND_BATCH:
        return _decode_batch(body, frames[1:])
    if len(frames) != 1:
        raise WireError(f"message kind {kind} takes 1 frame, got {len(frames)}")
    if kind == KIND_HEARTBEAT:
        return Heartbeat(
            job=job_field(body),
            rank=int_field(body, "rank", 0, MAX_RANK),
            world=world_field(body),
            incarnation=str_field(body, "inc", 64),
            time=float_field(body, "time"),
            step=int_field(body, "step", -1, MAX_STEP),
            dropped=int_field(body, "dropped", 0, MAX_STEP),
            started=optional_int(body, "started", 0, MAX_STEP),
        )
    if kind == KIND_EVENT:
        ev_kind = str_field(body, "kind", 32)
        if ev_kind not in EVENT_KINDS:
            raise WireError(
                f"unknown event kind {ev_kind!r}; expected one of {sorted(EVENT_KINDS)}"
            )
        fields = body.get("fields", {})
        if not isinstance(fields, dict):
            raise WireError("event 'fields' must be an object")
        return Event(
            job=job_field(body),
            rank=int_field(body, "rank", 0, MAX_RANK),
            incarnation=str_field(body, "inc", 64),
            time=float_field(body, "time"),
            kind=ev_kind,
            step=int_field(body, "step", -1, MAX_STEP),
            fields=fields,
        )
    raise WireError(f"unknown message kind {kind}")


def decode_schema(raw: bytes | memoryview) -> Schema:
    if len(raw) > MAX_SCHEMA_BYTES:
        raise WireError(f"schema frame of {len(raw)} bytes exceeds {MAX_SCHEMA_BYTES}")
    body = json_object(bytes(raw), "schema")
    columns = names_field(body, "columns")
    layers = names_field(body, "layers")
    if len(columns) + len(layers) > MAX_COLUMNS:
        raise WireError(f"schema of {len(columns) + len(layers)} columns exceeds {MAX_COLUMNS}")
    if len(set(columns)) != len(columns):
        raise WireError("schema column names must be unique")
    dtype = body.get("dtype", "float32")
    if not isinstance(dtype, str) or len(dtype) > 32:
        raise WireError("schema 'dtype' must be a short string")
    roles: tuple[str, ...] = ()
    if body.get("layer_roles") is not None:
        try:
            roles = roles_of(body["layer_roles"], len(layers))
        except CensusError as exc:
            raise WireError(f"schema {exc}") from None
    return Schema(
        id=int_field(body, "id", 0, 2**31),
        columns=columns,
        layers=layers,
        dtype=dtype,
        layer_roles=roles,
    )


def _decode_batch(body: dict[str, Any], rest: Sequence[bytes | memoryview]) -> Batch:
    if len(rest) not in (1, 2):
        raise WireError(f"a batch takes 2 or 3 frames, got {len(rest) + 1}")
    schema = decode_schema(rest[0]) if len(rest) == 2 else None
    schema_id = int_field(body, "schema", 0, 2**31)
    if schema is not None and schema.id != schema_id:
        raise WireError(f"batch names schema {schema_id} but carries schema {schema.id}")
    steps = int_list(body, "steps")
    times = float_list(body, "times")
    if not steps or len(steps) > MAX_ROWS:
        raise WireError(f"a batch holds 1 to {MAX_ROWS} steps, got {len(steps)}")
    if len(times) != len(steps):
        raise WireError(f"{len(steps)} steps but {len(times)} times")
    values = bytes(rest[-1])
    if len(values) % (4 * len(steps)):
        raise WireError(f"values frame of {len(values)} bytes is not {len(steps)} rows of float32")
    if schema is not None and len(values) != 4 * len(steps) * schema.width:
        raise WireError(
            f"values frame holds {len(values) // 4} floats; schema {schema.id} needs "
            f"{len(steps)} x {schema.width}"
        )
    world = world_field(body)
    shards = optional_int(body, "shards", 1, world)
    if shards is not None and world % shards:
        raise WireError(f"'shards' {shards} does not divide the world of {world} ranks")
    census = None
    if body.get("census") is not None:
        try:
            census = census_of(body["census"])
        except CensusError as exc:
            raise WireError(str(exc)) from None
    return Batch(
        job=job_field(body),
        rank=int_field(body, "rank", 0, MAX_RANK),
        world=world,
        schema_id=schema_id,
        seq=int_field(body, "seq", 0, MAX_STEP),
        incarnation=str_field(body, "inc", 64),
        dropped=int_field(body, "dropped", 0, MAX_STEP),
        steps=steps,
        times=times,
        values=values,
        schema=schema,
        shards=shards,
        census=census,
        nonfinite=optional_int(body, NONFINITE_FIELD, 0, 1) == 1,
    )


def flagged(header: Mapping[str, Any]) -> bool:
    """Whether a parsed batch header (``header_object``) carries the non-finite hint.

    Read before decoding, to order work; what the values hold is decided by
    decoding them, never by this flag.
    """
    value = header.get(NONFINITE_FIELD)
    return type(value) is int and value == 1


def row_width(batch: Batch) -> int:
    """Floats per row of ``batch`` (its values frame is checked to divide evenly)."""
    return len(batch.values) // (4 * len(batch.steps))
