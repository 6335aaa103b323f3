"""AgentDegraded / AgentStatisticOff: the agent's own notices, through the rules engine."""

from __future__ import annotations

import pytest

from gradwatch.rules import load_default_rules
from gradwatch.rules.agent_health import AgentDegradedDetector, AgentNotice
from gradwatch.rules.engine import Engine


def notice(step: int, off: str, optional: bool = False, job: str = "j") -> AgentNotice:
    return AgentNotice(job, 0, step, off, f"why {off}", optional)


def test_each_scope_fires_once_and_names_every_part_that_is_off() -> None:
    engine = Engine(load_default_rules())
    [core] = engine.observe_notice(notice(5, "gradient norms of sparse layers"))
    assert (core.alert.rule, core.alert.severity, core.current) == (
        "AgentDegraded",
        "warning",
        "firing",
    )
    assert core.alert.category == "agent_health" and core.alert.step == 5
    [info] = engine.observe_notice(notice(6, "activation statistics", optional=True))
    assert (info.alert.rule, info.alert.severity) == ("AgentStatisticOff", "info")
    assert engine.observe_notice(notice(7, "gradient norms of sparse layers")) == []  # resent
    assert engine.observe_notice(notice(9, "monitoring")) == []  # still the one alert
    [firing] = [a for a in engine.firing() if a.rule == "AgentDegraded"]
    assert firing.job == "j"


def test_detector_keeps_each_part_with_the_step_it_went_off() -> None:
    det = AgentDegradedDetector(scope="core")
    assert det.observe_notice(notice(3, "activation statistics", optional=True)) is None
    det.observe_notice(notice(4, "gradient norms"))
    found = det.observe_notice(notice(8, "monitoring"))
    assert found is not None and found.active
    assert found.evidence["off"] == ["gradient norms", "monitoring"]
    assert found.evidence["since_step"] == 4
    assert "gradient norms off since step 4 (why gradient norms)" in found.summary


@pytest.mark.parametrize("fields", [{}, {"off": ""}, {"off": 3}, {"off": "x", "reason": 4}])
def test_malformed_event_fields_make_no_notice(fields: dict[str, object]) -> None:
    assert AgentNotice.of_fields("j", 0, 1, fields) is None


def test_notice_from_event_fields() -> None:
    got = AgentNotice.of_fields("j", 2, 7, {"off": "a" * 1000, "reason": "r", "optional": True})
    assert got is not None and got.rank == 2 and got.optional and len(got.off) == 512
