"""Which alerts a sink sends, and how fast: severity, categories, flapping, rate.

A :class:`RoutePolicy` (part of the collector config) says what one sink wants:
a minimum severity, categories to include or exclude, and a rate limit. A
:class:`Router` applies it to each notification:

* a firing alert passes if its severity and category match the policy;
* a resolve goes where its firing went (and nowhere else), so a pager never
  gets a lone "resolved" and never misses the resolve of what it was sent;
* a rule that fires over and over on one job and rank (flapping) is let
  through ``flap_max`` times per ``flap_window`` seconds, then held back until
  it calms down; the held-back firings and their resolves are counted;
* repeats of one alert id and state are never sent twice (the outbox's
  primary key enforces that across restarts too).

:class:`TokenBucket` is the per-sink rate limit the delivery worker applies:
excess notifications wait in the outbox, they are not dropped.

Example::

    from gradwatch.collector.routing import RoutePolicy, Router

    router = Router(RoutePolicy(min_severity="critical", exclude_categories=["stalled"]))
    router.admit(alert, now=time.time())   # True: send it
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
REMEMBERED_INCIDENTS = 10_000  # firing ids kept to route their resolves; oldest forgotten


class RoutePolicy(BaseModel):
    """What one sink receives. Empty ``categories`` means every category."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_severity: Literal["info", "warning", "critical"] = Field(
        default="info", description="Send alerts of this severity and above."
    )
    categories: list[str] = Field(
        default_factory=list, description="Only these categories (empty: all)."
    )
    exclude_categories: list[str] = Field(
        default_factory=list, description="Never these categories."
    )
    rate_per_minute: float | None = Field(
        default=None, gt=0, description="Most notifications sent per minute; the rest wait."
    )
    flap_max: int = Field(
        default=3, ge=1, description="Firings of one rule on one job/rank per flap window."
    )
    flap_window_seconds: float = Field(
        default=600.0, gt=0, description="Window of the flapping guard."
    )


class Router:
    """Applies a :class:`RoutePolicy` to alerts; thread-safe (ingest and liveness both notify)."""

    def __init__(self, policy: RoutePolicy | None = None, *, name: str = "sink") -> None:
        self.policy = policy or RoutePolicy()
        self.name = name
        self.suppressed = 0  # flapping firings (and their resolves) held back
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._held: OrderedDict[str, None] = OrderedDict()
        self._firings: dict[tuple[str, str, Any], deque[float]] = {}
        self._lock = threading.Lock()

    def admit(self, alert: Any, now: float) -> bool:
        """True if this sink should send ``alert`` (a firing or resolved ``Alert``)."""
        with self._lock:
            return self._admit(alert, now)

    def _admit(self, alert: Any, now: float) -> bool:
        if alert.state == "resolved":
            if alert.id in self._sent:
                return True
            if alert.id in self._held:
                self.suppressed += 1
                return False
            # Firing unknown (sent before a restart): the same filters decide the same way.
            return self._matches(alert)
        if not self._matches(alert):
            return False
        if self._flapping(alert, now):
            self.suppressed += 1
            _remember(self._held, alert.id)
            return False
        _remember(self._sent, alert.id)
        return True

    def _matches(self, alert: Any) -> bool:
        policy = self.policy
        if SEVERITY_RANK.get(alert.severity, 0) < SEVERITY_RANK[policy.min_severity]:
            return False
        if policy.categories and alert.category not in policy.categories:
            return False
        return alert.category not in policy.exclude_categories

    def _flapping(self, alert: Any, now: float) -> bool:
        key = (alert.job, alert.rule, alert.rank)
        times = self._firings.setdefault(key, deque())
        while times and times[0] <= now - self.policy.flap_window_seconds:
            times.popleft()
        if len(times) >= self.policy.flap_max:
            if len(times) == self.policy.flap_max:
                log.warning(
                    "%s: rule %s on job %r rank %s fired %d times in %.0fs; holding "
                    "back further firings until it settles (raise flap_max in the "
                    "route if this is expected)",
                    self.name,
                    alert.rule,
                    alert.job,
                    alert.rank,
                    len(times),
                    self.policy.flap_window_seconds,
                )
            times.append(now)  # keeps it held while it keeps flapping
            return True
        times.append(now)
        return False


def _remember(ids: OrderedDict[str, None], alert_id: str) -> None:
    ids[alert_id] = None
    if len(ids) > REMEMBERED_INCIDENTS:
        ids.popitem(last=False)


class TokenBucket:
    """``rate_per_minute`` tokens a minute, bursts up to ``burst``; None means unlimited."""

    def __init__(
        self,
        rate_per_minute: float | None,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = None if rate_per_minute is None else rate_per_minute / 60.0
        self._burst = burst if burst is not None else max(1.0, (rate_per_minute or 0) / 6.0)
        self._tokens = self._burst
        self._clock = clock
        self._last = clock()

    def take(self) -> float:
        """Take a token and return 0.0, or return the seconds until one is available."""
        if self._rate is None:
            return 0.0
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate
