"""A real GPT's gradient signals through the default rules (benchmarks/gpt_signals.py recorded).

The healthy run is nanoGPT's architecture and recipe (tied embeddings, LayerNorm
gains, AdamW, clip 1.0, accumulation 2; 1,500 iterations). Issue 13 found the
layer-ratio rule paging 46 times on such a run, between the tied token embedding
and the final LayerNorm gain: no rule of the gradient, weight or model groups may
raise anything here, with the agent's parameter roles or without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.ratio import LayerEnds
from gradwatch.rules.step import Stats, Step
from gradwatch.rules.testing import Record, feed_all

DATA = Path(__file__).parent / "data"
RULES = load_default_rules()
MINE = {"numerical", "gradients", "activations", "weights", "model", "mixed-precision"}


def records(path: Path, roles: bool = True) -> Iterator[Record]:
    d = np.load(path)
    layers = tuple(str(x) for x in d["layers"])
    sent = tuple(str(x) for x in d["roles"]) if roles else ()
    stats_at = {int(s): i for i, s in enumerate(d["stats_step"])}
    for t in range(1, len(d["loss"]) + 1):
        yield Step(
            job="gpt",
            step=t,
            time=float(t),
            loss=float(d["loss"][t - 1]),
            grad_norm=float(d["grad_norm"][t - 1]),
            grad_norm_logged=True,
            layers=layers,
            layer_norms=d["norms"][t - 1].astype(np.float64),
            lr=(float(d["lr"][t - 1]),) * 2,
            layer_roles=sent,
        )
        i = stats_at.get(t)
        if i is not None:
            yield Stats(
                job="gpt",
                step=t,
                time=float(t),
                layers=layers,
                weight_norms=d["weight_norms"][i].astype(np.float64),
                update_ratios=d["update_ratios"][i].astype(np.float64),
            )


@pytest.mark.parametrize("roles", [True, False], ids=["roles", "names-only"])
def test_healthy_gpt_raises_nothing_from_the_signal_rules(roles: bool) -> None:
    groups = {r.name: r.group for r in RULES}
    transitions = feed_all(
        Engine(RULES, clock=lambda: 0.0), records(DATA / "gpt-healthy.npz", roles)
    )
    fired = [
        (t.alert.rule, t.alert.step, t.alert.summary)
        for t in transitions
        if t.current == "firing" and groups[t.alert.rule] in MINE
    ]
    assert fired == []


def test_the_ratio_ends_of_a_tied_gpt_are_its_weight_matrices() -> None:
    step = next(r for r in records(DATA / "gpt-healthy.npz") if isinstance(r, Step))
    end = LayerEnds().measure(step)
    assert end is not None
    assert (end.first, end.last) == ("transformer.h.0.attn.c_attn", "transformer.h.3.mlp.c_proj")


def test_init_x0_01_is_a_small_init_not_an_explosion() -> None:
    # Issue 13: nanoGPT with its init x0.01 paged a *critical* GradientNormGrowingGeometrically
    # ("float32 overflow in ~756 steps", first advice "lower the learning rate"): the grad norm
    # grew from 0.1 as the weights woke up. The fitting reading is the init, with its advice.
    transitions = feed_all(Engine(RULES, clock=lambda: 0.0), records(DATA / "gpt-init-x0.01.npz"))
    fired = {t.alert.rule: t.alert for t in transitions if t.current == "firing"}
    assert "GradientNormGrowingGeometrically" not in fired
    assert all(a.severity != "critical" for a in fired.values())
    # The page: the first layers starve (vanishing ratio), with the init scale as first check;
    # the explanation: the weights grew 10x from their init (info: a waking init may cost nothing).
    ratio = fired["LayerGradNormRatioVanishing"]
    assert ratio.severity == "warning" and ratio.step <= 50
    assert ratio.diagnosis is not None and ratio.diagnosis["next_checks"][0].startswith(
        "initialisation scale"
    )
    small = fired["WeightsStartedTooSmall"]
    assert (small.category, small.severity) == ("vanishing_gradients", "info") and small.step <= 50
    assert (
        small.diagnosis is not None and "initialisation scale" in small.diagnosis["next_checks"][0]
    )
    assert not any("lower the learning rate" == c for c in small.diagnosis["next_checks"])
