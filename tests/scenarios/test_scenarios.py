"""The scored fault suite as tests: real PyTorch faults, agent -> ZeroMQ -> collector -> rules.

Asserts only what holds today: every healthy control raises nothing above what it
allows (most allow nothing at all), and each fault raises its expected category (or
one of its accepted ones). Scenarios the current system cannot catch, or known false
alarms, are ``xfail(strict=True)`` with the reason, so they turn into failures when
fixed and the mark must go. Scenarios that wait for an agent feature being built are
``xfail(strict=False)`` until it lands. Slow scenarios run only in the benchmark.
The scores (latency, other alerts, held-out families) are printed by
``benchmarks/fault_suite.py``.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")

from scenarios.families import ALL_SCENARIOS, BY_NAME
from scenarios.scenario_lib import Scenario, run_scenario


def _param(s: Scenario) -> object:
    reason = s.needs
    if reason is None and s.requires and importlib.util.find_spec(s.requires) is None:
        reason = f"needs {s.requires}, which this agent does not have"
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    if not marks and s.pending:
        marks = [pytest.mark.xfail(strict=False, reason=s.pending)]
    return pytest.param(s, id=s.name, marks=marks)


FAULTS = [_param(s) for s in ALL_SCENARIOS if s.category is not None and not s.slow]
CONTROLS = [_param(s) for s in ALL_SCENARIOS if s.category is None and not s.slow]


def _describe(fired: list) -> str:
    return ", ".join(f"{f.rule}[{f.category}/{f.severity}]@{f.step}" for f in fired) or "nothing"


@pytest.mark.parametrize("scenario", FAULTS)
def test_fault_raises_its_category(scenario: Scenario) -> None:
    result = run_scenario(scenario)
    assert result.detected, (
        f"{scenario.name}: expected {scenario.accepted}, fired {_describe(result.fired)}"
    )
    assert result.latency is not None and result.latency >= 0, (
        f"{scenario.name}: the alert begins before the fault's onset step {scenario.onset}: "
        f"{_describe(result.fired)}"
    )


@pytest.mark.parametrize("scenario", CONTROLS)
def test_healthy_control_raises_no_alert(scenario: Scenario) -> None:
    result = run_scenario(scenario)
    allowed = f" above {scenario.allow}" if scenario.allow else ""
    assert not result.other, (
        f"{scenario.name}: false alarm{allowed}: {_describe(result.other)} "
        f"(all fired: {_describe(result.fired)})"
    )


def test_an_unannounced_task_switch_is_a_note_naming_the_step() -> None:
    # The control above allows info; this checks the note is there and says what to do.
    result = run_scenario(BY_NAME["healthy_task_switch_unannounced"])
    notes = [a for a in result.alerts if a.rule == "LossLevelShift"]
    assert notes and {a.severity for a in result.alerts} == {"info"}, _describe(result.fired)
    assert notes[0].evidence["spike_step"] == 250 and "mon.data_changed()" in notes[0].summary
