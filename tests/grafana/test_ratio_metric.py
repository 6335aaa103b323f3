"""gradwatch_job_first_last_grad_ratio: the layer-ratio rule's measure, for the dashboard."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from gradwatch.collector.exposition import GradwatchCollector
from gradwatch.collector.ingest import Ingest
from gradwatch.collector.state import StateStore
from gradwatch.rules.step import Step

NAME = "gradwatch_job_first_last_grad_ratio"


def ratios(*steps: Step) -> dict[str, float]:
    state = StateStore(clock=lambda: 1_700_000_000.0)
    for step in steps:
        state.observe_step(step)
    registry = CollectorRegistry()
    registry.register(GradwatchCollector(state, Ingest().stats))
    (family,) = [m for m in registry.collect() if m.name == NAME]
    return {s.labels["training_job"]: s.value for s in family.samples}


def step(job: str, layers: tuple[str, ...], norms: list[float]) -> Step:
    return Step(job=job, step=1, time=0.0, layers=layers, layer_norms=np.array(norms))


def test_modules_combine_weight_and_bias_and_skip_zero_and_nonfinite() -> None:
    got = ratios(
        # modules "0" (3-4-5) and "2" (0.03-0.04-0.05): first/last = 100
        step("vanish", ("0.weight", "0.bias", "2.weight", "2.bias"), [3.0, 4.0, 0.03, 0.04]),
        # a frozen first module and a NaN last one are skipped, as the rule skips them
        step("skips", ("a.w", "b.w", "c.w", "d.w"), [0.0, 2.0, 8.0, float("nan")]),
        step("one-module", ("fc.weight", "fc.bias"), [1.0, 1.0]),
        step("no-layers", (), []),
    )
    assert set(got) == {"vanish", "skips"}
    assert np.isclose(got["vanish"], 100.0)
    assert np.isclose(got["skips"], 0.25)


def test_an_extreme_ratio_is_inf_not_an_error() -> None:
    # Both norms square to finite non-zero values; their quotient overflows float64.
    got = ratios(step("huge", ("a.w", "b.w"), [1e154, 1e-160]))
    assert got["huge"] == float("inf")
