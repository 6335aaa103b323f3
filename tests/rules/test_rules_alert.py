"""The alert record: stable ids and strict-JSON output."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from gradwatch.rules import CATEGORIES, Alert
from gradwatch.rules.alert import alert_id


def make(**kw: object) -> Alert:
    fields: dict[str, object] = {
        "rule": "R",
        "category": "numerical",
        "severity": "critical",
        "job": "run-42",
        "state": "firing",
        "step": 41,
        "summary": "loss is nan",
        "started_at": 1.0,
        "rank": 0,
    }
    fields.update(kw)
    return Alert(**fields)  # type: ignore[arg-type]  # fields is a loose dict of valid test values


def test_seventeen_categories() -> None:
    assert len(CATEGORIES) == 17 and len(set(CATEGORIES)) == 17
    assert "loss_scale_collapse" in CATEGORIES and "agent_health" in CATEGORIES


def test_id_is_stable_per_incident_and_differs_between_incidents() -> None:
    firing = make()
    assert len(firing.id) == 16 and int(firing.id, 16) >= 0
    assert replace(firing, state="resolved", resolved_at=2.0).id == firing.id
    assert make().id == firing.id
    assert make(step=42).id != firing.id
    assert make(rank=1).id != firing.id
    assert firing.id == alert_id("run-42", "R", 0, 41)


def test_to_dict_is_strict_json_with_non_finite_floats_as_strings() -> None:
    alert = make(
        evidence={
            "loss": math.nan,
            "norm": np.float32(np.inf),
            "low": -math.inf,
            "layers": ("a", "b"),
            "arr": np.array([1.0, np.nan]),
            "n": np.int64(3),
        },
        diagnosis={"verdict": "numerical", "next_checks": ("a", "b")},
    )
    out = json.loads(json.dumps(alert.to_dict(), allow_nan=False))
    assert out["evidence"] == {
        "loss": "nan",
        "norm": "inf",
        "low": "-inf",
        "layers": ["a", "b"],
        "arr": [1.0, "nan"],
        "n": 3,
    }
    assert out["diagnosis"] == {"verdict": "numerical", "next_checks": ["a", "b"]}
    assert out["state"] == "firing" and out["step"] == 41 and out["rank"] == 0
    assert out["id"] == alert.id and out["resolved_at"] is None
    assert set(out) >= {
        "rule",
        "category",
        "severity",
        "job",
        "summary",
        "last_good_checkpoint",
        "labels",
        "annotations",
        "started_at",
    }


def test_unknown_category_or_severity_is_refused() -> None:
    with pytest.raises(ValueError, match="category"):
        make(category="vibes")
    with pytest.raises(ValueError, match="severity"):
        make(severity="page")
