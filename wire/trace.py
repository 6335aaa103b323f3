"""gradwatch trace format v1: JSON Lines a collector records and ``gradwatch replay`` reads.

One header line, then one line per record. Spec: docs/trace.md. Stdlib only.

Missing fields mean "not measured", never zero. JSON has no NaN, so
non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``;
a ``null`` inside a per-layer list means that layer was not measured.

Example::

    header = TraceHeader(job="run-42", layers=("0.weight", "0.bias"))
    lines = [encode_record(header), encode_record(TraceStep(step=1, loss=2.3,
             layer_grad_norms=(0.5, float("nan"))))]
    reader = TraceReader(lines)
    for record in reader:
        print(record)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from gradwatch.wire.census import Census, CensusError, census_of, roles_of
from gradwatch.wire.fields import MAX_STEP
from gradwatch.wire.trace_records import (
    TRACE_VERSION,
    TraceAct,
    TraceError,
    TraceEval,
    TraceEvent,
    TraceHeader,
    TraceHeartbeat,
    TraceRecord,
    TraceStats,
    TraceStep,
    encode_record,
    record_body,
)

# The records and their encoding live in trace_records (this module stayed under
# 500 lines); importers use this module for both.
__all__ = [
    "MAX_LINE_CHARS",
    "MAX_PROBLEMS_KEPT",
    "TRACE_VERSION",
    "TraceAct",
    "TraceError",
    "TraceEval",
    "TraceEvent",
    "TraceHeader",
    "TraceHeartbeat",
    "TraceReader",
    "TraceRecord",
    "TraceStats",
    "TraceStep",
    "decode_record",
    "encode_record",
    "record_body",
    "validate_trace",
]
MAX_LINE_CHARS: Final = 64 * 1024 * 1024
MAX_PROBLEMS_KEPT: Final = 100

_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}
# The element types of a layer list that need no conversion (see _float_list).
_PLAIN_FLOATS: frozenset[type] = frozenset({float, type(None)})


class _Bad(Exception):
    """One problem with one line (internal: the reader adds the line number)."""


def _float(obj: Mapping[str, Any], key: str, *, required: bool = False) -> float | None:
    if key not in obj or obj[key] is None:
        if required:
            raise _Bad(f"{key}: missing")
        return None
    return _as_float(obj[key], key)


def _as_float(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise _Bad(f"{what}: expected a number, got {value!r}")
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # an integer beyond float range, like the literal 1e999
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return _NONFINITE[value.strip().lower()]
    raise _Bad(f'{what}: expected a number or "nan"/"inf"/"-inf", got {value!r:.40}')


def _int(obj: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = obj.get(key)
    if value is None:
        if default is None:
            raise _Bad(f"{key}: missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_STEP:
        raise _Bad(f"{key}: expected a whole number in [0, 2**62), got {value!r:.40}")
    return value


def _str(obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise _Bad(f"{key}: expected a non-empty string, got {value!r:.40}")
    return value


def _names(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Bad(f"{what}: expected a list of strings")
    return tuple(value)


def _float_list(value: Any, what: str, width: int) -> tuple[float | None, ...]:
    if not isinstance(value, list):
        raise _Bad(f"{what}: expected a list of numbers")
    if len(value) != width:
        raise _Bad(f"{what}: {len(value)} values for {width} layers")
    # Fast path: what encode_record writes is floats and nulls, and a long trace holds
    # millions of them (per layer per step): type() over the list runs in C, while the
    # general path below costs a call and an error label per element.
    if set(map(type, value)) <= _PLAIN_FLOATS:
        return tuple(value)
    return tuple(None if v is None else _as_float(v, f"{what}[{i}]") for i, v in enumerate(value))


def _float_map(value: Any, what: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise _Bad(f"{what}: expected an object of numbers")
    return {str(k): _as_float(v, f"{what}.{k}") for k, v in value.items()}


def _header(obj: Any) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("type") != "header":
        raise _Bad('the first line must be the header {"type": "header", "version": 1, ...}')
    version = obj.get("version")
    if version != TRACE_VERSION:
        raise _Bad(
            f"unsupported trace version {version!r}; this gradwatch reads version {TRACE_VERSION}"
        )
    world, shards = obj.get("world"), obj.get("shards")
    if (world is None) != (shards is None):
        raise _Bad("world and shards come together in a header, or neither")
    if world is not None:
        world, shards = _int(obj, "world"), _int(obj, "shards")
        if not 1 <= shards <= world or world % shards:
            raise _Bad(f"shards {shards} must divide world {world}")
    layers = _names(obj.get("layers", []), "layers")
    roles: tuple[str, ...] = ()
    if obj.get("layer_roles") is not None:
        try:
            roles = roles_of(obj["layer_roles"], len(layers))
        except CensusError as exc:
            raise _Bad(str(exc)) from None
    return TraceHeader(
        job=_str(obj, "job"),
        layers=layers,
        dtype_max=_float(obj, "dtype_max"),
        world=world,
        shards=shards,
        layer_roles=roles,
    )


def _common(obj: Mapping[str, Any]) -> tuple[int, int, float | None]:
    return _int(obj, "step"), _int(obj, "rank", 0), _float(obj, "time")


def _layers(
    obj: Mapping[str, Any], header: TraceHeader
) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    if "layers" in obj:
        own = _names(obj["layers"], "layers")
        return own, own
    return header.layers, None


def _step(obj: Mapping[str, Any], header: TraceHeader) -> list[TraceRecord]:
    step, rank, time = _common(obj)
    names, own = _layers(obj, header)
    lr_raw = obj.get("lr")
    if lr_raw is None:
        lr: tuple[float, ...] = ()
    elif isinstance(lr_raw, list):
        lr = tuple(_as_float(v, f"lr[{i}]") for i, v in enumerate(lr_raw))
    else:
        lr = (_as_float(lr_raw, "lr"),)
    skipped = obj.get("skipped", False)
    if not isinstance(skipped, bool):
        raise _Bad(f"skipped: expected true or false, got {skipped!r:.40}")
    norms = obj.get("layer_grad_norms")
    out: list[TraceRecord] = [
        TraceStep(
            step=step,
            rank=rank,
            time=time,
            loss=_float(obj, "loss"),
            lr=lr,
            grad_norm=_float(obj, "grad_norm"),
            layers=own,
            layer_grad_norms=()
            if norms is None
            else _float_list(norms, "layer_grad_norms", len(names)),
            loss_scale=_float(obj, "loss_scale"),
            skipped=skipped,
            scalars=_float_map(obj.get("scalars", {}), "scalars"),
        )
    ]
    # DESIGN's folded form: cadence statistics on the step line itself.
    if any(k in obj for k in ("layer_weight_norms", "update_ratios", "act", "census")):
        out.append(_stats(obj, header))
    return out


def _stats(obj: Mapping[str, Any], header: TraceHeader) -> TraceStats:
    step, rank, time = _common(obj)
    names, own = _layers(obj, header)
    weights = obj.get("layer_weight_norms")
    ratios = obj.get("update_ratios")
    return TraceStats(
        step=step,
        rank=rank,
        time=time,
        layers=own,
        layer_weight_norms=None
        if weights is None
        else _float_list(weights, "layer_weight_norms", len(names)),
        update_ratios=None if ratios is None else _float_list(ratios, "update_ratios", len(names)),
        act=_acts(obj.get("act", {})),
        census=_census(obj.get("census")),
    )


def _census(value: Any) -> Census | None:
    if value is None:
        return None
    try:
        return census_of(value)
    except CensusError as exc:
        raise _Bad(str(exc)) from None


def _acts(value: Any) -> tuple[TraceAct, ...]:
    if not isinstance(value, dict):
        raise _Bad("act: expected an object of module -> {kind, mean, std, zero_frac?, sat_frac?}")
    acts = []
    for module, body in value.items():
        if not isinstance(body, dict):
            raise _Bad(f"act.{module}: expected an object")
        kind = body.get("kind", "other")
        if not isinstance(kind, str):
            raise _Bad(f"act.{module}.kind: expected a string")
        mean, std = _float(body, "mean"), _float(body, "std")
        acts.append(
            TraceAct(
                module=str(module),
                kind=kind,
                mean=math.nan if mean is None else mean,
                std=math.nan if std is None else std,
                zero_frac=_fraction(body, "zero_frac", module),
                sat_frac=_fraction(body, "sat_frac", module),
            )
        )
    return tuple(acts)


def _fraction(body: Mapping[str, Any], key: str, module: str) -> float | None:
    value = _float(body, key)
    if value is not None and not 0.0 <= value <= 1.0:
        raise _Bad(f"act.{module}.{key}: expected a fraction from 0 to 1, got {value!r}")
    return value


def _eval(obj: Mapping[str, Any]) -> TraceEval:
    step, rank, time = _common(obj)
    modules = obj.get("train_mode_modules", [])
    return TraceEval(
        step=step,
        rank=rank,
        time=time,
        loss=_float(obj, "loss"),
        metrics=_float_map(obj.get("metrics", {}), "metrics"),
        train_mode_modules=_names(modules, "train_mode_modules"),
    )


def _event(obj: Mapping[str, Any]) -> TraceEvent:
    step, rank, time = _common(obj)
    fields = {k: v for k, v in obj.items() if k not in ("type", "step", "rank", "time", "kind")}
    return TraceEvent(step=step, kind=_str(obj, "kind"), rank=rank, time=time, fields=fields)


def _heartbeat(obj: Mapping[str, Any]) -> TraceHeartbeat:
    time = _float(obj, "time", required=True)
    assert time is not None
    started = _int(obj, "started") if obj.get("started") is not None else None
    return TraceHeartbeat(
        rank=_int(obj, "rank", 0), time=time, step=_int(obj, "step"), started=started
    )


def decode_record(obj: Any, header: TraceHeader) -> list[TraceRecord]:
    """Records of one parsed line (a folded step line gives a step and a stats record)."""
    if not isinstance(obj, dict):
        raise _Bad("expected a JSON object")
    kind = obj.get("type")
    if kind == "step":
        return _step(obj, header)
    if kind == "stats":
        return [_stats(obj, header)]
    if kind == "eval":
        return [_eval(obj)]
    if kind == "event":
        return [_event(obj)]
    if kind == "heartbeat":
        return [_heartbeat(obj)]
    if kind == "header":
        raise _Bad("a second header: one trace file holds one job")
    raise _Bad(
        f"type: unknown record type {kind!r}; expected step, stats, eval, event or heartbeat"
    )


class TraceReader:
    """Reads a trace line by line, validating every line.

    ``strict=True``: the first bad line raises :class:`TraceError` naming its
    line number. ``strict=False``: bad lines are skipped and counted
    (``skipped``), the first ``MAX_PROBLEMS_KEPT`` kept in ``problems``. A bad
    or missing header always raises: without it no line can be read.

    Example::

        with open("run-42.jsonl", encoding="utf-8") as f:
            reader = TraceReader(f, strict=False, source="run-42.jsonl")
            records = list(reader)
        print(reader.header.job, reader.skipped)
    """

    def __init__(
        self, lines: Iterable[str], *, strict: bool = True, source: str = "<trace>"
    ) -> None:
        self._lines = iter(lines)
        self.strict = strict
        self.source = source
        self.problems: list[tuple[int, str]] = []
        self.skipped = 0
        self.lineno = 0
        self._header: TraceHeader | None = None

    @property
    def header(self) -> TraceHeader:
        """The header line (read on first use)."""
        if self._header is None:
            self._header = self._read_header()
        return self._header

    def __iter__(self) -> Iterator[TraceRecord]:
        header = self.header
        for text in self._lines:
            self.lineno += 1
            if not text.strip():
                continue
            try:
                records = decode_record(self._parse(text), header)
            except _Bad as exc:
                self._problem(str(exc))
                continue
            yield from records

    def _read_header(self) -> TraceHeader:
        for text in self._lines:
            self.lineno += 1
            if not text.strip():
                continue
            try:
                return _header(self._parse(text))
            except _Bad as exc:
                raise TraceError([(self.lineno, str(exc))], self.source) from None
        raise TraceError(
            [(max(self.lineno, 1), "the trace is empty; expected a header line")], self.source
        )

    @staticmethod
    def _parse(text: str) -> Any:
        if len(text) > MAX_LINE_CHARS:
            raise _Bad(f"line longer than {MAX_LINE_CHARS} characters")
        try:
            return json.loads(text)
        except ValueError as exc:
            raise _Bad(f"not valid JSON: {exc}") from None
        except RecursionError:
            raise _Bad("JSON nested too deeply to read") from None

    def _problem(self, message: str) -> None:
        if self.strict:
            raise TraceError([(self.lineno, message)], self.source)
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append((self.lineno, message))


def validate_trace(lines: Iterable[str], source: str = "<trace>") -> TraceHeader:
    """Check every line; raise one :class:`TraceError` listing every bad line.

    Returns the header when no line is bad.
    """
    reader = TraceReader(lines, strict=False, source=source)
    for _ in reader:
        pass
    if reader.skipped:
        raise TraceError(reader.problems, source, total=reader.skipped)
    return reader.header
