"""``gradwatch_ingest_refused*``, ``gradwatch_bound``: the collector's bounds and what they refused.

Read from the :class:`~gradwatch.collector.limits.Admission` at scrape time: a
bounded number of series (refusals by reason, the ``TOP_SENDERS`` senders refused
most, the configured bounds), whatever a hostile sender does.

Example::

    registry.register(AdmissionMetrics(server.admission))
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradwatch.collector.limits import TOP_SENDERS, Admission, Bounds


class AdmissionMetrics:
    """The bounds and what they refused, built at scrape time (a bounded number of series)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        a = self._admission
        refused = CounterMetricFamily(
            "gradwatch_ingest_refused",
            "Messages refused by a bound or the fair share, by "
            "reason (SECURITY.md lists the bounds).",
            labels=["reason"],
        )
        for reason, count in sorted(a.refused().items()):
            refused.add_metric([reason], count)
        yield refused
        by_sender = CounterMetricFamily(
            "gradwatch_ingest_refused_by_sender",
            f"Refusals of the {TOP_SENDERS} senders "
            "(job, or CurveZMQ key) refused most, by reason.",
            labels=["sender", "reason"],
        )
        for who, reason, count in a.offenders():
            by_sender.add_metric([who[:128], reason], count)
        yield by_sender
        yield GaugeMetricFamily(
            "gradwatch_jobs_admitted",
            "Jobs the collector tracks (bounded by max_jobs).",
            value=a.jobs(),
        )
        yield GaugeMetricFamily(
            "gradwatch_resident_memory_bytes",
            "The collector's resident memory (bounded by max_memory_bytes for new jobs and ranks).",
            value=a.rss(),
        )
        limits = GaugeMetricFamily("gradwatch_bound", "The configured bounds.", labels=["bound"])
        for name in Bounds.__dataclass_fields__:
            limits.add_metric([name], float(getattr(a.bounds, name)))
        yield limits
