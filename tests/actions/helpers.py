"""Shared pieces of the actions tests: alerts, transitions and a fake clock."""

from __future__ import annotations

from gradwatch.rules.alert import Alert, Transition

KEY = b"k" * 32
T0 = 1_700_000_000.0


class Clock:
    """A settable clock: tests move time, nothing sleeps."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def firing(
    job: str = "run-1", rule: str = "NaNLoss", step: int = 250, category: str = "numerical"
) -> Transition:
    """A fresh firing transition of ``rule`` whose incident began at ``step``."""
    alert = Alert(
        rule=rule,
        category=category,
        # The helper takes a plain str; callers pass valid literal values.
        severity="critical",  # type: ignore[arg-type]
        job=job,
        state="firing",
        step=step,
        summary="loss is nan",
        started_at=T0,
    )
    return Transition(alert, "pending", "firing")
