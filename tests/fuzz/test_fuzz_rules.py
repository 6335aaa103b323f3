"""Hostile rule files: a valid rule set or RuleFileError with file:line, quickly, never a crash."""

from __future__ import annotations

import copy
import re
import time
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gradwatch.rules.rulefile import (
    RuleFileError,
    RuleSpec,
    default_rules_path,
    load_rules_text,
)
from tests.fuzz.hostile import json_values, laughs, mutated_object, nested

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFAULT_TEXT = default_rules_path().read_text(encoding="utf-8")
DEFAULT = yaml.safe_load(DEFAULT_TEXT)
LIMIT_S = 5.0  # far above the milliseconds a real rule file takes; a bomb must not get near it


def check(text: str) -> list[RuleSpec] | RuleFileError:
    """The property: specs or RuleFileError naming ``rules.yaml:LINE``, within ``LIMIT_S``."""
    start = time.monotonic()
    try:
        result: list[RuleSpec] | RuleFileError = load_rules_text(text, source="rules.yaml")
    except RuleFileError as exc:
        result = exc
        assert exc.problems and str(exc).startswith(f"{len(exc.problems)} problem")
        for line, message in exc.problems:
            assert f"rules.yaml:{line}: {message}" in str(exc)
        if _parses(text):
            # Parsed YAML has a node for everything: every problem has a real line.
            assert all(line >= 1 for line, _ in exc.problems), exc.problems
    assert time.monotonic() - start < LIMIT_S
    return result


def _parses(text: str) -> bool:
    try:
        yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        return False
    return True


def dump(data: Any) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)
    except yaml.YAMLError:
        assume(False)  # not representable as YAML (never our input)
        raise


@settings(FUZZ, max_examples=30)  # each example validates the whole pack: ~0.1 s
@given(st.data())
def test_mutations_of_the_default_pack(data: st.DataObject) -> None:
    doc = copy.deepcopy(DEFAULT)
    group = data.draw(st.sampled_from(doc["groups"]))
    rules = group["rules"]
    i = data.draw(st.integers(0, len(rules) - 1))
    target = data.draw(st.sampled_from(["rule", "params", "group", "top"]))
    if target == "rule":
        rules[i] = data.draw(mutated_object(rules[i]))
    elif target == "params":
        rules[i]["params"] = data.draw(mutated_object(rules[i].get("params") or {"x": 1}))
    elif target == "group":
        doc["groups"][doc["groups"].index(group)] = data.draw(mutated_object(group))
    else:
        doc = data.draw(mutated_object(doc))
    check(dump(doc))


@FUZZ
@given(json_values)
def test_any_yaml_document(value: Any) -> None:
    check(dump(value))


@FUZZ
@given(st.text(max_size=200))
def test_any_text(text: str) -> None:
    check(text)


@FUZZ
@given(st.integers(0, len(DEFAULT_TEXT)), st.integers(0, 40), st.text(max_size=12))
def test_spliced_default_pack(at: int, cut: int, junk: str) -> None:
    check(DEFAULT_TEXT[:at] + junk + DEFAULT_TEXT[at + cut :])


RULE = """groups:
  - name: g
    rules:
      - alert: A
        detector: nonfinite
        severity: critical
        category: numerical
"""


@pytest.mark.parametrize(
    "field",
    [
        "for",
        "keep_firing_for",
        "params",
        "labels",
        "annotations",
        "actions",
        "severity",
        "alert",
        "detector",
    ],
)
def test_billion_laughs_in_a_rule_field_is_refused_quickly(field: str) -> None:
    # Regression: `for: *bomb` took 80 s building the repr of 9**9 strings for its message.
    error = check(laughs() + RULE + f"        {field}: *l9\n")
    assert isinstance(error, RuleFileError)


@pytest.mark.parametrize(
    "where",
    [
        "groups: *l9\n",
        "groups:\n  - name: g\n    rules: *l9\n",
        "groups:\n  - *l9\n",
        "groups:\n  - name: *l9\n",
    ],
)
def test_billion_laughs_in_the_file_structure_is_refused_quickly(where: str) -> None:
    assert isinstance(check(laughs() + where), RuleFileError)


@pytest.mark.parametrize(
    "text",
    [
        "groups: &a [*a]\n",
        "groups:\n  - &g {name: g, rules: [*g]}\n",
        "groups: " + nested(600) + "\n",
        "groups: " + nested(600, "{a: ", "}") + "\n",
        RULE + "        for: 1" + "0" * 5000 + "\n",
        RULE + "        for: 1" + "0" * 400 + "\n",
        RULE + "        keep_firing_for: 99999999999999999999999999\n",
        RULE + "        for: 2024-13-45\n",
        RULE + "        params: {max_named: 1e999}\n",
        RULE + "        params: {max_named: .nan}\n",
        RULE + "        for: !!python/object:os.system x\n",
        RULE + "        ? [unhashable]\n        : key\n",
    ],
    ids=lambda text: text.splitlines()[-1][:40],
)
def test_pathological_documents(text: str) -> None:
    # Regression: deep nesting raised RecursionError and over-long integers or bad dates ValueError.
    check(text)


def test_duplicate_keys_are_reported_with_their_line() -> None:
    error = check(RULE + "        severity: warning\n")
    assert isinstance(error, RuleFileError)
    assert any(
        line == 8 and re.search("duplicate key", message) for line, message in error.problems
    )
