"""Liveness detectors (production practice): a hung job, a silent rank.

They are per job, fed every rank's :class:`Liveness` about once a second by
``Engine.tick``, and name the bad rank in ``Finding.rank`` (the alert's rank).
Both use category ``stalled``: a silent rank stalls the whole job at its next
collective, and the action (look at that rank, restart) is the same.

* :class:`StalledDetector` -- heartbeats keep arriving but ``last_step``
  has not advanced for ``factor`` × the rank's median step time, and at
  least ``min_seconds`` (evaluation loops and checkpoint saves pause steps
  for minutes in healthy runs, and NCCL's own watchdog only fires after
  minutes). In a collective hang every rank stalls; the rank the alert names
  is the one *behind* (lowest ``last_step``), which the others wait for.
* :class:`SilentRankDetector` -- a rank sent no heartbeat for
  ``silent_seconds`` while other ranks of the job still do (the agent beats
  every 2 s by default). All ranks silent is a finished job, not this rule.

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
from gradwatch.rules.step import Liveness


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
            live for live in liveness
            if live.now - live.last_heartbeat_time <= self.heartbeat_timeout
            and live.now - live.last_step_time > self.limit(live)
        ]
        if not stalled:
            return INACTIVE
        # The rank behind the others is the one they wait for.
        culprit = min(stalled, key=lambda live: (live.last_step, live.last_step_time))
        since = culprit.now - culprit.last_step_time
        ranks = sorted(live.rank for live in stalled)
        summary = (
            f"rank {culprit.rank} is alive but stalled at step {culprit.last_step}: no new step for "
            f"{since:.0f}s (limit {self.limit(culprit):.0f}s); {len(stalled)} of {len(liveness)} "
            "rank(s) stalled -- a hung collective or data loader?"
        )
        evidence = {
            "rank": culprit.rank,
            "last_step": culprit.last_step,
            "seconds_since_step": since,
            "limit_seconds": self.limit(culprit),
            "step_seconds": culprit.step_seconds,
            "stalled_ranks": ranks[: self.max_named],
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
        silent = [live for live in liveness if live.now - live.last_heartbeat_time > self.silent_seconds]
        if not silent or len(silent) == len(liveness):
            return INACTIVE
        culprit = max(silent, key=lambda live: (live.now - live.last_heartbeat_time, -live.rank))
        quiet = culprit.now - culprit.last_heartbeat_time
        summary = (
            f"rank {culprit.rank} has been silent for {quiet:.0f}s (last at step {culprit.last_step}) "
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


@dataclass(slots=True)
class _Rank:
    last_step: int = -1
    last_step_time: float = 0.0
    last_heartbeat_time: float = 0.0
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=32))


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

    def step(self, rank: int, step: int, time: float) -> None:
        """A step record of ``rank`` arrived at ``time``."""
        state = self._ranks.setdefault(rank, _Rank(last_step_time=time))
        if step > state.last_step:
            if state.last_step >= 0 and time > state.last_step_time:
                state.intervals.append((time - state.last_step_time) / (step - state.last_step))
            state.last_step, state.last_step_time = step, time
        state.last_heartbeat_time = max(state.last_heartbeat_time, time)

    def heartbeat(self, rank: int, step: int, time: float) -> None:
        """A heartbeat of ``rank`` arrived at ``time`` (``step``: its latest step then)."""
        state = self._ranks.setdefault(rank, _Rank(last_step_time=time))
        state.last_heartbeat_time = max(state.last_heartbeat_time, time)
        if step > state.last_step:
            state.last_step, state.last_step_time = step, time

    def snapshot(self, now: float) -> list[Liveness]:
        """Every known rank's progress at ``now``."""
        return [
            Liveness(job=self.job, rank=rank, now=now, last_step=s.last_step,
                     last_step_time=s.last_step_time, last_heartbeat_time=s.last_heartbeat_time,
                     step_seconds=statistics.median(s.intervals) if s.intervals else None)
            for rank, s in sorted(self._ranks.items())
        ]
