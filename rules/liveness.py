"""Liveness detectors (production practice): a hung job, a silent rank, a straggler.

They are per job, fed every rank's :class:`Liveness` about once a second by
``Engine.tick``, and name the bad rank in ``Finding.rank`` (the alert's rank).
Both use category ``stalled``: a silent rank stalls the whole job at its next
collective, and the action (look at that rank, restart) is the same.

* :class:`StalledDetector` -- heartbeats keep arriving but ``last_step``
  has not advanced for ``factor`` × the rank's median step time, and at
  least ``min_seconds`` (evaluation loops and checkpoint saves pause steps
  for minutes in healthy runs, and NCCL's own watchdog only fires after
  minutes). In a collective hang every rank stalls; the rank the alert names
  is the one *behind* (lowest ``last_step``; among equals, one that has not
  begun the next step while others have), which the others wait for.
* :class:`SilentRankDetector` -- a rank sent no heartbeat for
  ``silent_seconds`` while other ranks of the job still do (the agent beats
  every 2 s by default). All ranks silent is a finished job, not this rule.
* :class:`StragglerDetector` -- a rank's host time per step before the
  gradient sync stays ``factor`` x the job's median (category ``straggler``).

:class:`LivenessTracker` builds the :class:`Liveness` records from steps and
heartbeats; ``gradwatch replay`` uses it, and a collector can.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.step import Liveness, Step
from gradwatch.wire import columns as col


class StalledDetector:
    """Active while some rank heartbeats but its step has not advanced for too long.

    Example::

        det = StalledDetector(factor=20.0, min_seconds=300.0)
        finding = det.observe_liveness(engine_liveness)
        finding.rank, finding.evidence["seconds_since_step"]
    """

    @validated_params
    def __init__(
        self,
        *,
        factor: Annotated[float, Field(gt=0.0)] = 20.0,
        min_seconds: Annotated[float, Field(ge=0.0)] = 300.0,
        heartbeat_timeout: Annotated[float, Field(gt=0.0)] = 30.0,
        max_named: Annotated[int, Field(ge=1)] = 10,
    ) -> None:
        self.factor, self.min_seconds = factor, min_seconds
        self.heartbeat_timeout, self.max_named = heartbeat_timeout, max_named

    def limit(self, live: Liveness) -> float:
        """Seconds without a new step after which this rank counts as stalled."""
        if live.step_seconds is None or live.step_seconds <= 0:
            return self.min_seconds
        return max(self.min_seconds, self.factor * live.step_seconds)

    def observe_liveness(self, liveness: Sequence[Liveness]) -> Finding:
        """Judge every rank of one job at once; see the class docstring."""
        stalled = [
            live
            for live in liveness
            if live.now - live.last_heartbeat_time <= self.heartbeat_timeout
            and live.now - live.last_step_time > self.limit(live)
        ]
        if not stalled:
            return INACTIVE
        # The rank behind the others is the one they wait for: the lowest step, and
        # among equals one that has not begun the next step while others have
        # (they sit in its gradient all-reduce).
        culprit = min(
            stalled,
            key=lambda live: (live.last_step, _began_next(live), live.last_step_time, live.rank),
        )
        since = culprit.now - culprit.last_step_time
        ranks = sorted(live.rank for live in stalled)
        waiting = [
            live.rank
            for live in stalled
            if live.last_step == culprit.last_step and _began_next(live)
        ]
        behind = (
            f"; it has not started step {culprit.last_step + 1} while {len(waiting)} "
            "rank(s) already wait in it"
            if waiting and not _began_next(culprit)
            else ""
        )
        # The step in progress is the stuck one; last_step is the last that completed.
        stuck = culprit.last_step + 1
        summary = (
            f"rank {culprit.rank} is alive but stuck in step {stuck} (last completed: "
            f"{culprit.last_step}): no new step for {since:.0f}s (limit {self.limit(culprit):.0f}s)"
            f"{behind}; {len(stalled)} of {len(liveness)} rank(s) stalled -- a hung collective or "
            "data loader?"
        )
        evidence = {
            "rank": culprit.rank,
            "stuck_step": stuck,
            "last_step": culprit.last_step,
            "seconds_since_step": since,
            "limit_seconds": self.limit(culprit),
            "step_seconds": culprit.step_seconds,
            "stalled_ranks": ranks[: self.max_named],
            "waiting_ranks": sorted(waiting)[: self.max_named],
            "stalled": len(stalled),
            "ranks": len(liveness),
        }
        return Finding(True, summary, evidence, rank=culprit.rank)


class SilentRankDetector:
    """Active while a rank has sent nothing for ``silent_seconds`` and another rank still reports.

    Example::

        SilentRankDetector(silent_seconds=60.0).observe_liveness(liveness).rank
    """

    @validated_params
    def __init__(
        self,
        *,
        silent_seconds: Annotated[float, Field(gt=0.0)] = 60.0,
        max_named: Annotated[int, Field(ge=1)] = 10,
    ) -> None:
        self.silent_seconds, self.max_named = silent_seconds, max_named

    def observe_liveness(self, liveness: Sequence[Liveness]) -> Finding:
        """Judge every rank of one job at once; see the class docstring."""
        silent = [
            live for live in liveness if live.now - live.last_heartbeat_time > self.silent_seconds
        ]
        if not silent or len(silent) == len(liveness):
            return INACTIVE
        culprit = max(silent, key=lambda live: (live.now - live.last_heartbeat_time, -live.rank))
        quiet = culprit.now - culprit.last_heartbeat_time
        summary = (
            f"rank {culprit.rank} has been silent for {quiet:.0f}s (last at step "
            f"{culprit.last_step}) "
            f"while {len(liveness) - len(silent)} other rank(s) still report; crashed or cut off?"
        )
        evidence = {
            "rank": culprit.rank,
            "last_step": culprit.last_step,
            "seconds_silent": quiet,
            "silent_ranks": sorted(live.rank for live in silent)[: self.max_named],
            "silent": len(silent),
            "ranks": len(liveness),
        }
        return Finding(True, summary, evidence, rank=culprit.rank)


class StragglerDetector:
    """Active while a rank needs ``factor`` times longer per step than the job's typical rank.

    Synchronous ranks share one step time (each waits for the slowest at the
    gradient sync), so ranks are compared on the agent's host timings of the
    part of the step *before* they wait for each other, in this order:

    * ``data_seconds`` -- from the previous ``log()`` to the first training
      forward (waiting for data). No collective runs there under DDP or FSDP,
      so a slow data loader shows on its own rank only.
    * ``busy_seconds`` -- data plus forward passes. Under DDP the forward has
      no collective, so a slow *compute* rank shows here; under FSDP the
      forward's all-gathers make every rank wait for the slowest, so a compute
      straggler there is not visible to host timing.

    Where fewer than half the ranks report a measure (older agents), the median
    step time is compared instead, which tells stragglers apart in jobs whose
    ranks do not synchronise every step.

    Example::

        det = StragglerDetector(factor=2.0, min_excess_seconds=0.1)
        det.observe_liveness(engine_liveness).rank
    """

    @validated_params
    def __init__(
        self,
        *,
        factor: Annotated[float, Field(gt=1.0)] = 2.0,
        min_excess_seconds: Annotated[float, Field(ge=0.0)] = 0.1,
        min_ranks: Annotated[int, Field(ge=2)] = 2,
        max_named: Annotated[int, Field(ge=1)] = 10,
    ) -> None:
        self.factor, self.min_excess_seconds = factor, min_excess_seconds
        self.min_ranks, self.max_named = min_ranks, max_named

    def observe_liveness(self, liveness: Sequence[Liveness]) -> Finding:
        """Judge every rank of one job at once; see the class docstring."""
        measured = False
        for measure in ("data_seconds", "busy_seconds"):
            values = {
                live.rank: getattr(live, measure)
                for live in liveness
                if getattr(live, measure) is not None
            }
            if len(values) * 2 < len(liveness) or len(values) < self.min_ranks:
                continue
            measured = True
            slow = self._slow(values)
            if slow:
                return self._finding(measure, values, slow)
        if measured:
            return INACTIVE
        steps = {live.rank: live.step_seconds for live in liveness if live.step_seconds is not None}
        if len(steps) < self.min_ranks:
            return INACTIVE
        slow = self._slow(steps)
        return self._finding("step_seconds", steps, slow) if slow else INACTIVE

    def _slow(self, values: dict[int, float]) -> dict[int, tuple[float, float]]:
        """Ranks ``factor`` x and ``min_excess_seconds`` above the typical: (seconds, typical)."""
        ordered = sorted(values.values())
        typical = statistics.median(ordered)
        slow = {}
        for rank, seconds in values.items():
            # With two ranks the median includes the slow one: compare with the other.
            other = ordered[0] if len(ordered) == 2 and seconds == ordered[1] else typical
            if seconds >= self.factor * other and seconds - other >= self.min_excess_seconds:
                slow[rank] = (seconds, other)
        return slow

    def _finding(
        self, measure: str, values: dict[int, float], slow: dict[int, tuple[float, float]]
    ) -> Finding:
        culprit = max(slow, key=lambda rank: (slow[rank][0], -rank))
        seconds, other = slow[culprit]
        what = {
            "data_seconds": "waiting for data before its forward",
            "busy_seconds": "before the gradient sync (data + forward)",
        }.get(measure, "per step")
        summary = (
            f"rank {culprit} is a straggler: {seconds:.3f}s per step {what} against a typical "
            f"{other:.3f}s across {len(values)} ranks; {len(slow)} rank(s) slow -- the others "
            "wait for it every step (slow data loading, a throttled or shared device?)"
        )
        evidence = {
            "rank": culprit,
            "measure": measure,
            "seconds": seconds,
            "typical_seconds": other,
            "ratio": seconds / other if other > 0 else None,
            "slow_ranks": sorted(slow)[: self.max_named],
            "slow": len(slow),
            "ranks": len(values),
        }
        return Finding(True, summary, evidence, rank=culprit)


# The phases before the gradient sync, summed per step (collector/rows.py reads them too).
PRE_SYNC_PHASES = (col.DATA_SECONDS_SCALAR, col.FORWARD_SECONDS_SCALAR)
RECENT_STEPS = 32  # steps behind a rank's median timings


@dataclass(slots=True)
class PhaseTimes:
    """A rank's recent host seconds per step waiting for data, and before the gradient
    sync (data wait + forward), as its agent measured them; medians for ``Liveness``.

    Example::

        phases = PhaseTimes()
        phases.observe(step)  # reads the data_seconds / forward_seconds scalars
        phases.data_seconds, phases.busy_seconds
    """

    data: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    busy: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def observe(self, step: Step) -> None:
        data = step.scalars.get(col.DATA_SECONDS_SCALAR)
        if data is not None:
            self.data.append(data)
        phases = [step.scalars[name] for name in PRE_SYNC_PHASES if name in step.scalars]
        if phases:
            self.busy.append(sum(phases))

    @property
    def data_seconds(self) -> float | None:
        return statistics.median(self.data) if self.data else None

    @property
    def busy_seconds(self) -> float | None:
        return statistics.median(self.busy) if self.busy else None


def _began_next(live: Liveness) -> bool:
    return live.started is not None and live.started > live.last_step


@dataclass(slots=True)
class _Rank:
    last_step: int = -1
    last_step_time: float = 0.0
    last_heartbeat_time: float = 0.0
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    started: int | None = None


class LivenessTracker:
    """Builds per-rank :class:`Liveness` of one job from the steps and heartbeats seen.

    A step counts as a heartbeat too. ``step_seconds`` is the median of the
    last 32 per-step intervals between advancing steps.

    Example::

        tracker = LivenessTracker("run-42")
        tracker.step(rank=0, step=10, time=12.5)
        engine.tick(tracker.snapshot(now=13.0))
    """

    def __init__(self, job: str) -> None:
        self.job = job
        self._ranks: dict[int, _Rank] = {}

    def step(self, rank: int, step: int, time: float, record: Step | None = None) -> None:
        """A step record of ``rank`` arrived at ``time`` (``record``: its step phases)."""
        state = self._ranks.setdefault(rank, _Rank(last_step_time=time))
        if record is not None:
            state.phases.observe(record)
        if step > state.last_step:
            if state.last_step >= 0 and time > state.last_step_time:
                state.intervals.append((time - state.last_step_time) / (step - state.last_step))
            state.last_step, state.last_step_time = step, time
        state.last_heartbeat_time = max(state.last_heartbeat_time, time)

    def heartbeat(self, rank: int, step: int, time: float, started: int | None = None) -> None:
        """A heartbeat of ``rank`` arrived at ``time`` (``step``: its latest step then)."""
        state = self._ranks.setdefault(rank, _Rank(last_step_time=time))
        state.started = started
        state.last_heartbeat_time = max(state.last_heartbeat_time, time)
        if step > state.last_step:
            state.last_step, state.last_step_time = step, time

    def snapshot(self, now: float) -> list[Liveness]:
        """Every known rank's progress at ``now``."""
        return [
            Liveness(
                job=self.job,
                rank=rank,
                now=now,
                last_step=s.last_step,
                last_step_time=s.last_step_time,
                last_heartbeat_time=s.last_heartbeat_time,
                step_seconds=statistics.median(s.intervals) if s.intervals else None,
                started=s.started,
                data_seconds=s.phases.data_seconds,
                busy_seconds=s.phases.busy_seconds,
            )
            for rank, s in sorted(self._ranks.items())
        ]
