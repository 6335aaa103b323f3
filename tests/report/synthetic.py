"""A synthetic trace of any size, written with the trace writer (``encode_record``).

A transformer-like model of ``layers`` parameter tensors trains ``steps`` steps
under a warm-up + cosine learning-rate schedule, until a scheduler fault
multiplies the lr by ``LR_FAULT_FACTOR`` at ``fault_step``: the gradient norms
jump, the loss climbs, and two single-step spikes (one layer each) sit where an
averaging heatmap would hide them. Numbers are seeded, so a trace is the same
on every run. Needs numpy only.

Example::

    path = write_synthetic_trace(tmp_path / "big.jsonl", layers=1000, steps=2000)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gradwatch.wire.trace import TraceEvent, TraceHeader, TraceStats, TraceStep, encode_record

JOB = "synthetic"
LR_PEAK = 3e-4
LR_FAULT_FACTOR = 100.0
STATS_EVERY = 50
SPIKE = 100.0  # a one-step, one-layer spike this many times its neighbours (too small to alert on)


def layer_names(count: int) -> tuple[str, ...]:
    """``count`` names grouped four to a block, as a transformer's parameter list reads."""
    kinds = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")
    return tuple(f"blocks.{i // len(kinds)}.{kinds[i % len(kinds)]}" for i in range(count))


def lr_schedule(steps: int, fault_step: int | None) -> np.ndarray:
    """Warm-up over the first 5% of steps, cosine decay after; ×LR_FAULT_FACTOR from fault_step."""
    t = np.arange(1, steps + 1, dtype=np.float64)
    warm = max(1.0, 0.05 * steps)
    lr = np.where(
        t < warm,
        LR_PEAK * t / warm,
        LR_PEAK * 0.5 * (1 + np.cos(math.pi * (t - warm) / max(1.0, steps - warm))),
    )
    if fault_step is not None:
        lr[t >= fault_step] *= LR_FAULT_FACTOR
    return lr


def spikes(layers: int, steps: int) -> list[tuple[int, int]]:
    """(layer index, step) of the single-cell spikes the trace carries."""
    return [(layers // 3, steps // 4), (2 * layers // 3, steps // 2 + 1)]


def write_synthetic_trace(
    path: Path,
    *,
    layers: int = 1000,
    steps: int = 2000,
    fault_step: int | None = None,
    seed: int = 0,
) -> Path:
    """Write the trace to ``path``; ``fault_step`` defaults to 60% of the run."""
    fault = int(0.6 * steps) if fault_step is None else fault_step
    rng = np.random.default_rng(seed)
    names = layer_names(layers)
    lr = lr_schedule(steps, fault)
    # Early layers get smaller gradients (depth profile); every step wobbles a little.
    depth = np.logspace(-3, -1, layers)
    wobble = np.exp(rng.normal(0.0, 0.25, (steps, layers)))
    norms = depth[None, :] * wobble * np.where(np.arange(1, steps + 1) >= fault, 30.0, 1.0)[:, None]
    for layer, step in spikes(layers, steps):
        norms[step - 1, layer] *= SPIKE
    loss = 4.0 * np.exp(-np.arange(steps) / (0.3 * steps)) + 1.5 + rng.normal(0, 0.02, steps)
    loss[fault - 1 :] += np.linspace(0.0, 6.0, steps - fault + 1)
    with path.open("w", encoding="utf-8") as out:
        out.write(encode_record(TraceHeader(job=JOB, layers=names)) + "\n")
        for i in range(steps):
            step = i + 1
            row = norms[i]
            out.write(
                encode_record(
                    TraceStep(
                        step=step,
                        time=0.5 * step,
                        loss=float(loss[i]),
                        lr=(float(lr[i]),),
                        grad_norm=float(np.sqrt(np.square(row).sum())),
                        layer_grad_norms=tuple(np.round(row, 6).tolist()),
                    )
                )
                + "\n"
            )
            if step % STATS_EVERY == 0:
                out.write(
                    encode_record(
                        TraceStats(
                            step=step, time=0.5 * step, layer_weight_norms=tuple([1.0] * layers)
                        )
                    )
                    + "\n"
                )
            if step % 500 == 0:
                out.write(
                    encode_record(
                        TraceEvent(
                            step=step,
                            kind="checkpoint",
                            time=0.5 * step,
                            fields={"path": f"ckpt/{step}.pt"},
                        )
                    )
                    + "\n"
                )
    return path
