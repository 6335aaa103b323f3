"""Which part of a spread cadence sample each of its steps measures.

A cadence sample is a handful of units of work, each a few tensor operations that
cost 10-70 us apiece on the cold cache a backward pass leaves: the weight norms,
read a slice at a time (agent/weightstats.py); the update-ratio samples of each
group of layers, gathered before and after one optimizer step
(agent/updateratios.py); the activation hooks of each group of modules, armed for
one forward pass (agent/activations.py); then the host copies of what was gathered
(the arithmetic is the shipper thread's, agent/hostpart.py) and the ship, which
queues the sample, each on a step of its own. Where the next sample is far enough
away, the units go to consecutive steps one each, so that no step pays more than its
largest unit (issue 19: every step's cost, not the median); where it is closer, a
ratio unit gathers a few consecutive groups, and with less room still each kind is
spread evenly over the steps there are.

Example::

    >>> from gradwatch.agent.spreadplan import plan
    >>> parts = plan(steps=50, weight_slices=2, ratio_groups=3, hook_groups=1)
    >>> len(parts), parts[-2].copy, parts[-1].ship, sum(p.weights for p in parts)
    (8, True, True, 2)
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
    """What one step of a spread sample measures (within the step: the forward's
    hooks, then the gathers around the update, then ``log()``'s reads and ship)."""

    hooks: Run = None  # activation-module groups hooked in its forward pass
    ratios: Run = None  # layer groups whose update-ratio samples it gathers
    weights: int = 0  # weight-norm slices it reads
    copy: bool = False  # host copies of what the hooks and gathers collected are queued
    ship: bool = False  # the sample is queued for the shipper: its last part


def units(weight_slices: int, ratio_groups: int, hook_groups: int) -> int:
    """The number of steps a sample takes when each carries one unit of work."""
    return weight_slices + ratio_groups + hook_groups + 2


@functools.lru_cache(maxsize=64)  # a sample's plan depends on the gap only: made once
def plan(steps: int, weight_slices: int, ratio_groups: int, hook_groups: int) -> tuple[Part, ...]:
    """The parts of a sample spread over at most ``steps`` steps (at least 1).

    With room for every unit on its own step, the measuring units go one per
    step, the kinds interleaved (each kind's units evenly across the run), then
    the host copies and the ship on steps of their own; where the ratio groups
    alone do not fit, a unit gathers ``k`` consecutive groups, ``k`` the least
    that fits (at most twice what spreading puts on a step). With less room
    still, each kind is spread evenly over all the steps on its own, its units
    offset from the other kinds' (so they fall on different steps where they
    can), and the copies and the ship go with the last step's units.
    """
    fixed = weight_slices + hook_groups + 2
    per = next((k for k in range(1, ratio_groups + 1) if fixed + -(-ratio_groups // k) <= steps), 0)
    if per and per <= 2 * -(-ratio_groups // max(1, steps)):
        counts = {"w": weight_slices, "r": -(-ratio_groups // per), "h": hook_groups}
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
        bins += [[("copy", 0)], [("ship", 0)]]
    else:
        counts = {"w": weight_slices, "r": ratio_groups, "h": hook_groups}
        s = max(1, steps)
        bins = [[] for _ in range(s)]
        for offset, (name, count) in zip((0.0, 1 / 3, 2 / 3), counts.items(), strict=True):
            for i in range(count):
                bins[int((i + offset) * s / count)].append((name, i))
        bins[-1] += [("copy", 0), ("ship", 0)]
    return tuple(_part(todo) for todo in bins)


def _part(todo: list[tuple[str, int]]) -> Part:
    return Part(
        hooks=_run([i for name, i in todo if name == "h"]),
        ratios=_run([i for name, i in todo if name == "r"]),
        weights=sum(1 for name, _ in todo if name == "w"),
        copy=any(name == "copy" for name, _ in todo),
        ship=any(name == "ship" for name, _ in todo),
    )


def _run(indices: list[int]) -> Run:
    """[first, last + 1) of a step's groups of one kind (consecutive by construction)."""
    return (min(indices), max(indices) + 1) if indices else None
