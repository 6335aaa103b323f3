"""Prometheus metrics, rendered from the collector's state at scrape time.

One custom collector builds every ``gradwatch_*`` family when Prometheus
scrapes, from ``StateStore.snapshot()``, the ingest counters, the engine's
firing alerts and the sinks' counters. Nothing is set ahead of time, so a job
the state has forgotten simply has no series (no stale gauges); a job the state
knows has its per-job counters from its first scrape, at zero until something
happens, so ``rate()`` sees the first increment.

Cardinality is bounded per job whatever the model or world size: per-block
gradient norms (always on, at most ``max_block_series``), per-layer norms
(opt-in, at most ``max_layer_series``, top offenders), per-rank last-seen
times (at most ``max_rank_series``, the ranks silent longest) and per-module
activation shares (at most ``max_layer_series`` per family). Across jobs,
each of these families holds at most ``max_series_per_family`` series: with
many jobs each job's cap shrinks to its share (so a scrape stays small and
well under Prometheus's 10 s timeout whatever arrives). The block,
layer and rank families each have a ``*_series_capped`` flag so a dashboard
can say it shows a part.

Example::

    from prometheus_client import CollectorRegistry, generate_latest
    from gradwatch.collector.exposition import GradwatchCollector
    from gradwatch.collector.ingest import Ingest
    from gradwatch.collector.state import StateStore

    registry = CollectorRegistry()
    registry.register(GradwatchCollector(StateStore(), Ingest().stats))
    print(generate_latest(registry).decode())
"""

from __future__ import annotations

import functools
import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gradwatch.collector.blocks import block_norms
from gradwatch.collector.config import VERSION
from gradwatch.collector.ingest import IngestStats
from gradwatch.collector.sinks import Sink
from gradwatch.collector.state import AlertLike, JobView, StateStore
from gradwatch.rules.ratio import group_layers, group_norms

# The training job rides in a label of its own: Prometheus' ``job`` stays the
# collector's scrape job (whatever the scrape config or the Prometheus Operator
# names it), so no ``honor_labels`` is needed and self-alerts can find the
# collector by its own ``up`` (docs/operations.md, "Labels").
JOB_LABEL = "training_job"
SNAPSHOT_RANKS = 1024  # from this many ranks, scrapes are served a snapshot (collect)
REFRESH_S = 1.0  # a snapshot is rendered this often while scrapes keep coming
STALE_S = 10.0  # a snapshot older than this (the refresher is stuck) is not served
# The refresher stops after this long without a scrape: longer than Prometheus' default
# scrape interval (1 m) and its common 2 m, so those scrapes find it running.
IDLE_S = 150.0
ALERT_LABELS = [JOB_LABEL, "rule", "category", "severity"]


class GradwatchCollector(Collector):
    """Builds all ``gradwatch_*`` metric families on each ``collect()``."""

    def __init__(
        self,
        state: StateStore,
        ingest_stats: Callable[[], IngestStats],
        firing: Callable[[], Iterable[AlertLike]] = tuple,
        sinks: Sequence[Sink] = (),
        *,
        per_layer_metrics: bool = False,
        max_layer_series: int = 256,
        max_block_series: int = 512,
        max_rank_series: int = 64,
        max_series_per_family: int = 20_000,
        version: str = VERSION,
        snapshot_ranks: int = SNAPSHOT_RANKS,
        refresh_seconds: float = REFRESH_S,
    ) -> None:
        self._state = state
        self._ingest_stats = ingest_stats
        self._firing = firing
        self._sinks = tuple(sinks)
        self._per_layer = per_layer_metrics
        self._max_layer_series = max_layer_series
        self._max_block_series = max_block_series
        self._max_rank_series = max_rank_series
        self._max_family = max_series_per_family
        self._version = version
        # Large jobs: scrapes are served a snapshot the refresher renders (see collect).
        self._snapshot_ranks = snapshot_ranks
        self._refresh_s = refresh_seconds
        self._snap_lock = threading.Lock()
        self._snapshot: tuple[float, list[Metric]] | None = None
        self._wanted = 0.0  # monotonic time of the last scrape served a snapshot
        self._refresher: threading.Thread | None = None
        self._large = False  # the last render saw snapshot_ranks ranks or more
        self.rendered = threading.Event()  # set after each snapshot the refresher renders
        self._closed = threading.Event()  # close(): the refresher stops at once

    def describe(self) -> Iterable[Metric]:
        # Empty families: enough for the registry to detect clashing names
        # without building a scrape at registration time.
        return list(self._families([], IngestStats({}, {}, {}, {}), []))

    def collect(self) -> Iterable[Metric]:
        """This scrape's families: rendered now, or for large jobs a fresh snapshot.

        With ``snapshot_ranks`` ranks or more (all jobs together), rendering takes
        tens of milliseconds of Python (O(ranks)) that, on the scrape's thread,
        waits for the GIL behind the ingest thread during a flush burst (0.3-1.6 s
        at 16,384 ranks, issue 17). A refresher thread then renders every
        ``refresh_seconds`` while scrapes keep coming, and a scrape returns its
        latest snapshot at once: at most ``refresh_seconds`` plus one render old
        (a render slowed by a burst is served once it is done; past
        ``STALE_S`` the scrape renders itself). Smaller collectors render on
        every scrape, as exact as before.
        """
        if not self._large or self._closed.is_set():
            return self._render()
        now = time.monotonic()
        with self._snap_lock:
            self._wanted = now
            snapshot = self._snapshot
            if self._refresher is None or not self._refresher.is_alive():
                self._refresher = threading.Thread(
                    target=self._refresh, name="gradwatch-metrics-snapshot", daemon=True
                )
                self._refresher.start()
        if snapshot is None or now - snapshot[0] > STALE_S:
            return self._render()
        return snapshot[1]

    def _render(self) -> list[Metric]:
        jobs = self._state.snapshot()
        # Read without a lock by the next collect(): a bool is set atomically.
        self._large = sum(job.ranks for job in jobs) >= self._snapshot_ranks
        return list(self._families(jobs, self._ingest_stats(), list(self._firing())))

    def _refresh(self) -> None:
        """Render a snapshot every ``refresh_seconds`` until no scrape came for ``IDLE_S``."""
        while not self._closed.is_set():
            with self._snap_lock:
                if time.monotonic() - self._wanted > IDLE_S:
                    self._refresher = None
                    return
            began = time.monotonic()
            families = self._render()
            with self._snap_lock:
                self._snapshot = (began, families)
            self.rendered.set()
            if self._closed.wait(max(0.0, self._refresh_s - (time.monotonic() - began))):
                return

    def close(self, timeout: float = 5.0) -> None:
        """Stop the refresher (the collector is stopping); later scrapes render themselves."""
        self._closed.set()
        with self._snap_lock:
            refresher = self._refresher
        if refresher is not None:
            refresher.join(timeout)

    def _families(
        self, jobs: list[JobView], ingest: IngestStats, firing: list[AlertLike]
    ) -> Iterator[Metric]:
        build = GaugeMetricFamily(
            "gradwatch_build_info", "gradwatch build; value is always 1.", labels=["version"]
        )
        build.add_metric([self._version], 1)
        yield build
        yield from _ingest_families(ingest, [job.job for job in jobs])
        yield from _job_families(jobs)
        yield from _rank_families(jobs, self._share(self._max_rank_series, jobs))
        yield _ratio_family(jobs)
        yield from _block_families(jobs, self._share(self._max_block_series, jobs))
        yield from _activation_families(jobs, self._share(self._max_layer_series, jobs))
        yield from _alert_families(jobs, firing)
        if self._per_layer:
            yield from self._layer_families(jobs, self._share(self._max_layer_series, jobs))
        yield from _sink_families(self._sinks)

    def _share(self, cap: int, jobs: list[JobView]) -> int:
        """A per-job cap, shrunk so that all jobs together stay within the family cap."""
        return max(1, min(cap, self._max_family // max(1, len(jobs))))

    def _layer_families(self, jobs: list[JobView], cap: int) -> Iterator[Metric]:
        norm = GaugeMetricFamily(
            "gradwatch_layer_grad_norm",
            "Gradient L2 norm of each layer at the job's latest step (assembled across ranks "
            "for a multi-rank job, else its reporting rank); "
            "when capped, the top max_layer_series offenders: non-finite first, then the "
            "largest norms.",
            labels=[JOB_LABEL, "layer"],
        )
        capped = GaugeMetricFamily(
            "gradwatch_layer_series_capped",
            "1 when the job has more layers than max_layer_series and only the top "
            "offenders are exposed.",
            labels=[JOB_LABEL],
        )
        for job in jobs:
            layers, norms = _top_layers(job.layers, job.layer_norms, cap)
            for name, value in zip(layers, norms, strict=True):
                norm.add_metric([job.job, name], value)
            capped.add_metric([job.job], float(len(layers) < len(set(job.layers))))
        yield norm
        yield capped


def _ingest_families(ingest: IngestStats, jobs: Sequence[str]) -> Iterator[Metric]:
    """Ingest counters; the per-job ones exist at zero for every known job (``rate()``
    then sees the first lost batch, and the dashboard's panels are not empty)."""
    messages = CounterMetricFamily(
        "gradwatch_ingest_messages", "Valid wire messages received, by kind.", labels=["kind"]
    )
    for kind, count in sorted(ingest.messages.items()):
        messages.add_metric([kind], count)
    rejected = CounterMetricFamily(
        "gradwatch_ingest_rejected", "Messages dropped, by reason.", labels=["reason"]
    )
    for reason, count in sorted(ingest.rejected.items()):
        rejected.add_metric([reason], count)
    lost = CounterMetricFamily(
        "gradwatch_ingest_lost_batches",
        "Batches missing from an agent's sequence (lost in transit).",
        labels=[JOB_LABEL],
    )
    for job, count in sorted(_with_zeros(ingest.lost_batches, jobs).items()):
        lost.add_metric([job], count)
    dropped = CounterMetricFamily(
        "gradwatch_agent_dropped_steps",
        "Steps agents report they could not ship (queue full, no collector).",
        labels=[JOB_LABEL],
    )
    for job, count in sorted(_with_zeros(ingest.agent_dropped, jobs).items()):
        dropped.add_metric([job], count)
    twins = CounterMetricFamily(
        "gradwatch_ingest_twin_agents",
        "Heartbeats of a rank taking turns with another live agent of the same job and rank "
        "(two processes training as one rank: give each its own rank= in watch()).",
        labels=[JOB_LABEL],
    )
    for job, count in sorted(_with_zeros(ingest.twin_agents, jobs).items()):
        twins.add_metric([job], count)
    yield from (messages, rejected, lost, dropped, twins)


def _with_zeros(counts: Mapping[str, int], jobs: Sequence[str]) -> dict[str, int]:
    return {**dict.fromkeys(jobs, 0), **counts}


def _job_families(jobs: list[JobView]) -> Iterator[Metric]:
    def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[JOB_LABEL, *extra])

    step = gauge("gradwatch_job_step", "Latest step reported by any rank.")
    loss = gauge(
        "gradwatch_job_loss",
        "Latest training loss: the mean over ranks of a multi-rank job's "
        "assembled step, else the reporting rank's.",
    )
    grad = gauge(
        "gradwatch_job_grad_norm",
        "Latest total gradient L2 norm (pre-clip when reported): assembled across "
        "ranks for a multi-rank job, else the reporting rank's.",
    )
    lr = gauge(
        "gradwatch_job_learning_rate", "Latest learning rate per optimizer param group.", ["group"]
    )
    nonfinite = gauge(
        "gradwatch_job_nonfinite_layers",
        "Layers whose latest gradient norm is NaN or Inf on any rank.",
    )
    ranks = gauge("gradwatch_job_ranks", "Ranks heard from.")
    seen = gauge(
        "gradwatch_job_last_seen_timestamp_seconds",
        "Unix time the collector last heard from the job.",
    )
    val = gauge("gradwatch_job_eval_loss", "Latest validation loss (mon.log_eval).")
    scale = gauge("gradwatch_job_loss_scale", "Latest AMP loss scale of the reporting rank.")
    world = gauge("gradwatch_job_world_size", "Ranks in the job, as its agents declare it.")
    lag = gauge(
        "gradwatch_job_ingest_lag_seconds",
        "Largest, over the job's ranks, of the seconds from a rank logging its newest "
        "step (agent clock) to the collector handling it; batching adds up to one "
        "flush interval, more means the collector falls behind (or clocks disagree).",
    )
    for job in jobs:
        world.add_metric([job.job], job.world)
        if job.lag_seconds is not None:
            lag.add_metric([job.job], job.lag_seconds)
        if job.step is not None:
            step.add_metric([job.job], job.step)
        if job.loss is not None:
            loss.add_metric([job.job], job.loss)
        if job.grad_norm is not None:
            grad.add_metric([job.job], job.grad_norm)
        for group, value in enumerate(job.lr):
            lr.add_metric([job.job, str(group)], value)
        nonfinite.add_metric([job.job], job.nonfinite_layers)
        ranks.add_metric([job.job], job.ranks)
        seen.add_metric([job.job], job.last_seen)
        if job.eval_loss is not None:
            val.add_metric([job.job], job.eval_loss)
        if job.loss_scale is not None:
            scale.add_metric([job.job], job.loss_scale)
    yield from (step, loss, grad, lr, nonfinite, ranks, seen, val, scale, world, lag)


def _rank_families(jobs: list[JobView], cap: int) -> Iterator[Metric]:
    """Per-rank last-seen times, only for the ``cap`` ranks silent longest, plus job aggregates.

    Thousands of ranks would mean thousands of series per job; the ranks worth
    a series are the stragglers, and the oldest time covers the rest.
    """
    seen = GaugeMetricFamily(
        "gradwatch_rank_last_seen_timestamp_seconds",
        "Unix time the collector last heard from each rank; when capped, only the "
        "max_rank_series ranks silent longest (gradwatch_job_ranks counts them all).",
        labels=[JOB_LABEL, "rank"],
    )
    oldest = GaugeMetricFamily(
        "gradwatch_job_oldest_rank_last_seen_timestamp_seconds",
        "Unix time the collector last heard from the job's most silent rank "
        "(time() minus this is the worst rank's silence).",
        labels=[JOB_LABEL],
    )
    capped = GaugeMetricFamily(
        "gradwatch_rank_series_capped",
        "1 when the job has more ranks than max_rank_series and only the ranks silent "
        "longest are exposed.",
        labels=[JOB_LABEL],
    )
    for job in jobs:
        if not job.rank_last_seen:
            continue
        # The cap silent longest, without sorting every rank (16,384 in a 3D job).
        by_silence = heapq.nsmallest(
            cap, job.rank_last_seen.items(), key=lambda item: (item[1], item[0])
        )
        for r, when in sorted(by_silence):
            seen.add_metric([job.job, str(r)], when)
        oldest.add_metric([job.job], by_silence[0][1])
        capped.add_metric([job.job], float(len(job.rank_last_seen) > cap))
    yield from (seen, oldest, capped)


def _block_families(jobs: list[JobView], cap: int) -> Iterator[Metric]:
    """Per-block gradient norms (see ``gradwatch.collector.blocks``), the top ``cap`` per job."""
    norm = GaugeMetricFamily(
        "gradwatch_block_grad_norm",
        "Gradient L2 norm of each block (layer names cut after their first numeric part) at "
        "the job's latest step (assembled across ranks, else the reporting rank): sqrt of "
        "the sum of its layers' squared norms (NaN or +Inf when one of them is); when "
        "capped, the top max_block_series "
        "offenders: non-finite first, then the largest norms.",
        labels=[JOB_LABEL, "block"],
    )
    capped = GaugeMetricFamily(
        "gradwatch_block_series_capped",
        "1 when the job has more blocks than max_block_series and only the top offenders "
        "are exposed.",
        labels=[JOB_LABEL],
    )
    for job in jobs:
        if not job.layers or len(job.layers) != job.layer_norms.size:
            continue
        names, values = block_norms(job.layers, job.layer_norms)
        shown, shown_values = _top_layers(names, values, cap)
        for name, value in zip(shown, shown_values, strict=True):
            norm.add_metric([job.job, name], value)
        capped.add_metric([job.job], float(len(shown) < len(names)))
    yield from (norm, capped)


def _activation_families(jobs: list[JobView], cap: int) -> Iterator[Metric]:
    """Saturated and dead shares per hooked module: the ``cap`` highest of each per job."""
    sat = GaugeMetricFamily(
        "gradwatch_activation_saturated_fraction",
        "Share of tanh/sigmoid outputs pinned near their bounds, per module, at the latest "
        "cadence step (top modules per job).",
        labels=[JOB_LABEL, "module", "kind"],
    )
    dead = GaugeMetricFamily(
        "gradwatch_activation_dead_fraction",
        "Share of exact-zero ReLU-family outputs, per module, at the latest cadence step "
        "(top modules per job).",
        labels=[JOB_LABEL, "module", "kind"],
    )
    for job in jobs:
        for family, values in (
            (sat, [(a.sat_frac, a) for a in job.act if a.sat_frac is not None]),
            (dead, [(a.zero_frac, a) for a in job.act if a.zero_frac is not None]),
        ):
            for value, a in sorted(values, key=lambda pair: -pair[0])[:cap]:
                family.add_metric([job.job, a.module, a.kind], value)
    yield from (sat, dead)


def _ratio_family(jobs: list[JobView]) -> Metric:
    # The layer-ratio rule's own measure (modules in model order, zero and
    # non-finite ones skipped), so the dashboard shows what the rule judges.
    ratio = GaugeMetricFamily(
        "gradwatch_job_first_last_grad_ratio",
        "Grad norm of the first module over the last at the job's latest step "
        "(<0.01 vanishing, >100 exploding by the default rules).",
        labels=[JOB_LABEL],
    )
    for job in jobs:
        if len(job.layers) != job.layer_norms.size or job.layer_norms.size < 2:
            continue
        inverse, names, _ = _grouped(job.layers)
        modules = group_norms(inverse, job.layer_norms, len(names))
        usable = np.flatnonzero(np.isfinite(modules) & (modules > 0.0))
        if usable.size >= 2:
            with np.errstate(over="ignore"):  # inf is a fine answer here
                ratio.add_metric([job.job], float(modules[usable[0]] / modules[usable[-1]]))
    return ratio


@functools.lru_cache(maxsize=64)
def _grouped(layers: tuple[str, ...]) -> tuple[np.ndarray, list[str], np.ndarray]:
    """``group_layers``, once per layer list: an assembled job keeps one list step after step."""
    return group_layers(layers)


def _alert_families(jobs: list[JobView], firing: list[AlertLike]) -> Iterator[Metric]:
    now = GaugeMetricFamily(
        "gradwatch_alerts_firing",
        "Alerts firing now (one per incident, summed by labels).",
        labels=ALERT_LABELS,
    )
    # Two ranks may fire the same rule: one series per label set, never duplicates.
    counts = Counter((a.job, a.rule, a.category, a.severity) for a in firing)
    for labels, count in sorted(counts.items()):
        now.add_metric(list(labels), count)
    total = CounterMetricFamily(
        "gradwatch_alerts", "Transitions of alerts into firing.", labels=ALERT_LABELS
    )
    for job in jobs:
        for (rule, category, severity), count in sorted(job.alerts_fired.items()):
            total.add_metric([job.job, rule, category, severity], count)
    yield from (now, total)


def _sink_families(sinks: Sequence[Sink]) -> Iterator[Metric]:
    sent = CounterMetricFamily(
        "gradwatch_notifications",
        "Alert notifications by sink and final outcome.",
        labels=["sink", "outcome"],
    )
    retries = CounterMetricFamily(
        "gradwatch_notification_retries",
        "Extra delivery attempts after a failure.",
        labels=["sink"],
    )
    queued = GaugeMetricFamily(
        "gradwatch_notification_queue_length", "Notifications waiting to be sent.", labels=["sink"]
    )
    for sink in sinks:
        stats = sink.stats()
        for outcome in ("delivered", "dropped", "failed"):
            sent.add_metric([sink.name, outcome], getattr(stats, outcome))
        retries.add_metric([sink.name], stats.retries)
        queued.add_metric([sink.name], stats.queued)
    yield from (sent, retries, queued)


def _top_layers(
    layers: tuple[str, ...], norms: np.ndarray, cap: int
) -> tuple[list[str], list[float]]:
    """Layers (or blocks) in model order, at most ``cap``: non-finite first, then the largest."""
    first: dict[str, int] = {}
    for i, name in enumerate(layers):
        first.setdefault(name, i)  # a repeated name would make duplicate series
    index = np.fromiter(first.values(), dtype=np.int64, count=len(first))
    if len(index) > cap:
        values = norms[index]
        rank_key = np.where(np.isfinite(values), values, np.inf)
        index = np.sort(index[np.argsort(-rank_key, kind="stable")[:cap]])
    return [layers[i] for i in index.tolist()], norms[index].tolist()
