"""One page per cause: a rule's ``inhibits`` list mutes what its alert already explains.

Two rules can fire on one cause. At lr x100 on nanoGPT, WeightsInflatingLossStalled
("the weights grow while the loss stalls: lower the learning rate") and
WeightNormRunaway ("the weights grow") fired at the same step; a pager that gets both
learns nothing from the second. A rule names the rules it explains in the rule file
(``inhibits: [WeightNormRunaway]``, rules/rulefile.py). While it fires on a job, the
collector's own sinks (webhooks, Slack, PagerDuty) do not page that job's new firings
of those rules, nor later their resolves; the alerts themselves still open, are
recorded, exported (``gradwatch_alert_firing``) and shown in the report. What is muted
is counted (``gradwatch_alerts_inhibited_total{rule}``) and logged once per rule.

Alertmanager applies the same pairs itself (``inhibit_rules`` in
deploy/alertmanager/alertmanager.yml, kept equal to the rule pack by
tests/collector/test_inhibition.py), and with what a direct sink cannot do: it
notifies a muted alert once its source resolves. So the Alertmanager sink gets every
transition, and so does the Grafana annotation sink (a record, not a page). A direct
sink keeps a muted alert muted for its whole incident.

Within one batch of transitions (one observation can open several alerts), the
sources go first, so the order the rules run in does not decide what pages.

Example::

    inhibition = Inhibition(engine.rules)
    for transition in inhibition.order(transitions):
        if inhibition.muted(transition):
            ...  # record it, but do not page it on direct sinks
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, Metric

log = logging.getLogger(__name__)

REMEMBERED_MUTED = 10_000  # muted firing ids kept to mute their resolves; oldest forgotten
_PAGED_STATES = ("firing", "resolved")


class Inhibiting(Protocol):
    """What a rule spec offers here (rules/rulefile.py: RuleSpec)."""

    name: str
    inhibits: tuple[str, ...]


class Inhibition:
    """The rule pack's ``inhibits`` pairs, and which sources fire now on which job."""

    def __init__(self, rules: Iterable[Inhibiting]) -> None:
        by_target: dict[str, set[str]] = {}
        for rule in rules:
            # getattr: an engine built by hand (tests, embedders) may give plain specs.
            for target in getattr(rule, "inhibits", ()):
                by_target.setdefault(target, set()).add(rule.name)
        self._sources_of = {target: frozenset(s) for target, s in by_target.items()}
        self._sources = frozenset().union(*self._sources_of.values())
        # (job, source rule) -> ids of its alerts firing now (one per rank it fires on).
        self._firing: dict[tuple[str, str], set[str]] = {}
        self._muted: OrderedDict[str, None] = OrderedDict()
        self.counts: Counter[str] = Counter()  # muted notifications by rule
        self._lock = threading.Lock()  # ingest and liveness both dispatch

    @property
    def pairs(self) -> set[tuple[str, str]]:
        """Every (source, target) pair, for checking a deploy config against the rules."""
        return {(s, t) for t, sources in self._sources_of.items() for s in sources}

    def order(self, transitions: Iterable[Any]) -> list[Any]:
        """``transitions`` with those of inhibiting rules first, otherwise in order."""
        batch = list(transitions)
        if not self._sources or len(batch) < 2:
            return batch
        return sorted(batch, key=lambda t: t.alert.rule not in self._sources)

    def muted(self, transition: Any) -> bool:
        """Whether direct sinks skip this transition; tracks the sources' firings."""
        if not self._sources or transition.current not in _PAGED_STATES:
            return False
        alert = transition.alert
        with self._lock:
            if alert.rule in self._sources:
                self._track(alert)
            if alert.id in self._muted:
                if alert.state == "resolved":
                    del self._muted[alert.id]
                self.counts[alert.rule] += 1
                return True
            sources = self._sources_of.get(alert.rule)
            if alert.state != "firing" or sources is None:
                return False
            muting = [s for s in sorted(sources) if self._firing.get((alert.job, s))]
            if not muting:
                return False
            self._muted[alert.id] = None
            if len(self._muted) > REMEMBERED_MUTED:
                self._muted.popitem(last=False)
            if not self.counts[alert.rule]:
                log.info(
                    "alert %s on job %r not paged on direct sinks: %s fires on that job "
                    "and explains it (the rule file's inhibits); it is still recorded and "
                    "exported, and counted in gradwatch_alerts_inhibited_total",
                    alert.rule,
                    alert.job,
                    muting[0],
                )
            self.counts[alert.rule] += 1
            return True

    def _track(self, alert: Any) -> None:
        key = (alert.job, alert.rule)
        if alert.state == "firing":
            self._firing.setdefault(key, set()).add(alert.id)
            return
        ids = self._firing.get(key)
        if ids is not None:
            ids.discard(alert.id)
            if not ids:
                del self._firing[key]


class InhibitionMetrics:
    """``gradwatch_alerts_inhibited_total{rule}``, read at scrape time."""

    def __init__(self, inhibition: Inhibition) -> None:
        self._inhibition = inhibition

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        yield self._family()

    def _family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "gradwatch_alerts_inhibited",
            "Alert notifications (firings and their resolves) that direct sinks did not "
            "send because a rule that explains them fired on the same job (rule file: "
            "inhibits).",
            labels=["rule"],
        )
        inhibition = self._inhibition
        with inhibition._lock:  # dispatch may be counting right now
            counts = sorted(inhibition.counts.items())
        for rule, count in counts:
            family.add_metric([rule], count)
        return family
