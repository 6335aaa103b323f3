"""The alert state machine with a fake clock: pending, firing, resolved, dedup."""

from __future__ import annotations

import pytest

from gradwatch.rules import AlertLifecycle, AlertRule, Finding, parse_duration

ON = Finding(True, "bad", {"x": 1})
OFF = Finding(False)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def machine(clock: FakeClock | None = None, **rule: object) -> AlertLifecycle:
    spec = AlertRule(name="R", category="numerical", severity="critical", **rule)
    return AlertLifecycle(spec, job="job", rank=0, clock=clock or FakeClock())


def test_pending_then_firing_after_for_steps_then_resolved_once() -> None:
    clock = FakeClock()
    m = machine(clock, for_steps=3)
    assert m.update(10, ON) is None and m.state == "pending"
    assert m.update(11, ON) is None and m.state == "pending"
    fired = m.update(12, ON)
    assert fired is not None
    assert (fired.previous, fired.current) == ("pending", "firing")
    assert fired.alert.state == "firing"
    assert fired.alert.step == 10  # where the incident began, not where it crossed `for`
    assert fired.alert.started_at == 1000.0
    assert fired.alert.evidence == {"x": 1}
    for t in range(13, 30):
        assert m.update(t, ON) is None  # deduplicated
    clock.now = 1500.0
    resolved = m.update(30, OFF)
    assert resolved is not None
    assert (resolved.previous, resolved.current) == ("firing", "resolved")
    assert resolved.alert.state == "resolved"
    assert resolved.alert.resolved_at == 1500.0
    assert resolved.alert.id == fired.alert.id
    assert m.update(31, OFF) is None and m.state == "resolved"


def test_pending_clears_silently_before_for() -> None:
    m = machine(for_steps=3)
    assert m.update(1, ON) is None
    assert m.update(2, ON) is None
    assert m.update(3, OFF) is None
    assert m.state == "inactive"
    assert m.alert is None
    assert m.update(4, ON) is None and m.state == "pending"  # the count starts again


def test_for_one_fires_on_the_first_step() -> None:
    fired = machine(for_steps=1).update(41, ON)
    assert fired is not None and (fired.previous, fired.current) == ("inactive", "firing")
    assert fired.alert.step == 41


def test_seconds_based_for() -> None:
    clock = FakeClock(0.0)
    m = machine(clock, for_seconds=parse_duration("30s"))
    assert m.update(1, ON) is None
    clock.now = 29.9
    assert m.update(2, ON) is None and m.state == "pending"
    clock.now = 30.0
    fired = m.update(3, ON)
    assert fired is not None and fired.current == "firing"
    assert fired.alert.step == 1 and fired.alert.started_at == 0.0


def test_a_new_incident_gets_a_new_id() -> None:
    m = machine()
    first = m.update(5, ON)
    m.update(6, OFF)
    second = m.update(9, ON)
    assert first is not None and second is not None
    assert second.previous == "resolved"
    assert second.alert.step == 9
    assert second.alert.id != first.alert.id


def test_keep_firing_for_rides_out_short_gaps() -> None:
    m = machine(keep_firing_for=2)
    assert m.update(1, ON) is not None
    assert m.update(2, OFF) is None
    assert m.update(3, OFF) is None
    assert m.update(4, ON) is None  # same incident, still firing
    assert m.update(5, OFF) is None
    assert m.update(6, OFF) is None
    resolved = m.update(7, OFF)
    assert resolved is not None and resolved.current == "resolved"


def test_an_incident_an_early_page_overtook_fires_and_ends_on_its_own() -> None:
    m = machine(keep_firing_for=1)
    (paged,) = [t for t in [m.open_early(8, ON)] if t is not None]
    (earlier,) = m.advance(4, ON)  # judged later, but a step before the paged one
    assert (earlier.current, earlier.alert.step) == ("firing", 4)
    assert earlier.alert.id != paged.alert.id
    assert m.advance(5, ON) == [] and m.advance(6, OFF) == []  # keep_firing_for: 1
    (ended,) = m.advance(7, OFF)
    assert (ended.alert.id, ended.current) == (earlier.alert.id, "resolved")
    assert m.advance(8, ON) == [] and m.state == "firing"  # the paged one goes on
    (resolved,) = m.advance(9, OFF) + m.advance(10, OFF)
    assert resolved.alert.id == paged.alert.id


def test_close_resolves_a_firing_alert_and_drops_a_pending_one() -> None:
    m = machine()
    m.update(1, ON)
    (closed,) = m.close()
    assert closed.alert.state == "resolved"
    assert m.close() == []
    p = machine(for_steps=5)
    p.update(1, ON)
    assert p.close() == [] and p.state == "inactive"


def test_summary_falls_back_to_the_rules_annotation() -> None:
    m = machine(annotations={"summary": "from the rule"})
    fired = m.update(1, Finding(True))
    assert fired is not None and fired.alert.summary == "from the rule"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("1.5h", 5400.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5x", "m5", "5m 3s", "-5s"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)
