"""Rule files: the default pack, and every problem reported with its file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradwatch.rules import (
    CATEGORIES,
    RuleFileError,
    default_rules_path,
    detector_names,
    load_default_rules,
    load_rules,
    load_rules_text,
)
from gradwatch.rules.detector import Detector

GOOD = """\
groups:
  - name: numerical
    rules:
      - alert: NaNs
        detector: nonfinite
        for: 1
        severity: critical
        category: numerical
        labels: {team: ml}
        annotations: {summary: "nan", diagnosis: "numerical", next_checks: "a; b"}
      - alert: Growth
        detector: growth
        params: {window: 32, min_factor: 1.05}
        for: 5m
        keep_firing_for: 3
        severity: warning
        category: exploding_gradients
"""

# Line numbers matter below: keep this text as it is.
BAD = """\
groups:
  - name: g
    rules:
      - alert: A
        detector: nonfinite
        severity: critical
        category: numerical
      - alert: B
        detector: growth
        params: {window: 2, typo: 1}
        severity: warning
        category: exploding_gradients
      - alert: C
        detector: nonfinite
        severity: loud
        category: numerical
        for: soon
      - alert: A
        detector: nosuch
        severity: info
        category: vibes
      - detector: ratio
        severity: info
        category: numerical
        actions: [reboot]
"""


def test_default_pack_loads_and_builds_detectors() -> None:
    rules = load_default_rules()
    names = [r.name for r in rules]
    assert names[:2] == ["NonFiniteGradients", "GradientNormGrowingGeometrically"]
    assert {"LayerGradNormRatioVanishing", "LayerGradNormRatioExploding"} <= set(names)
    assert len(set(names)) == len(names)
    for rule in rules:
        assert rule.detector in detector_names()
        assert rule.category in CATEGORIES
        assert isinstance(rule.make_detector(), Detector)
        assert {"summary", "diagnosis", "next_checks"} <= set(rule.annotations)
        assert rule.source.startswith(str(default_rules_path()))
    nonfinite = rules[0]
    assert (nonfinite.severity, nonfinite.category, nonfinite.for_steps) == (
        "critical",
        "numerical",
        1,
    )
    assert default_rules_path().name == "default.yaml"


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(GOOD)
    nans, growth = load_rules(path)
    assert nans.for_steps == 1 and nans.for_seconds is None
    assert dict(nans.labels) == {"team": "ml"}
    assert nans.actions == ("notify",)
    assert nans.group == "numerical"
    assert nans.source == f"{path}:4"
    assert growth.for_seconds == 300.0
    assert growth.keep_firing_for == 3
    detector = growth.make_detector()
    assert (detector.window, detector.min_factor, detector.min_r2) == (32, 1.05, 0.9)


def test_every_problem_is_reported_with_its_line() -> None:
    with pytest.raises(RuleFileError) as info:
        load_rules_text(BAD, source="rules.yaml")
    message = str(info.value)
    expected = [
        "rules.yaml:10: groups[0].rules[1].params.window: "
        "Input should be greater than or equal to 6",
        "rules.yaml:10: groups[0].rules[1].params.typo: Extra inputs are not permitted",
        "rules.yaml:15: groups[0].rules[2].severity: "
        "Input should be 'info', 'warning' or 'critical'",
        "rules.yaml:17: groups[0].rules[2].for: "
        "for must be a whole number of observations (e.g. 5) or a duration "
        "such as '30s', '5m', '1h30m'; got 'soon'",
        "rules.yaml:18: groups[0].rules[3].alert: duplicate rule name 'A' (first at line 4)",
        f"rules.yaml:19: groups[0].rules[3].detector: unknown detector 'nosuch'; known detectors: "
        f"{', '.join(detector_names())}",
        "rules.yaml:21: groups[0].rules[3].category: Input should be 'numerical'",
        "rules.yaml:22: groups[0].rules[4].alert: Field required",
        "rules.yaml:25: groups[0].rules[4].actions[0]: "
        "Input should be 'notify', 'rollback' or 'stop'",
    ]
    for line in expected:
        assert line in message, f"missing {line!r} in\n{message}"
    assert message.startswith("9 problems in rule file rules.yaml:")
    lines = [line for line, _ in info.value.problems]
    assert lines == sorted(lines)
    assert isinstance(info.value, ValueError)


def test_params_of_the_wrong_type_are_errors() -> None:
    text = GOOD.replace("{window: 32, min_factor: 1.05}", '{window: "32", min_factor: true}')
    with pytest.raises(RuleFileError) as info:
        load_rules_text(text, source="r.yaml")
    assert "r.yaml:13: groups[0].rules[1].params.window: Input should be a valid integer" in str(
        info.value
    )
    assert "r.yaml:13: groups[0].rules[1].params.min_factor: Input should be a valid number" in str(
        info.value
    )


def test_yaml_syntax_errors_and_empty_files() -> None:
    with pytest.raises(
        RuleFileError, match=r"^1 problem in rule file x.yaml:\nx.yaml:3: not valid YAML"
    ):
        load_rules_text("groups:\n  - name: a\n  rules: [\n", source="x.yaml")
    with pytest.raises(RuleFileError, match="x.yaml:1: the file is empty"):
        load_rules_text("# nothing\n", source="x.yaml")
    with pytest.raises(RuleFileError, match="x.yaml:1: Input should be a valid dictionary"):
        load_rules_text("- 1\n", source="x.yaml")


def test_duplicate_yaml_keys_are_errors() -> None:
    text = GOOD.replace("        for: 1\n", "        for: 1\n        for: 2\n")
    with pytest.raises(
        RuleFileError, match=r"<string>:7: groups\[0\]\.rules\[0\]\.for: duplicate key"
    ):
        load_rules_text(text)


def test_bad_label_names_and_negative_for() -> None:
    text = GOOD.replace("{team: ml}", "{bad-name: ml}").replace("for: 1\n", "for: -1\n")
    with pytest.raises(RuleFileError) as info:
        load_rules_text(text)
    message = str(info.value)
    assert "<string>:6: groups[0].rules[0].for: for must be" in message
    assert (
        "<string>:9: groups[0].rules[0].labels.bad-name (key): String should match pattern"
        in message
    )


def test_unreadable_file_is_a_rule_file_error(tmp_path: Path) -> None:
    with pytest.raises(RuleFileError, match="cannot read rule file"):
        load_rules(tmp_path / "missing.yaml")


def test_recursive_and_aliased_yaml_is_rejected_not_hung() -> None:
    with pytest.raises(RuleFileError):
        load_rules_text("groups: &g [*g]\n")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} "
        f"[*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(12)
    )
    with pytest.raises(RuleFileError, match="groups"):
        load_rules_text(bomb)
