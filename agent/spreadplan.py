"""Which part of a spread cadence sample each of its steps measures.

A cadence sample is a handful of units of work, each a few tensor operations that cost 10-70 us
apiece on the cold cache a backward pass leaves: the weight norms, read a phase at a
time (agent/weightstats.py), the update ratios of each group of layers
(agent/updateratios.py; gathered around one optimizer step), the activation hooks of
each group of modules (agent/activations.py; armed for one forward pass), then the
ratios' arithmetic over every group's samples at once (``ratio_finish``: each
group's step only gathers), turning the hooks' sums into statistics (``snapshot``)
and queueing the sample (``ship``). Where the next sample is far enough away, the
units go to consecutive steps one each, so that no step pays more than its largest
unit (issue 19: every step's cost, not the median); where it is closer, they are
packed evenly into the steps there are, in an order that mixes the kinds, so that no
step gets two of the heaviest.

Example::

    >>> from gradwatch.agent.spreadplan import plan
    >>> parts = plan(steps=50, weight_phases=2, ratio_groups=3, hook_groups=1)
    >>> len(parts), parts[-1].ship, parts[-2].snapshot
    (9, True, True)
    >>> [(p.weights, p.ratios, p.hooks) for p in plan(4, 2, 3, 1)][:2]
    [(1, (0, 1), None), (0, (1, 2), None)]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# A run [a, b) of consecutive groups (of layers, or of activation modules), or None.
Run = tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Part:
    """What one step of a spread sample measures, in the order the step does it."""

    hooks: Run = None  # activation-module groups hooked in its forward pass
    ratios: Run = None  # layer groups whose update ratios it gathers around its update
    weights: int = 0  # weight-norm phases it reads
    ratio_finish: Run = None  # layer groups whose gathered samples become ratios
    snapshot: bool = False  # the activation sums become the sample's statistics
    ship: bool = False  # the sample is queued for the shipper: its last part


# The ratio arithmetic is cut into a unit per this many groups: over all 32 groups of
# the GPT benchmark it is ~0.45 ms on one step (benchmarks/agent_calls.py).
FINISH_GROUPS = 8


def finish_units(ratio_groups: int) -> int:
    """The ratio arithmetic's units: one per FINISH_GROUPS groups (one at least)."""
    return max(1, -(-ratio_groups // FINISH_GROUPS))


def units(weight_phases: int, ratio_groups: int, hook_groups: int) -> int:
    """The number of steps a sample takes when each carries one unit of work."""
    return weight_phases + ratio_groups + hook_groups + finish_units(ratio_groups) + 2


@functools.lru_cache(maxsize=64)  # a sample's plan depends on the gap only: made once
def plan(steps: int, weight_phases: int, ratio_groups: int, hook_groups: int) -> tuple[Part, ...]:
    """The parts of a sample spread over at most ``steps`` steps (at least 1).

    With room for every unit on its own step, the measuring units go one per
    step, the kinds interleaved (each kind's units evenly across the run), then
    the ratio arithmetic, the snapshot and the ship on steps of their own; where
    the ratio groups alone do not fit, a unit gathers ``k`` consecutive groups,
    ``k`` the least that fits (at most twice what packing puts on a step). With
    less room still, each kind is
    spread evenly over all the steps on its own, its runs offset from the other
    kinds' (so their units fall on different steps where they can), and the
    last three go with the last step's units: within a step the
    forward's hooks, the update's ratios and ``log()``'s reads come before them.
    """
    fixed = weight_phases + hook_groups + finish_units(ratio_groups) + 2
    per = next((k for k in range(1, ratio_groups + 1) if fixed + -(-ratio_groups // k) <= steps), 0)
    # Packing spreads about R / steps groups on each step: coarser units than twice
    # that would make a heavier step than packing does.
    if per and per <= 2 * -(-ratio_groups // max(1, steps)):
        counts = {"w": weight_phases, "r": -(-ratio_groups // per), "h": hook_groups}
        order = sorted(
            ((i + 0.5) / count, j, name, i)
            for j, (name, count) in enumerate(counts.items())
            for i in range(count)
        )
        bins = [
            [("r", g) for g in range(i * per, min(ratio_groups, (i + 1) * per))]
            if name == "r"
            else [(name, i)]
            for _, _, name, i in order
        ]
        bins += [[("q", i)] for i in range(finish_units(ratio_groups))]
        bins += [[("s", 0)], [("ship", 0)]]
    else:
        counts = {"w": weight_phases, "r": ratio_groups, "h": hook_groups}
        s = max(1, steps)
        bins = [[] for _ in range(s)]
        for offset, (name, count) in zip((0.0, 1 / 3, 2 / 3), counts.items(), strict=True):
            for i in range(count):
                bins[int((i + offset) * s / count)].append((name, i))
        bins[-1] += [("q", -1), ("s", 0), ("ship", 0)]  # every group's arithmetic at once
    return tuple(_part(units_, ratio_groups) for units_ in bins)


def _part(todo: list[tuple[str, int]], ratio_groups: int) -> Part:
    weights = sum(1 for name, _ in todo if name == "w")
    return Part(
        hooks=_run([i for name, i in todo if name == "h"]),
        ratios=_run([i for name, i in todo if name == "r"]),
        weights=weights,
        ratio_finish=_finish_run([i for name, i in todo if name == "q"], ratio_groups),
        snapshot=any(name == "s" for name, _ in todo),
        ship=any(name == "ship" for name, _ in todo),
    )


def _finish_run(chunks: list[int], ratio_groups: int) -> Run:
    """The layer groups of a step's ratio-arithmetic unit: chunk ``i`` covers groups
    [i * FINISH_GROUPS, (i + 1) * FINISH_GROUPS); chunk -1 (a packed plan's) all."""
    if not chunks:
        return None
    if chunks == [-1]:
        return (0, ratio_groups)
    return (chunks[0] * FINISH_GROUPS, min(ratio_groups, (chunks[-1] + 1) * FINISH_GROUPS))


def _run(indices: list[int]) -> Run:
    """[first, last + 1) of a step's groups of one kind (consecutive by construction)."""
    return (min(indices), max(indices) + 1) if indices else None
