"""The checks every field of a wire header passes before a message is built from it.

A header is JSON from a sender that may be broken or hostile: each field is read
with its type, its bounds and (numbers) finiteness checked, and anything else
raises :class:`WireError`, which the collector counts and logs with the sender;
nothing past the message is lost (wire/messages.py decodes with these).

Example::

    >>> from gradwatch.wire.fields import WireError, int_field
    >>> int_field({"rank": 3}, "rank", 0, 7)
    3
    >>> try:
    ...     int_field({"rank": True}, "rank", 0, 7)
    ... except WireError as exc:
    ...     print(exc)
    field 'rank' must be an integer in [0, 7], got True
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from typing import Any, Final

MAX_NAME_CHARS: Final = 1024
MAX_JOB_CHARS: Final = 128
MAX_RANK: Final = 1 << 20
# Step numbers (and counts) on the wire, in traces and in imported logs: below 2**62, so
# they fit the int64 arrays the rules keep them in, with room to add to them.
MAX_STEP: Final = 1 << 62

_FLOAT_MAX_INT: Final = int(sys.float_info.max)
_INT = frozenset({int})
_FLOAT = frozenset({float})


class WireError(ValueError):
    """A message that is not valid gradwatch wire v1.

    The collector counts these and drops the message; nothing else is lost.
    """


class WireVersionError(WireError):
    """A message of a wire version this build does not speak."""


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"{what} is not UTF-8 JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise WireError(f"{what} must be a JSON object")
    return body


def int_field(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise WireError(f"field {key!r} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def optional_int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    # Fields added within wire v1 are optional: older agents do not send them.
    return None if body.get(key) is None else int_field(body, key, lo, hi)


def float_field(body: Mapping[str, Any], key: str) -> float:
    value = body.get(key)
    # bool is an int subclass, and JSON's true/false are not numbers here.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value):
        raise WireError(f"field {key!r} must be a finite number, got {value!r:.40}")
    return float(value)


def is_finite(value: float) -> bool:
    # A JSON integer beyond float range would make isfinite() raise OverflowError.
    return math.isfinite(value) if type(value) is float else abs(value) <= _FLOAT_MAX_INT


def str_field(body: Mapping[str, Any], key: str, max_chars: int) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise WireError(f"field {key!r} must be a string of 1 to {max_chars} characters")
    return value


def job_field(body: Mapping[str, Any]) -> str:
    job = str_field(body, "job", MAX_JOB_CHARS)
    if not job.isprintable():
        raise WireError("field 'job' must be printable")
    return job


def world_field(body: Mapping[str, Any]) -> int:
    world = int_field(body, "world", 1, MAX_RANK + 1)
    rank = body.get("rank")
    if type(rank) is int and rank >= world:
        raise WireError(f"rank {rank} is outside a world of {world}")
    return world


def int_list(body: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = body.get(key)
    # The same test as per element, with the loops in C (every batch has two lists).
    if (
        not isinstance(value, list)
        or not set(map(type, value)) <= _INT
        or (value and not (min(value) >= 0 and max(value) < MAX_STEP))
    ):
        raise WireError(f"field {key!r} must be a list of non-negative integers")
    return tuple(value)


def float_list(body: Mapping[str, Any], key: str) -> tuple[float, ...]:
    value = body.get(key)
    if isinstance(value, list) and set(map(type, value)) <= _FLOAT:
        if all(map(math.isfinite, value)):
            return tuple(value)  # floats already: float(v) is v
    elif isinstance(value, list) and not any(
        type(v) not in (int, float) or not is_finite(v) for v in value
    ):
        return tuple(float(v) for v in value)
    raise WireError(f"field {key!r} must be a list of finite numbers")


def names_field(body: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if not isinstance(value, list) or any(
        not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_CHARS for v in value
    ):
        raise WireError(f"schema {key!r} must be a list of names of 1 to {MAX_NAME_CHARS} chars")
    return tuple(value)
