"""``build_step``, the collector's cheap ``Step`` constructor (issue 17), builds the same Step.

A frozen dataclass costs ~4 us per instance; the collector builds one per rank
per step. ``build_step`` must give an object indistinguishable from ``Step(...)``:
same class, same fields, equal, frozen, usable with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from gradwatch.rules.step import FLOAT32_MAX, Step, build_step

# Every field build_step takes, none at its default (so a field it forgot to set shows).
ARGS: dict[str, Any] = {
    "job": "j",
    "step": 7,
    "time": 1.7e9,
    "rank": 5,
    "loss": 2.5,
    "grad_norm": 1.25,
    "layers": ("a", "b"),
    "layer_norms": np.array([3.0, 4.0]),
    "lr": (1e-4, 2e-4),
    "loss_scale": 1024.0,
    "skipped": True,
    "scalars": {"grad_nonfinite": 0.0},
    "dtype_max": 65504.0,
    "grad_norm_logged": True,
    "world": 16384,
    "shards": 8,
    "layer_roles": ("weight", "bias"),
}


def test_build_step_equals_the_dataclass_constructor() -> None:
    built, plain = build_step(**ARGS), Step(**ARGS)
    assert type(built) is Step
    assert built == plain
    assert repr(built) == repr(plain)
    # assembled and blame: the dataclass defaults, a fresh dict per step.
    assert built.assembled == 0 and built.blame == {}
    assert build_step(**ARGS).blame is not built.blame
    for f in dataclasses.fields(Step):
        assert getattr(built, f.name) is getattr(plain, f.name) or f.name in (
            "blame",
            "layer_norms",
        )


def test_a_built_step_is_as_frozen_as_any() -> None:
    built = build_step(**ARGS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.loss = 1.0  # type: ignore[misc]  # the point: assigning must fail
    with pytest.raises(dataclasses.FrozenInstanceError):
        del built.rank  # type: ignore[misc]  # same for deleting
    changed = dataclasses.replace(built, loss=None, assembled=3)
    assert changed.loss is None and changed.assembled == 3 and built.loss == 2.5
    assert changed != built


def test_differs_where_the_fields_differ() -> None:
    base = build_step(**ARGS)
    for name, other in (("rank", 6), ("dtype_max", FLOAT32_MAX), ("layer_roles", ())):
        assert build_step(**{**ARGS, name: other}) != base
