"""``gradwatch_rollback*``: what the rollback actions did, read from them at scrape time.

Sent and refused rollbacks (by reason, and by the reason an agent gave), whether
rollbacks are on, each job's remaining restart budget, and the checkpoint table's
size. Nothing is set ahead of time: a forgotten job has no budget series.

Example::

    registry.register(ActionsMetrics(server.actions))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradwatch.collector.actions import Actions
from gradwatch.collector.exposition import JOB_LABEL


class ActionsMetrics:
    """A Prometheus collector of the actions' counters, built at scrape time.

    ``gradwatch_rollbacks_sent_total``, ``gradwatch_rollbacks_refused_total{reason}``,
    ``gradwatch_rollback_enabled`` and ``gradwatch_rollback_budget_remaining{training_job}``
    (jobs with a rollback inside the budget window; others have the full budget).
    """

    def __init__(self, actions: Actions) -> None:
        self._actions = actions

    def describe(self) -> Iterable[Metric]:
        return list(self._families({}, 0, False, {}))

    def collect(self) -> Iterator[Metric]:
        actions = self._actions
        stats = actions.stats()
        now = actions.clock()
        budget = actions.budget
        remaining = {
            job: max(0, budget.max_count - budget.used(job, now)) for job in budget.jobs(now)
        }
        yield from self._families(stats.refused, stats.sent, stats.enabled, remaining)
        by_agent = CounterMetricFamily(
            "gradwatch_rollbacks_refused_by_agent",
            "Signed rollbacks an agent refused because "
            "the checkpoint was not one it saved (or changed since); see SECURITY.md.",
            labels=["reason"],
        )
        for reason, count in sorted(stats.agent_refused.items()):
            by_agent.add_metric([reason], count)
        yield by_agent
        overwrite = CounterMetricFamily(
            "gradwatch_checkpoint_overwrites_refused",
            "Checkpoint reports refused because "
            "their (job, step, rank) was already recorded (entries are immutable).",
        )
        overwrite.add_metric([], stats.checkpoints_refused)
        yield overwrite
        rows = GaugeMetricFamily(
            "gradwatch_checkpoint_rows", "Checkpoint entries kept for rollbacks, all jobs."
        )
        rows.add_metric([], actions.checkpoints.rows())
        yield rows

    @staticmethod
    def _families(
        refused: Mapping[str, int], sent: int, enabled: bool, remaining: Mapping[str, int]
    ) -> Iterator[Metric]:
        sent_family = CounterMetricFamily(
            "gradwatch_rollbacks_sent", "Signed rollback commands sent to agents."
        )
        sent_family.add_metric([], sent)
        yield sent_family
        refused_family = CounterMetricFamily(
            "gradwatch_rollbacks_refused",
            "Rollbacks not carried out, by reason; the alert was still notified.",
            labels=["reason"],
        )
        for reason, count in sorted(refused.items()):
            refused_family.add_metric([reason], count)
        yield refused_family
        yield GaugeMetricFamily(
            "gradwatch_rollback_enabled",
            "1 when a command key is set and rollback actions run.",
            value=int(enabled),
        )
        left = GaugeMetricFamily(
            "gradwatch_rollback_budget_remaining",
            "Rollbacks a job may still get in the budget window.",
            labels=[JOB_LABEL],
        )
        for job, count in sorted(remaining.items()):
            left.add_metric([job], count)
        yield left
