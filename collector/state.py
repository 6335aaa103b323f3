"""What the collector remembers about each job, bounded in size and in time.

Per job and rank: the last step, loss and total grad norm, heartbeats, when
the rank was last heard from and when its step last advanced, and its recent
step timings (``liveness()`` makes the rules' ``Liveness`` of these). No step
history is kept per rank: at 1,024 ranks x 1,000 layers that alone was over a
GiB. Per job: the latest assembled step of a multi-rank job
(``observe_assembled``), checkpoints and evaluations (from events) and how many
times each alert fired.
A job silent for longer than ``job_ttl_seconds`` is forgotten entirely, so its
metric series disappear with it (no stale gauges).

The ingest thread writes; the scrape thread reads ``snapshot()``. Both go
through one lock, held only for short, bounded work.

Example::

    from gradwatch.collector.state import StateStore
    from gradwatch.rules.step import Step

    store = StateStore(job_ttl_seconds=600, clock=lambda: 0.0)
    store.observe_step(Step(job="run-1", step=3, time=0.0, loss=2.0))
    assert store.snapshot()[0].step == 3
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from gradwatch.rules.liveness import PhaseTimes
from gradwatch.rules.step import (
    ActStats,
    Eval,
    Liveness,
    QuietRows,
    Stats,
    Step,
    build_liveness,
    nonfinite_layers,
)
from gradwatch.wire import Event, Heartbeat
from gradwatch.wire.messages import CLOSED_NOTE

MAX_CHECKPOINTS = 64
MAX_EVALS = 256
STEP_INTERVALS = 32  # per-step intervals behind a rank's median step time


class AlertLike(Protocol):
    """The fields of ``gradwatch.rules.Alert`` that state and exposition read."""

    job: str
    rule: str
    category: str
    severity: str


class TransitionLike(Protocol):
    alert: Any
    previous: str
    current: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint the agent reported saving (``mon.checkpoint_saved``)."""

    step: int
    path: str
    time: float
    rank: int


@dataclass(slots=True)
class RankState:
    """One rank's latest signals and recent timings."""

    last_seen: float
    latest: Step | None = None
    last_loss: float | None = None
    last_grad_norm: float | None = None
    nonfinite: frozenset[str] = frozenset()
    incarnation: str | None = None
    heartbeat_time: float | None = None
    heartbeat_step: int | None = None
    started: int | None = None  # the heartbeat's: the step whose forward began
    lag: float | None = None  # collector clock minus agent time of the newest step
    closed: bool = False  # the agent said it closed (and has not reported since)
    # Progress for liveness: the highest step known from steps or heartbeats,
    # when (collector clock) it last advanced, and recent seconds per step
    # measured on the agent's clock (a batch arrives all at once).
    progress: int | None = None
    progress_time: float = 0.0
    step_intervals: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_INTERVALS))
    phases: PhaseTimes = field(default_factory=PhaseTimes)  # the agent's step timings
    # The medians of step_intervals and phases (step, data, busy seconds), or None
    # when either changed since: liveness() runs every second over every rank
    # (16,384 medians of 32 values took ~70% of a 0.1-0.27 s tick, issue 17).
    timings: tuple[float | None, float | None, float | None] | None = None

    def medians(self) -> tuple[float | None, float | None, float | None]:
        if self.timings is None:
            intervals = self.step_intervals
            self.timings = (
                statistics.median(intervals) if intervals else None,
                self.phases.data_seconds,
                self.phases.busy_seconds,
            )
        return self.timings

    def advance(self, step: int, now: float) -> None:
        if self.progress is None or step > self.progress:
            self.progress, self.progress_time = step, now

    @property
    def last_step(self) -> int | None:
        return None if self.latest is None else self.latest.step


@dataclass(slots=True)
class JobState:
    """Everything kept about one job."""

    job: str
    last_seen: float
    ranks: dict[int, RankState] = field(default_factory=dict)
    whole: Step | None = None  # the newest assembled step (multi-rank jobs)
    checkpoints: deque[Checkpoint] = field(default_factory=lambda: deque(maxlen=MAX_CHECKPOINTS))
    evals: deque[Event] = field(default_factory=lambda: deque(maxlen=MAX_EVALS))
    alerts_fired: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    eval_loss: float | None = None  # the newest finite eval loss of the lowest rank
    eval_rank: int | None = None
    act: tuple[ActStats, ...] = ()  # the lowest rank's latest activation statistics
    act_rank: int | None = None

    def rank(self, rank: int, now: float) -> RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(now)
        state.last_seen = now
        state.closed = False  # anything after a "closed" note: the rank is back
        self.last_seen = now
        return state

    def lead(self) -> RankState | None:
        """The lowest rank that has reported a step: the job's reporting rank."""
        stepped = [r for r in sorted(self.ranks) if self.ranks[r].latest is not None]
        return self.ranks[stepped[0]] if stepped else None

    def last_checkpoint_before(self, step: int) -> Checkpoint | None:
        """The newest checkpoint saved strictly before ``step``: the last good one."""
        before = [c for c in self.checkpoints if c.step < step]
        return max(before, key=lambda c: c.step) if before else None


@dataclass(frozen=True, slots=True)
class JobView:
    """An immutable per-job summary, taken under the lock, rendered after."""

    job: str
    step: int | None
    loss: float | None
    grad_norm: float | None
    lr: tuple[float, ...]
    nonfinite_layers: int
    ranks: int
    last_seen: float
    layers: tuple[str, ...]
    layer_norms: np.ndarray
    alerts_fired: Mapping[tuple[str, str, str], int]
    loss_scale: float | None = None
    eval_loss: float | None = None
    rank_last_seen: Mapping[int, float] = field(default_factory=dict)
    act: tuple[ActStats, ...] = ()
    world: int = 1
    assembled: bool = False  # step, loss, norms are the job's assembled step
    lag_seconds: float | None = None  # the largest per-rank ingest lag


class StateStore:
    """All jobs' state; thread-safe; forgets silent jobs on ``expire()``."""

    def __init__(
        self,
        job_ttl_seconds: float = 600.0,
        clock: Callable[[], float] = time.time,
        finished_grace_seconds: float = 60.0,
    ) -> None:
        self.job_ttl_seconds = job_ttl_seconds
        self.finished_grace_seconds = finished_grace_seconds
        self._clock = clock
        self._jobs: dict[str, JobState] = {}
        self._lock = threading.Lock()

    def observe_step(self, step: Step) -> None:
        with self._lock:
            now = self._clock()
            rank = self._job(step.job).rank(step.rank, now)
            rank.phases.observe(step)
            rank.timings = None
            # Ranks may deliver out of order across batches; "latest" is by step.
            if rank.latest is None or step.step >= rank.latest.step:
                previous = rank.latest
                if previous is not None and step.step > previous.step and step.time > previous.time:
                    rank.step_intervals.append(
                        (step.time - previous.time) / (step.step - previous.step)
                    )
                rank.latest = step
                rank.nonfinite = nonfinite_layers(step)
            if step.loss is not None:
                rank.last_loss = step.loss
            if step.grad_norm is not None:
                rank.last_grad_norm = step.grad_norm
            rank.advance(step.step, now)

    def observe_quiet(self, rows: QuietRows) -> None:
        """``observe_step`` of every row of a batch without layers, then ``observe_lag``.

        The same state as those calls with each row's ``Step``, in row order, but
        only the rank's newest row becomes a ``Step`` (the one kept as ``latest``):
        16,352 of a 16,384-rank job's batches are like this (issue 17).
        """
        with self._lock:
            now = self._clock()
            rank = self._job(rows.job).rank(rows.rank, now)
            phases = rank.phases  # as PhaseTimes.observe, from the rows' columns
            rank.timings = None
            latest = rank.latest
            top = None if latest is None else latest.step
            top_time = 0.0 if latest is None else latest.time
            newest = -1
            intervals = rank.step_intervals
            loss, grad_norm = rank.last_loss, rank.last_grad_norm
            for r, step in enumerate(rows.steps):
                when = rows.times[r]
                data, busy = rows.data[r], rows.busy[r]
                if data is not None:
                    phases.data.append(data)
                if busy is not None:
                    phases.busy.append(busy)
                # As observe_step: "latest" is by step, intervals between advancing steps.
                if top is None or step >= top:
                    if top is not None and step > top and when > top_time:
                        intervals.append((when - top_time) / (step - top))
                    top, top_time, newest = step, when, r
                if rows.loss[r] is not None:
                    loss = rows.loss[r]
                if rows.grad_norm[r] is not None:
                    grad_norm = rows.grad_norm[r]
            rank.advance(max(rows.steps), now)  # as each row's would: now is one for all
            rank.last_loss, rank.last_grad_norm = loss, grad_norm
            if newest >= 0:
                rank.latest = rows.step(newest)
                rank.nonfinite = frozenset()  # nonfinite_layers of a step without layers
            rank.lag = self._clock() - max(rows.times)

    def observe_heartbeat(self, hb: Heartbeat) -> None:
        with self._lock:
            now = self._clock()
            rank = self._job(hb.job).rank(hb.rank, now)
            if rank.incarnation is not None and hb.incarnation != rank.incarnation:
                # A restarted process (maybe resumed from an earlier step) progresses anew.
                rank.progress = None
                rank.step_intervals.clear()
                rank.timings = None
            rank.incarnation = hb.incarnation
            rank.heartbeat_time = now
            rank.heartbeat_step = hb.step
            rank.started = hb.started
            if hb.step > 0:  # 0 is "no step yet": a slow start (compile, data) is no hang
                rank.advance(hb.step, now)

    def observe_lag(self, newest: Step) -> None:
        """A batch was handled: its newest row's age is the rank's ingest lag.

        Set once per batch, from its newest row: the older rows of a batch are
        older by design (the agent batches), not because the collector is behind.
        """
        with self._lock:
            job = self._jobs.get(newest.job)
            rank = job.ranks.get(newest.rank) if job is not None else None
            if rank is not None:
                rank.lag = self._clock() - newest.time

    def observe_assembled(self, step: Step) -> None:
        """Keep a multi-rank job's newest assembled step: its gauges report it."""
        with self._lock:
            job = self._job(step.job)
            if job.whole is None or step.step >= job.whole.step:
                job.whole = step

    def observe_event(self, event: Event) -> None:
        with self._lock:
            job = self._job(event.job)
            rank = job.rank(event.rank, self._clock())
            rank.closed = event.kind == "note" and event.fields.get("note") == CLOSED_NOTE
            if event.kind == "checkpoint":
                path = event.fields.get("path")
                job.checkpoints.append(
                    Checkpoint(
                        event.step, path if isinstance(path, str) else "", event.time, event.rank
                    )
                )
            elif event.kind == "eval":
                job.evals.append(event)

    def observe_eval(self, ev: Eval) -> None:
        """Keep the newest finite eval loss (of the lowest-numbered rank that reports one)."""
        if ev.loss is None or not np.isfinite(ev.loss):
            return
        with self._lock:
            job = self._job(ev.job)
            if job.eval_rank is None or ev.rank <= job.eval_rank:
                job.eval_loss, job.eval_rank = ev.loss, ev.rank

    def eval_to_judge(self, ev: Eval) -> Eval | None:
        """``ev`` as the rules should judge it, or None to leave it to another rank.

        A job judged per rank: as is. A multi-rank job is judged as a whole:
        only the evals of its lowest eval-reporting rank count, marked job-wide.
        Call after :meth:`observe_eval`.
        """
        with self._lock:
            job = self._jobs.get(ev.job)
            if job is None or job.whole is None:
                return ev
            lead = job.eval_rank  # None when no finite eval loss arrived yet
            return replace(ev, assembled=1) if lead is None or ev.rank <= lead else None

    def observe_stats(self, stats: Stats) -> None:
        """Keep the latest activation statistics (of the lowest-numbered rank)."""
        if not stats.act:
            return
        with self._lock:
            job = self._job(stats.job)
            if job.act_rank is None or stats.rank <= job.act_rank:
                job.act, job.act_rank = stats.act, stats.rank

    def record_transition(self, transition: TransitionLike) -> None:
        """Count transitions into ``firing`` (``gradwatch_alerts_total``)."""
        if transition.current != "firing" or transition.previous == "firing":
            return
        alert = transition.alert
        with self._lock:
            job = self._jobs.get(alert.job)
            if job is not None:
                job.alerts_fired[(alert.rule, alert.category, alert.severity)] += 1

    def liveness(self) -> list[Liveness]:
        """Every rank's progress now, for ``Engine.tick``: ranks that reported a step or heartbeat.

        Any message from a rank counts as a heartbeat (``last_seen``); the
        step time is the median of the rank's recent per-step intervals.
        """
        with self._lock:
            now = self._clock()
            out = []
            for name, job in sorted(self._jobs.items()):
                for r, rank in sorted(job.ranks.items()):
                    # A closed rank finished: its last note is no heartbeat of a live process.
                    if rank.progress is None or rank.closed:
                        continue
                    step_seconds, data_seconds, busy_seconds = rank.medians()
                    out.append(
                        build_liveness(
                            name,
                            r,
                            now,
                            rank.progress,
                            rank.progress_time,
                            rank.last_seen,
                            step_seconds,
                            rank.started,
                            data_seconds,
                            busy_seconds,
                        )
                    )
            return out

    def expire(self) -> list[str]:
        """Forget finished and silent jobs; return their names.

        Finished: every rank's agent closed and ``finished_grace_seconds`` passed
        (long enough for Prometheus to scrape the final values). Silent: nothing
        heard for ``job_ttl_seconds`` (a crash, or agents that never close).
        """
        with self._lock:
            now = self._clock()
            cutoff, finished = now - self.job_ttl_seconds, now - self.finished_grace_seconds
            gone = [
                name
                for name, job in self._jobs.items()
                if job.last_seen < cutoff
                or (
                    job.last_seen < finished
                    and job.ranks
                    and all(r.closed for r in job.ranks.values())
                )
            ]
            for name in gone:
                del self._jobs[name]
        return gone

    def job(self, name: str) -> JobState | None:
        """The live state of one job; read it only from the ingest thread."""
        with self._lock:
            return self._jobs.get(name)

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def snapshot(self) -> list[JobView]:
        """Per-job summaries sorted by job name, for one scrape."""
        with self._lock:
            return [_view(self._jobs[name]) for name in sorted(self._jobs)]

    def _job(self, name: str) -> JobState:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = JobState(name, self._clock())
        return job


def _view(job: JobState) -> JobView:
    lead = job.lead()
    whole = job.whole
    latest = whole if whole is not None else lead.latest if lead is not None else None
    steps = [r.latest.step for r in job.ranks.values() if r.latest is not None]
    if whole is not None:
        bad, loss, grad_norm = nonfinite_layers(whole), whole.loss, whole.grad_norm
    else:
        bad = frozenset().union(*(rank.nonfinite for rank in job.ranks.values()))
        loss = lead.last_loss if lead is not None else None
        grad_norm = lead.last_grad_norm if lead is not None else None
    lags = [r.lag for r in job.ranks.values() if r.lag is not None]
    return JobView(
        job=job.job,
        step=max(steps) if steps else None,
        loss=loss,
        grad_norm=grad_norm,
        lr=latest.lr if latest is not None else (),
        nonfinite_layers=len(bad),
        ranks=len(job.ranks),
        last_seen=job.last_seen,
        layers=latest.layers if latest is not None else (),
        layer_norms=latest.layer_norms if latest is not None else np.zeros(0),
        alerts_fired=dict(job.alerts_fired),
        loss_scale=latest.loss_scale if latest is not None else None,
        eval_loss=job.eval_loss,
        rank_last_seen={r: rank.last_seen for r, rank in sorted(job.ranks.items())},
        act=job.act,
        world=latest.world if latest is not None else 1,
        assembled=whole is not None,
        lag_seconds=max(lags) if lags else None,
    )
