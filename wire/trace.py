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
from dataclasses import dataclass, field
from typing import Any, Final

from gradwatch.wire.census import Census, CensusError, census_body, census_of, roles_of

TRACE_VERSION: Final = 1
MAX_LINE_CHARS: Final = 64 * 1024 * 1024
MAX_PROBLEMS_KEPT: Final = 100

_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf}
# The element types of a layer list that need no conversion (see _float_list).
_PLAIN_FLOATS: frozenset[type] = frozenset({float, type(None)})


class TraceError(ValueError):
    """A trace that cannot be read; ``problems`` lists ``(line, message)`` pairs."""

    def __init__(
        self, problems: Iterable[tuple[int, str]], source: str = "<trace>", total: int | None = None
    ) -> None:
        self.problems = tuple(problems)
        self.source = source
        count = len(self.problems) if total is None else total
        shown = "\n".join(f"{source}:{line}: {message}" for line, message in self.problems[:20])
        more = count - min(20, len(self.problems))
        tail = f"\n... and {more} more" if more > 0 else ""
        super().__init__(f"{count} bad line{'s' * (count != 1)} in trace {source}:\n{shown}{tail}")


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """First line of every trace: the job and the layer names per-layer lists align with."""

    job: str
    layers: tuple[str, ...] = ()
    version: int = TRACE_VERSION
    dtype_max: float | None = None
    # A multi-rank job's declared topology (docs/wire.md ``shards``): replay
    # assembles its ranks' steps as the collector did. None: judged per rank.
    world: int | None = None
    shards: int | None = None
    # Each header layer's role (gradwatch.wire.census.ROLES); () = unknown.
    layer_roles: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One optimizer step of one rank. ``layers`` overrides the header's names when set."""

    step: int
    rank: int = 0
    time: float | None = None
    loss: float | None = None
    lr: tuple[float, ...] = ()
    grad_norm: float | None = None
    layer_grad_norms: tuple[float | None, ...] = ()
    layers: tuple[str, ...] | None = None
    loss_scale: float | None = None
    skipped: bool = False
    scalars: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TraceAct:
    """Forward-activation statistics of one module (see ``gradwatch.rules.step.ActStats``)."""

    module: str
    kind: str = "other"
    mean: float = math.nan
    std: float = math.nan
    zero_frac: float | None = None
    sat_frac: float | None = None


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Cadence statistics: weight norms, update ratios, activations."""

    step: int
    rank: int = 0
    time: float | None = None
    layers: tuple[str, ...] | None = None
    layer_weight_norms: tuple[float | None, ...] | None = None
    update_ratios: tuple[float | None, ...] | None = None
    act: tuple[TraceAct, ...] = ()
    census: Census | None = None  # the model census sent with this sample, if any


@dataclass(frozen=True, slots=True)
class TraceEval:
    """An evaluation: its loss, other metrics, and modules left in training mode."""

    step: int
    rank: int = 0
    time: float | None = None
    loss: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    train_mode_modules: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """Anything else that happened at a step: ``kind`` "checkpoint" (field ``path``), "note"..."""

    step: int
    kind: str
    rank: int = 0
    time: float | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TraceHeartbeat:
    """A rank said it is alive at ``time``, at step ``step``."""

    rank: int
    time: float
    step: int
    started: int | None = None  # the step whose forward had begun (wire Heartbeat.started)


TraceRecord = TraceHeader | TraceStep | TraceStats | TraceEval | TraceEvent | TraceHeartbeat


# ---------------------------------------------------------------- encoding


def _num(x: float) -> float | str:
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _nums(values: Iterable[float | None]) -> list[float | str | None]:
    return [None if v is None else _num(v) for v in values]


def _put(body: dict[str, Any], key: str, value: float | None) -> None:
    if value is not None:
        body[key] = _num(value)


def _stats_body(rec: TraceStats, body: dict[str, Any]) -> None:
    if rec.layers is not None:
        body["layers"] = list(rec.layers)
    if rec.layer_weight_norms is not None:
        body["layer_weight_norms"] = _nums(rec.layer_weight_norms)
    if rec.update_ratios is not None:
        body["update_ratios"] = _nums(rec.update_ratios)
    if rec.act:
        body["act"] = {a.module: _act_body(a) for a in rec.act}
    if rec.census is not None:
        body["census"] = census_body(rec.census)


def _act_body(a: TraceAct) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": a.kind, "mean": _num(a.mean), "std": _num(a.std)}
    _put(out, "zero_frac", a.zero_frac)
    _put(out, "sat_frac", a.sat_frac)
    return out


def record_body(rec: TraceRecord) -> dict[str, Any]:
    """The JSON object of one record (what :func:`encode_record` serialises)."""
    if isinstance(rec, TraceHeader):
        body: dict[str, Any] = {
            "type": "header",
            "version": rec.version,
            "job": rec.job,
            "layers": list(rec.layers),
        }
        _put(body, "dtype_max", rec.dtype_max)
        if rec.world is not None and rec.shards is not None:
            body["world"], body["shards"] = rec.world, rec.shards
        if rec.layer_roles:
            body["layer_roles"] = list(rec.layer_roles)
        return body
    if isinstance(rec, TraceHeartbeat):
        beat = {"type": "heartbeat", "rank": rec.rank, "time": _num(rec.time), "step": rec.step}
        if rec.started is not None:
            beat["started"] = rec.started
        return beat
    body = {"type": _TYPE_OF[type(rec)], "step": rec.step, "rank": rec.rank}
    _put(body, "time", rec.time)
    if isinstance(rec, TraceStep):
        _step_body(rec, body)
    elif isinstance(rec, TraceStats):
        _stats_body(rec, body)
    elif isinstance(rec, TraceEval):
        _put(body, "loss", rec.loss)
        if rec.metrics:
            body["metrics"] = {k: _num(v) for k, v in rec.metrics.items()}
        if rec.train_mode_modules:
            body["train_mode_modules"] = list(rec.train_mode_modules)
    else:
        body["kind"] = rec.kind
        for key, value in rec.fields.items():
            if key not in body:
                body[key] = value
    return body


def _step_body(rec: TraceStep, body: dict[str, Any]) -> None:
    _put(body, "loss", rec.loss)
    if len(rec.lr) == 1:
        body["lr"] = _num(rec.lr[0])
    elif rec.lr:
        body["lr"] = _nums(rec.lr)
    _put(body, "grad_norm", rec.grad_norm)
    if rec.layers is not None:
        body["layers"] = list(rec.layers)
    if rec.layer_grad_norms:
        body["layer_grad_norms"] = _nums(rec.layer_grad_norms)
    _put(body, "loss_scale", rec.loss_scale)
    if rec.skipped:
        body["skipped"] = True
    if rec.scalars:
        body["scalars"] = {k: _num(v) for k, v in rec.scalars.items()}


_TYPE_OF: dict[type, str] = {
    TraceStep: "step",
    TraceStats: "stats",
    TraceEval: "eval",
    TraceEvent: "event",
}


def encode_record(rec: TraceRecord) -> str:
    """One trace line (without the newline); always strict JSON."""
    return json.dumps(record_body(rec), separators=(",", ":"), allow_nan=False, ensure_ascii=False)


# ---------------------------------------------------------------- decoding


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
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Bad(f"{key}: expected a whole number >= 0, got {value!r:.40}")
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
