"""``gradwatch_assembly_*``: how well each multi-rank job's steps come together.

Read from the :class:`~gradwatch.rules.assembly.Assembler` at scrape time,
so a forgotten job has no series. One series per job and counter, never per
rank: ``gradwatch_job_absent_ranks`` counts the ranks steps stopped waiting for.
Every job the collector knows has every series from its first scrape, at zero
until something happens (a single-rank job's stay there): a dashboard panel is
not empty in a healthy run, and ``rate()``/``increase()`` see the first increment.

Example::

    registry.register(AssemblyMetrics(server.assembler, server.assembler_lock,
                                      jobs=server.state.jobs))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradwatch.collector.exposition import JOB_LABEL
from gradwatch.rules.assembly import Assembler, AssemblyCounts

_COUNTERS = (
    ("steps", "gradwatch_assembly_steps", "Steps assembled across ranks and judged by the rules."),
    (
        "incomplete",
        "gradwatch_assembly_incomplete_steps",
        "Steps judged at the assembly deadline without every expected rank.",
    ),
    (
        "inexact",
        "gradwatch_assembly_inexact_steps",
        "Steps judged with some layers left out because a shard of them never arrived.",
    ),
    (
        "late",
        "gradwatch_assembly_late_reports",
        (
            "Rank reports that arrived after their step was judged (dropped); a rank that is "
            "often late needs a longer assembly_deadline_seconds or a look at its network."
        ),
    ),
    (
        "restarts",
        "gradwatch_assembly_restarts",
        "Times a rank's steps went backwards (a restart or rollback) and assembly began anew.",
    ),
)


class AssemblyMetrics:
    """A prometheus_client collector over an assembler shared with the ingest thread."""

    def __init__(
        self, assembler: Assembler, lock: threading.Lock, jobs: Callable[[], Iterable[str]] = tuple
    ) -> None:
        self._assembler = assembler
        self._lock = lock
        self._jobs = jobs  # every job the collector knows: their series start at zero

    def collect(self) -> Iterable[Metric]:
        known = set(self._jobs())
        with self._lock:
            counts = self._assembler.counts()
            absent = {job: len(self._assembler.absent(job)) for job in counts}
        for job in known - counts.keys():
            counts[job] = AssemblyCounts()
            absent[job] = 0
        for field, name, help_text in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=[JOB_LABEL])
            for job, count in sorted(counts.items()):
                family.add_metric([job], getattr(count, field))
            yield family
        gauge = GaugeMetricFamily(
            "gradwatch_job_absent_ranks",
            "Ranks of a multi-rank job that missed the assembly deadline and have not "
            "reported since; steps are judged without them.",
            labels=[JOB_LABEL],
        )
        for job, n in sorted(absent.items()):
            gauge.add_metric([job], n)
        yield gauge
