"""Pipeline x data and tensor x data parallel gloo jobs, assembled into one job-wide step.

4 CPU ranks each (tests/distributed/worker3d.py) against a real in-process
collector, with the layout declared to the agent (only one replica per model
shard sends per-layer norms; TP copies are scaled) and, for PP, without. Every
judged step must hold every layer of the whole model, once, in model order
(stage 0's layers first), with the global norm the job computed itself, and the
total over all stages: so the first/last layer ratio and the total norm span
the model, not one stage.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.harness import launch
from tests.distributed.test_gloo_collector import JOB_TIMEOUT_S, collector, wait_until

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_gloo_available(), reason="this torch build has no gloo backend"
    ),
    pytest.mark.slow,
]

WORLD = 4
STEPS = 4
# Model order of each job's layers, stage 0 first.
ORDER = {
    "pp": [
        "fc1.weight",
        "fc1.bias",
        "norm.weight",
        "norm.bias",
        "fc2.weight",
        "fc2.bias",
        "fc3.weight",
        "fc3.bias",
        "fc4.weight",
        "fc4.bias",
    ],
    "tp": ["norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight"],
}
SHARDS = {"pp": 1, "tp": 2}


def job_norms(out: Path) -> dict[int, dict[str, float]]:
    """Per step, every layer's global norm as the job computed it (replicas must agree)."""
    merged: dict[int, dict[str, float]] = {}
    for rank in range(WORLD):
        for step, layers in json.loads((out / f"direct{rank}.json").read_text()).items():
            into = merged.setdefault(int(step), {})
            for name, norm in layers.items():
                if name in into:  # another replica or TP rank: the same global norm
                    assert norm == pytest.approx(into[name], rel=1e-6), (step, name)
                into[name] = norm
    return merged


# declare 1: watch(layout=...), so only replica 0 of each model shard sends layers and
# the TP copies of ``norm`` go out scaled; 0: every rank sends its layers as they are.
@pytest.mark.parametrize(("mode", "declare"), [("pp", 0), ("pp", 1), ("tp", 1)])
def test_one_step_spans_every_stage_and_shard(tmp_path: Path, mode: str, declare: int) -> None:
    with collector() as (server, engine, sink):
        with launch(
            WORLD,
            mode,
            server.bound_endpoint,
            f"3d-{mode}",
            STEPS,
            tmp_path,
            worker="tests.distributed.worker3d",
            declare=declare,
        ) as job:
            job.wait(JOB_TIMEOUT_S)
        wait_until(lambda: len(engine.steps) >= STEPS, 10.0, "every assembled step")
        judged = list(engine.steps)
    truth = job_norms(tmp_path)
    assert [s.step for s in judged] == list(range(1, STEPS + 1))  # once each, in order
    for whole in judged:
        assert whole.assembled == WORLD and whole.shards == SHARDS[mode]
        assert list(whole.layers) == ORDER[mode]
        expected = [truth[whole.step][name] for name in ORDER[mode]]
        np.testing.assert_allclose(whole.layer_norms, expected, rtol=1e-5, atol=1e-7)
        assert whole.grad_norm == pytest.approx(math.sqrt(sum(v * v for v in expected)), rel=1e-5)
        assert whole.loss is not None and math.isfinite(whole.loss)
    assert not [
        t
        for t in sink.transitions
        if t.current == "firing" and t.alert.category not in ("stalled", "straggler")
    ]
