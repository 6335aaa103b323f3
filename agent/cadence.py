"""Which steps are cadence-statistics steps: dense at the start, then every ``stats_every``.

Cadence-fed rules (update ratios, frozen layers, activations, the census)
can only alert on a sample, so a schedule of one sample per ``stats_every``
(50) steps answers a fault present from step 1 a hundred steps late. The
default schedule is dense where faults are likeliest and cheapest to catch
(the start of a run, and again after :meth:`Cadence.restart`, which
``Monitor.data_changed`` calls), then backs off geometrically: the gap after
a sample ``k`` steps past the origin is ``clamp(k // BACKOFF, 1, stats_every)``.
With ``stats_every`` 50 that samples steps 1-8, 10, 12, 15, 18, 22, 27, 33, 41,
51, 63, ... and reaches the full gap near step 235: 22 samples where the plain
schedule takes 5, so a fault at step ``t`` is sampled within ``max(1, t // 4)``
steps (within 20 steps up to step 80) and later within ``stats_every``.

:meth:`Cadence.force_next` lets a cheap per-step check (the census's
``model.training``) pull the next sample forward.

Example::

    >>> from gradwatch.agent.cadence import Cadence
    >>> c = Cadence(stats_every=50)
    >>> [s for s in range(1, 40) if c.due(s)]
    [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 18, 22, 27, 33]
    >>> plain = Cadence(stats_every=3, early=False)
    >>> [s for s in range(1, 10) if plain.due(s)]
    [3, 6, 9]
"""

from __future__ import annotations

# Gap after a sample = steps since the origin // BACKOFF: samples grow ~25% apart.
BACKOFF = 4
_NEVER = float("inf")  # next_step while no sample is scheduled


class Cadence:
    """The cadence schedule of one monitor (training thread only).

    ``due(step)`` is asked once per step, in step order, before the step runs
    (the monitor arms the activation hooks for it); ``force_next`` and
    ``restart`` change the answer for later steps.
    """

    def __init__(self, stats_every: int, early: bool = True) -> None:
        self.every = stats_every
        self.early = early
        self._origin = 0  # the step the dense start counts from
        # The next scheduled statistics step, and whether a force is pending (the
        # monitor checks it again at the optimizer step). Plain attributes: the
        # monitor reads both on every step and asks due() only when one says so.
        self.next_step: float = (1 if early else stats_every) if stats_every else _NEVER
        self.forced = False

    def due(self, step: int) -> bool:
        """Whether ``step`` is a statistics step; advances the schedule past it.

        Never true for a step below ``next_step`` while no force is pending."""
        if not self.every:
            self.next_step, self.forced = _NEVER, False  # switched off (or never on)
            return False
        if self.forced:
            self.forced = False
            if step >= self.next_step:
                self._advance(step)
            return True
        if step < self.next_step:
            return False
        self._advance(step)
        return True

    def force_next(self) -> None:
        """Make the next step asked about a statistics step (one bool store; cheap)."""
        self.forced = True

    def take_forced(self) -> bool:
        """Consume a pending force for the step running now; True if there was one."""
        forced, self.forced = self.forced, False
        return forced

    def restart(self, step: int) -> None:
        """Sample densely again from ``step`` on (a data or task change before it)."""
        if self.early and self.every:
            self._origin = step - 1
            self.next_step = min(self.next_step, step)

    def _advance(self, step: int) -> None:
        if not self.early:
            self.next_step = (step // self.every + 1) * self.every
            return
        gap = min(self.every, max(1, (step - self._origin) // BACKOFF))
        self.next_step = step + gap
