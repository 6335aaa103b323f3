"""Rule files: YAML in the spirit of Prometheus alerting rules, validated by pydantic.

A rule file is data that crosses a trust boundary, so every problem in it is
reported at once, each with its file and line, in one :class:`RuleFileError`::

    rules.yaml:14: groups[0].rules[2].severity: Input should be 'info', 'warning' or 'critical'

Example::

    rules = load_rules("rules.yaml")          # or load_default_rules()
    detector = rules[0].make_detector()

File shape::

    groups:
      - name: numerical
        rules:
          - alert: NonFiniteGradients     # unique name
            detector: nonfinite           # see registry.detector_names()
            params: {}                    # the detector's keyword args
            for: 1                        # observations of its signal (int) or a duration ("30s")
            keep_firing_for: 0            # observations
            severity: critical
            category: numerical
            actions: [notify]
            inhibits: []                  # rules this one explains: not paged while it fires
            labels: {team: ml}
            annotations: {summary: ..., diagnosis: ..., next_checks: ...}
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationError,
    field_validator,
)

from gradwatch.rules import registry
from gradwatch.rules.alert import Category, Severity
from gradwatch.rules.detector import Detector
from gradwatch.rules.lifecycle import parse_duration

# What a firing rule triggers; the collector carries out rollback (signed agent
# commands, gradwatch.collector.actions); stop is accepted but not acted on yet.
Action = Literal["notify", "rollback", "stop"]
Loc = tuple[str | int, ...]
_Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
_FOR_HELP = (
    "for must be a whole number of observations (e.g. 5) or a duration such as '30s', '5m', '1h30m'"
)


class RuleFileError(ValueError):
    """A rule file that cannot be used; ``problems`` lists every (source, line, message)."""

    def __init__(self, source: str, problems: list[tuple[int, str]]) -> None:
        self.source = source
        self.problems = tuple(sorted(problems))
        lines = [f"{source}:{line}: {message}" for line, message in self.problems]
        count = len(lines)
        super().__init__(
            f"{count} problem{'s' * (count != 1)} in rule file {source}:\n" + "\n".join(lines)
        )


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RuleModel(_Model):
    """One rule as written in the file."""

    alert: _Name
    detector: str
    params: dict[str, Any] = Field(default_factory=dict)
    for_: int | str = Field(default=1, alias="for")
    keep_firing_for: Annotated[int, Strict(), Field(ge=0)] = 0
    severity: Severity
    category: Category
    actions: tuple[Action, ...] = ("notify",)
    # Rules whose alerts this one explains: while it fires on a job, the collector's own
    # sinks do not page that job's new firings of them (their alerts still open, are
    # recorded and exported); Alertmanager does the same with inhibit_rules.
    inhibits: tuple[_Name, ...] = ()
    labels: dict[_Name, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("for_", mode="before")
    @classmethod
    def _check_for(cls, value: Any) -> Any:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, str))
            or isinstance(value, int)
            and value < 0
        ):
            raise ValueError(f"{_FOR_HELP}; got {reprlib.repr(value)}")
        if isinstance(value, str):
            try:
                parse_duration(value)
            except ValueError:
                raise ValueError(f"{_FOR_HELP}; got {reprlib.repr(value)}") from None
        return value


class GroupModel(_Model):
    """A named list of rules."""

    name: Annotated[str, StringConstraints(min_length=1)]
    rules: list[RuleModel] = Field(default_factory=list)


class RuleFileModel(_Model):
    """The whole file."""

    groups: list[GroupModel]


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """A validated rule, ready for the engine; ``make_detector()`` builds a fresh detector."""

    name: str
    detector: str
    severity: Severity
    category: Category
    group: str = ""
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    for_steps: int = 1
    for_seconds: float | None = None
    keep_firing_for: int = 0
    actions: tuple[str, ...] = ("notify",)
    inhibits: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""

    def make_detector(self) -> Detector:
        """A new detector with this rule's params (one per job, rank and rule)."""
        return registry.make_detector(self.detector, self.params)


def load_rules(path: str | Path) -> list[RuleSpec]:
    """Load and validate the rule file at ``path``; raise :class:`RuleFileError` on any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RuleFileError(str(path), [(0, f"cannot read rule file: {exc}")]) from exc
    return load_rules_text(text, source=str(path))


def load_rules_text(text: str, source: str = "<string>") -> list[RuleSpec]:
    """Validate rule-file ``text``; ``source`` names it in error messages."""
    try:
        node, data = _parse(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise RuleFileError(source, [(line, f"not valid YAML: {exc}")]) from exc
    except RecursionError as exc:
        message = "YAML nested too deeply to read; a rule file needs only a few levels"
        raise RuleFileError(source, [(0, message)]) from exc
    except ValueError as exc:  # a date like 2024-13-45, an integer of over 4300 digits
        message = f"cannot read a value ({exc}); fix it or quote it to make it a string"
        raise RuleFileError(source, [(0, message)]) from exc
    if node is None:
        raise RuleFileError(source, [(1, "the file is empty; expected a mapping with 'groups'")])
    lines, problems = _line_map(node)
    model: RuleFileModel | None = None
    try:
        model = RuleFileModel.model_validate(data)
    except ValidationError as exc:
        problems += [_problem(lines, tuple(e["loc"]), _message(e)) for e in exc.errors()]
    problems += _check_rules(data, lines)
    if problems or model is None:
        raise RuleFileError(source, sorted(set(problems)))
    return [
        _spec(g, r, source, lines, (gi, ri))
        for gi, g in enumerate(model.groups)
        for ri, r in enumerate(g.rules)
    ]


def default_rules_path() -> Path:
    """Path of the rule pack shipped with gradwatch (``default.yaml``)."""
    # gradwatch is installed as plain files (never zipped), so the resource is a real path.
    return Path(str(files("gradwatch.rules").joinpath("default.yaml")))


def load_default_rules() -> list[RuleSpec]:
    """The rules in the shipped ``default.yaml``."""
    return load_rules(default_rules_path())


def _parse(text: str) -> tuple[yaml.Node | None, Any]:
    # One pass: compose the node tree (it carries line numbers), then build the data from it.
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return node, data


def _line_map(root: yaml.Node) -> tuple[dict[Loc, int], list[tuple[int, str]]]:
    """Line of every mapping key and sequence item, by path; plus duplicate-key problems."""
    lines: dict[Loc, int] = {(): root.start_mark.line + 1}
    problems: list[tuple[int, str]] = []
    stack: list[tuple[yaml.Node, Loc]] = [(root, ())]
    visited: set[int] = set()
    while stack:
        node, loc = stack.pop()
        # Aliases share nodes: visiting each once defeats cycles and alias bombs.
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                line = key_node.start_mark.line + 1
                if key in seen:
                    problems.append(
                        (
                            line,
                            f"{_path(loc + (key,))}: duplicate key (YAML keeps only the last one)",
                        )
                    )
                seen.add(key)
                lines[loc + (key,)] = line
                stack.append((value_node, loc + (key,)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[loc + (i,)] = item.start_mark.line + 1
                stack.append((item, loc + (i,)))
    return lines, problems


def _check_rules(data: Any, lines: dict[Loc, int]) -> list[tuple[int, str]]:
    """Problems pydantic cannot see: unique names, known detectors, valid detector params.

    Walks the raw data rather than the model, so these are reported even when
    other parts of the file failed validation.
    """
    problems: list[tuple[int, str]] = []
    first_seen: dict[str, Loc] = {}
    for gi, group in enumerate(_list(_get(data, "groups"))):
        for ri, rule in enumerate(_list(_get(group, "rules"))):
            loc: Loc = ("groups", gi, "rules", ri)
            name = _get(rule, "alert")
            if isinstance(name, str):
                if name in first_seen:
                    where = lines.get(first_seen[name] + ("alert",), 0)
                    problems.append(
                        _problem(
                            lines,
                            loc + ("alert",),
                            f"duplicate rule name {name!r} (first at line {where})",
                        )
                    )
                else:
                    first_seen[name] = loc
            problems += _check_detector(rule, loc, lines)
    problems += _check_inhibits(data, first_seen, lines)
    return problems


def _check_inhibits(
    data: Any, names: dict[str, Loc], lines: dict[Loc, int]
) -> list[tuple[int, str]]:
    """Every rule an ``inhibits`` list names is another rule of the same file."""
    problems: list[tuple[int, str]] = []
    for name, loc in names.items():
        targets = _get(_rule_at(data, loc), "inhibits")
        for i, target in enumerate(_list(targets)):
            if not isinstance(target, str):
                continue  # pydantic reports it
            if target == name:
                message = f"rule {name!r} cannot inhibit itself"
            elif target not in names:
                message = f"inhibits {target!r}, which is not a rule in this file"
            else:
                continue
            problems.append(_problem(lines, loc + ("inhibits", i), message))
    return problems


def _rule_at(data: Any, loc: Loc) -> Any:
    _, gi, _, ri = loc
    return _list(_get(_list(_get(data, "groups"))[int(gi)], "rules"))[int(ri)]


def _check_detector(rule: Any, loc: Loc, lines: dict[Loc, int]) -> list[tuple[int, str]]:
    name, params = _get(rule, "detector"), _get(rule, "params")
    if not isinstance(name, str):
        return []  # pydantic reports a missing or mistyped detector
    if name not in registry.detector_names():
        known = ", ".join(registry.detector_names())
        return [
            _problem(
                lines, loc + ("detector",), f"unknown detector {name!r}; known detectors: {known}"
            )
        ]
    if params is not None and not isinstance(params, dict):
        return []  # pydantic reports params that are not a mapping
    try:
        registry.make_detector(name, params)
    except ValidationError as exc:
        return [
            _problem(lines, loc + ("params",) + tuple(e["loc"]), _message(e)) for e in exc.errors()
        ]
    except ValueError as exc:
        return [_problem(lines, loc + ("params",), str(exc))]
    return []


def _spec(
    group: GroupModel, rule: RuleModel, source: str, lines: dict[Loc, int], at: tuple[int, int]
) -> RuleSpec:
    duration = rule.for_ if isinstance(rule.for_, str) else None
    return RuleSpec(
        name=rule.alert,
        detector=rule.detector,
        severity=rule.severity,
        category=rule.category,
        group=group.name,
        params=MappingProxyType(dict(rule.params)),
        for_steps=rule.for_ if isinstance(rule.for_, int) else 1,
        for_seconds=None if duration is None else parse_duration(duration),
        keep_firing_for=rule.keep_firing_for,
        actions=tuple(rule.actions),
        inhibits=tuple(rule.inhibits),
        labels=MappingProxyType(dict(rule.labels)),
        annotations=MappingProxyType(dict(rule.annotations)),
        source=f"{source}:{lines.get(('groups', at[0], 'rules', at[1]), 0)}",
    )


def _problem(lines: dict[Loc, int], loc: Loc, message: str) -> tuple[int, str]:
    # A missing key has no line of its own: report the nearest enclosing node's.
    probe = loc
    while probe not in lines and probe:
        probe = probe[:-1]
    return lines.get(probe, 0), f"{_path(loc)}: {message}" if loc else message


def _message(error: Any) -> str:
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])  # drop pydantic's "Value error, " prefix
    return str(error["msg"])


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (key)"
        else:
            out += f".{part}" if out else str(part)
    return out


def _get(mapping: Any, key: str) -> Any:
    return mapping.get(key) if isinstance(mapping, dict) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
