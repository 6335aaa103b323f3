"""Two live agents reporting as one rank of one job: counted and logged, not merged silently.

A process that restarts leaves its old agent behind for good: the rank's heartbeats move
from one incarnation to the next and never go back. Two processes that both call
``watch()`` without ``rank=`` take turns instead (pytorch/examples' mnist_hogwild: two
processes train one shared model, both as rank 0): A, B, A, B. Their steps then reach the
rules as one interleaved stream (each step number twice, two processes' losses mixed),
and liveness reads every switch as a restart. The collector cannot tell the two apart
after the fact, so it says so, with who and what to do, and counts it per job
(``gradwatch_ingest_twin_agents``).

Example::

    twins = TwinRanks()
    for hb in heartbeats:
        other = twins.heartbeat(hb.job, hb.rank, hb.incarnation)
"""

from __future__ import annotations

from collections import Counter, OrderedDict

# (job, rank) pairs remembered, least recently heard dropped first: bounded whatever
# senders claim (collector/limits.py bounds jobs and ranks before this).
MAX_RANKS = 65_536
# A rank's heartbeats going back to an earlier incarnation this many times is two live
# agents; once could be one heartbeat of a dying process delivered late.
RETURNS = 2


class TwinRanks:
    """Per (job, rank): the incarnation heard last and the one before it."""

    def __init__(self, max_ranks: int = MAX_RANKS) -> None:
        self._max = max_ranks
        self._heard: OrderedDict[tuple[str, int], tuple[str, str | None, int]] = OrderedDict()
        self.counts: Counter[str] = Counter()  # heartbeats of confirmed twins, by job

    def heartbeat(self, job: str, rank: int, incarnation: str) -> str | None:
        """The other live incarnation of this rank, once it has taken turns ``RETURNS``
        times with ``incarnation``; otherwise None."""
        key = (job, rank)
        entry = self._heard.get(key)
        if entry is None:
            self._heard[key] = (incarnation, None, 0)
            if len(self._heard) > self._max:
                self._heard.popitem(last=False)
            return None
        self._heard.move_to_end(key)
        current, previous, returns = entry
        if incarnation == current:
            return None
        if incarnation == previous:
            returns += 1
        self._heard[key] = (incarnation, current, returns)
        if returns < RETURNS:
            return None
        self.counts[job] += 1
        return current
