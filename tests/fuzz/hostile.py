"""Hypothesis strategies for hostile input, shared by the fuzz tests.

Example::

    from tests.fuzz.hostile import json_values
    value = json_values.example()
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Values that break naive parsers: wrong types, floats beyond range, NaN spelled
# every way, numbers at the edges of int64/float64, control characters, lone
# surrogates, and containers.
huge_ints = st.sampled_from(
    [2**31, 2**62, 2**63, 2**64, -(2**63) - 1, 10**308, 10**400, -(10**400)]
)
edge_floats = st.sampled_from(
    [0.0, -0.0, 1e-320, 1.7976931348623157e308, float("nan"), float("inf"), float("-inf")]
)
nasty_strings = st.sampled_from(
    [
        "",
        "nan",
        "NaN",
        "inf",
        "-Infinity",
        "\x00",
        "a\nb",
        "\x1b[2J",
        "\ud800",
        "\ufeff",
        "😀" * 40,
        "x" * 5000,
        "1e999",
        "0x10",
    ]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    huge_ints,
    st.floats(),
    edge_floats,
    st.text(max_size=20),
    nasty_strings,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    """``depth`` nested JSON containers as text (deep enough to hit the recursion limit)."""
    return open_ * depth + close * depth


def laughs(levels: int = 9) -> str:
    """A YAML billion-laughs bomb: anchor ``l{levels}`` stands for 9**levels strings."""
    out = ['lol0: &l0 "lol"']
    out += [f"lol{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels + 1)]
    return "\n".join(out) + "\n"


def dumps(value: Any) -> str:
    """JSON with NaN/Infinity literals allowed: those are hostile input too."""
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


@st.composite
def mutated_object(draw: st.DrawFn, valid: dict[str, Any]) -> dict[str, Any]:
    """``valid`` with keys deleted, retyped or added: one to four edits."""
    body = dict(valid)
    for _ in range(draw(st.integers(1, 4))):
        keys = sorted(body)
        op = draw(st.sampled_from(["retype", "delete", "extra", "retype"]))
        if op == "delete" and keys:
            del body[draw(st.sampled_from(keys))]
        elif op == "retype" and keys:
            body[draw(st.sampled_from(keys))] = draw(json_values)
        else:
            body[draw(st.text(max_size=10))] = draw(json_values)
    return body
