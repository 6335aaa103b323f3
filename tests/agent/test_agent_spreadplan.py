"""A spread sample's plan (agent/spreadplan.py): every unit once, in order, none doubled up
where there is room, each kind evenly spread where there is not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gradwatch.agent.spreadplan import Part, Run, plan, units


def _indices(runs: list[Run]) -> list[int]:
    return [i for run in runs if run is not None for i in range(*run)]


@given(
    steps=st.integers(1, 80),
    weights=st.integers(1, 16),
    ratios=st.integers(1, 32),
    hooks=st.integers(0, 16),
)
def test_every_unit_is_planned_once_and_the_sample_ships_last(
    steps: int, weights: int, ratios: int, hooks: int
) -> None:
    parts = plan(steps, weights, ratios, hooks)
    assert 1 <= len(parts) <= steps
    assert sum(p.weights for p in parts) == weights
    assert _indices([p.ratios for p in parts]) == list(range(ratios))  # in order, once each
    assert _indices([p.hooks for p in parts]) == list(range(hooks))
    assert [p.ship for p in parts] == [False] * (len(parts) - 1) + [True]
    assert sum(p.copy for p in parts) == 1 and not any(p.copy for p in parts[:-2])


def _load(part: Part) -> int:
    return part.weights + (part.ratios is not None) + (part.hooks is not None)


def test_with_room_each_step_carries_one_unit_and_the_copies_and_ship_their_own() -> None:
    parts = plan(50, 16, 32, 4)  # the GPT benchmark's sample, 50 steps to the next
    assert len(parts) == units(16, 16, 4)  # ratio groups two to a unit: 32 do not fit
    assert all(_load(p) == 1 for p in parts[:-2])
    assert {p.ratios[1] - p.ratios[0] for p in parts if p.ratios} == {2}
    assert _load(parts[-2]) == 0 and parts[-2].copy and _load(parts[-1]) == 0


def test_without_room_each_kind_is_spread_over_every_step() -> None:
    parts = plan(8, 16, 8, 3)  # 8 steps to the next sample, 29 units
    assert len(parts) == 8
    assert [p.weights for p in parts] == [2] * 8  # a phase a step, as a whole sample reads
    assert [p.ratios for p in parts] == [(g, g + 1) for g in range(8)]
    assert sum(p.hooks is not None for p in parts) == 3
    assert parts[-1].copy and parts[-1].ship
