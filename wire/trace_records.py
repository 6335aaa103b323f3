"""gradwatch trace format v1: the records and how each is written (spec: docs/trace.md).

Reading a trace back is :mod:`gradwatch.wire.trace`, which also exports everything
here. Stdlib only. Non-finite floats are written as the strings ``"nan"``, ``"inf"``,
``"-inf"`` (JSON has none); a missing field means "not measured", never zero.

Example::

    line = encode_record(TraceStep(step=1, loss=2.3, layer_grad_norms=(0.5, float("nan"))))
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gradwatch.wire.census import Census, census_body

TRACE_VERSION: Final = 1


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
