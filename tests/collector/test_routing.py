"""Routing: severity and category filters, resolves follow firings, flapping, token bucket."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gradwatch.collector.routing import RoutePolicy, Router, TokenBucket
from gradwatch.rules import Alert


def alert(
    severity: str = "critical",
    category: str = "numerical",
    step: int = 1,
    rule: str = "NonFiniteGradients",
) -> Alert:
    return Alert(
        rule=rule,
        category=category,
        # The helper takes a plain str; callers pass valid literal values.
        severity=severity,  # type: ignore[arg-type]
        job="run-1",
        state="firing",
        step=step,
        summary="s",
        started_at=0.0,
        rank=0,
    )


def resolved(a: Alert) -> Alert:
    return replace(a, state="resolved", resolved_at=1.0)


def test_min_severity_and_categories() -> None:
    router = Router(
        RoutePolicy(
            min_severity="warning",
            categories=["numerical", "stalled"],
            exclude_categories=["stalled"],
        )
    )
    assert router.admit(alert("critical"), now=0)
    assert router.admit(alert("warning", step=2), now=0)
    assert not router.admit(alert("info", step=3), now=0)
    assert not router.admit(alert(category="loss_spike", step=4), now=0)
    assert not router.admit(alert(category="stalled", step=5), now=0)


def test_a_resolve_goes_where_its_firing_went_and_nowhere_else() -> None:
    router = Router(RoutePolicy(min_severity="critical"))
    sent, filtered = alert("critical"), alert("warning", step=2)
    assert router.admit(sent, 0) and not router.admit(filtered, 0)
    assert router.admit(resolved(sent), 1)
    assert not router.admit(resolved(filtered), 1)
    # Firing unknown (sent before a restart): the same filter decides.
    assert router.admit(resolved(alert("critical", step=9)), 1)


def test_a_flapping_rule_is_held_back_with_its_resolves() -> None:
    router = Router(RoutePolicy(flap_max=2, flap_window_seconds=100))
    incidents = [alert(step=s) for s in range(1, 6)]
    decisions = [router.admit(a, now=float(i)) for i, a in enumerate(incidents)]
    assert decisions == [True, True, False, False, False]
    assert not router.admit(resolved(incidents[2]), now=5)
    assert router.admit(resolved(incidents[0]), now=5)
    assert router.suppressed == 4
    # Another rule on the same job is not affected; after the window the rule is let through.
    assert router.admit(alert(rule="LossSpike", category="loss_spike", step=1), now=6)
    assert router.admit(alert(step=50), now=500)


def test_token_bucket_paces_and_refills() -> None:
    now = [0.0]
    bucket = TokenBucket(60.0, burst=2, clock=lambda: now[0])
    assert [bucket.take(), bucket.take()] == [0.0, 0.0]
    assert bucket.take() == pytest.approx(1.0)
    now[0] = 1.0
    assert bucket.take() == 0.0
    assert TokenBucket(None).take() == 0.0


def test_route_policy_rejects_unknown_keys_and_bad_rates() -> None:
    with pytest.raises(ValueError, match="extra"):
        # The wrong key is the point: the policy must refuse it.
        RoutePolicy(min_sev="critical")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="greater than 0"):
        RoutePolicy(rate_per_minute=0)
