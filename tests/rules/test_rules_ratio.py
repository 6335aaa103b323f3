"""Layer-ratio detector: weight-matrix ends, drift from the run's own reference, hysteresis."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.rules import LayerRatioDetector, Step
from gradwatch.rules.ratio import LayerEnds, group_layers, module_of

LAYERS = ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias")


def step(t: int, norms: list[float], layers: tuple[str, ...] = LAYERS, **kw: object) -> Step:
    return Step(
        job="j",
        step=t,
        time=float(t),
        layers=layers,
        layer_norms=np.array(norms, dtype=float),
        **kw,
    )


def ratio_norms(first_over_last: float) -> list[float]:
    """Weights of modules 0..2 with first/last = ``first_over_last``; biases 10x smaller."""
    return [first_over_last, first_over_last / 10, 1.0, 0.1, 1.0, 0.1]


def run(det: LayerRatioDetector, ratios: list[float], **kw: object) -> list[bool]:
    """Active verdicts step by step; None (no verdict) counts as inactive."""
    out = []
    for t, r in enumerate(ratios, start=1):
        found = det.observe(step(t, ratio_norms(r), **kw))
        out.append(bool(found and found.active))
    return out


def test_vanishing_is_drift_from_the_runs_own_early_ratio() -> None:
    det = LayerRatioDetector()
    active = run(det, [0.2] * 30 + [0.002] * 10)
    assert not any(active[:30]) and active[-1]
    assert active.index(True) <= 30 + 3  # median of 5: three steps of the new ratio
    found = det.observe(step(41, ratio_norms(0.002)))
    assert found is not None
    ev = found.evidence
    assert ev["direction"] == "vanishing"
    assert (ev["first_module"], ev["last_module"]) == ("0", "2")
    assert ev["first_norm"] == pytest.approx(0.002)  # the weight alone: biases are no end
    assert ev["ratio"] == pytest.approx(0.002)
    assert ev["reference_ratio"] == pytest.approx(0.2)
    assert ev["drift"] == pytest.approx(100.0)
    assert "vanishing" in found.summary and "'0'" in found.summary and "1:5" in found.summary


def test_exploding_direction_and_filter() -> None:
    ratios = [3.0] * 20 + [500.0] * 10
    assert run(LayerRatioDetector(), ratios)[-1]
    assert not any(run(LayerRatioDetector(direction="vanishing"), ratios))
    assert run(LayerRatioDetector(direction="exploding"), ratios)[-1]


def test_a_large_but_steady_architectural_ratio_is_not_an_anomaly() -> None:
    # 200:1 from the first step is this network's shape; only drift from it counts.
    assert not any(run(LayerRatioDetector(), [200.0] * 300))
    assert not any(
        run(LayerRatioDetector(), [17.0 * 1.003**t for t in range(600)])
    )  # 17 -> ~100, slowly


def test_an_extreme_ratio_from_the_start_needs_no_drift() -> None:
    # AUTOTRAINER's 1e-3: a network broken from its first step has no healthy reference.
    assert all(run(LayerRatioDetector(), [1e-4] * 20)[4:])


def test_hysteresis_one_episode_is_one_incident() -> None:
    det = LayerRatioDetector()
    # Into the episode at 1:1000 from 1:5; then wobbling around the entry bound (1:50-1:200).
    ratios = [0.2] * 20 + [1e-3] * 10 + [0.005, 0.03, 0.01, 0.02] * 20 + [0.2] * 10
    active = run(det, ratios)
    begin = active.index(True)
    end = len(active) - 1 - active[::-1].index(True)
    assert all(active[begin : end + 1])  # never flaps while it stays beyond the square roots
    assert end < len(ratios) - 1  # back at its reference: over


def test_a_tiny_bias_never_decides() -> None:
    assert not any(run(LayerRatioDetector(), [1.0] * 20, layers=LAYERS))
    quiet = [[1.0, 1e-4, 1.0, 1e-3, 1.0, 1e-5 if t > 10 else 1.0] for t in range(30)]
    det = LayerRatioDetector()
    # `observe` may return None; here it always returns a Finding.
    assert not any(det.observe(step(t, n)).active for t, n in enumerate(quiet, start=1))  # type: ignore[union-attr]


NANOGPT = (
    "transformer.wte.weight",
    "transformer.wpe.weight",
    "transformer.h.0.ln_1.weight",
    "transformer.h.0.attn.c_attn.weight",
    "transformer.h.0.mlp.c_proj.weight",
    "transformer.h.1.attn.c_attn.weight",
    "transformer.h.1.mlp.c_proj.weight",
    "transformer.ln_f.weight",
)
ROLES = ("tied", "embedding", "norm", "weight", "weight", "weight", "weight", "norm")


@pytest.mark.parametrize("roles", [ROLES, ()])
def test_tied_embeddings_and_norm_gains_are_no_ends(roles: tuple[str, ...]) -> None:
    # nanoGPT's trial: first = the token embedding tied to the head, last = ln_f's gain;
    # between those two the ratio drifts 17 -> >100 in healthy training. With or without
    # the agent's roles (names alone tell the norm gain and the embedding), the ends are
    # the first and last weight matrices, whose ratio stays put.
    det = LayerRatioDetector()
    ends = LayerEnds()
    for t in range(1, 400):
        drift = 17.0 * 1.01**t  # wte / ln_f: 17 -> ~900
        norms = [drift, 0.5, 0.3, 1.0, 0.8, 0.9, 0.7, 1.0]
        s = step(t, norms, layers=NANOGPT, layer_roles=roles)
        found = det.observe(s)
        assert found is not None and not found.active
    end = ends.measure(s)
    assert end is not None
    assert (end.first, end.last) == ("transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj")


def test_embeddings_are_ends_only_without_two_weight_modules() -> None:
    ends = LayerEnds()
    end = ends.measure(
        step(1, [1e-4, 1.0, 1.0], layers=("embed.weight", "h.0.weight", "head.weight"))
    )
    assert end is not None and (end.first, end.last) == ("h.0", "head")
    end = ends.measure(step(1, [1e-4, 1.0], layers=("embed.weight", "head.weight")))
    assert end is not None and (end.first, end.last) == ("embed", "head")


def test_zero_and_non_finite_modules_are_skipped() -> None:
    # Module 0 frozen (zero), module 2 non-finite: the ratio is between modules 1 and 3.
    layers = ("0.w", "1.w", "2.w", "3.w")
    end = LayerEnds().measure(step(1, [0.0, 1.0, math.nan, 1e-3], layers=layers))
    assert end is not None and (end.first, end.last) == ("1", "3")


def test_ends_that_change_restart_the_reference() -> None:
    det = LayerRatioDetector()
    layers = ("0.w", "1.w", "2.w", "3.w")
    for t in range(1, 30):
        det.observe(step(t, [1.0, 1.0, 1.0, 1.0], layers=layers))
    # Module 0 freezes: the ends are now 1 and 3, with a reference of their own.
    for t in range(30, 60):
        found = det.observe(step(t, [0.0, 1e-2, 1.0, 1.0], layers=layers))
        assert found is not None and not found.active
    assert det.reference_log_ratio() == pytest.approx(-2.0)


def test_ignore_patterns_and_too_few_modules() -> None:
    layers = ("a.weight", "h.0.weight", "head.weight")
    end = LayerEnds(ignore=("a",)).measure(step(1, [1e-4, 1.0, 1.0], layers=layers))
    assert end is not None and (end.first, end.last) == ("h.0", "head")
    assert LayerEnds(ignore=("a", "h.*")).measure(step(1, [1e-4, 1.0, 1.0], layers=layers)) is None
    assert LayerRatioDetector().observe(step(1, [1e-4, 1.0], layers=("0.weight", "0.bias"))) is None


def test_amp_skips_and_missing_norms_give_no_verdict() -> None:
    det = LayerRatioDetector(window=1)
    # `observe` may return None; here it always returns a Finding.
    assert det.observe(step(1, ratio_norms(1e-4))).active  # type: ignore[union-attr]
    assert det.observe(step(2, [math.inf] * 6, skipped=True, loss_scale=2.0)) is None
    assert det.observe(Step(job="j", step=3, time=3.0)) is None
    assert len(det._log_ratios) == 1


def test_grouping() -> None:
    assert module_of("encoder.layers.0.weight") == "encoder.layers.0"
    assert module_of("weight") == ""
    inverse, names, skip = group_layers(("a.w", "a.b", "b.w", "c.w", "c.b"), ignore=("b",))
    assert inverse.tolist() == [0, 0, 1, 2, 2]
    assert names == ["a", "b", "c"]
    assert skip.tolist() == [False, True, False]


@pytest.mark.parametrize(
    "bad",
    [
        {"threshold": 1.0},
        {"window": 0},
        {"direction": "sideways"},
        {"drift": 0.5},
        {"extreme": 1.0},
        {"reference": 0},
    ],
)
def test_invalid_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        LayerRatioDetector(**bad)


def test_for_counts_measured_steps_only() -> None:
    # Issue 13, must-have 1: steps without layer norms (a loop that logs the loss alone between
    # measured steps) leave the rule's state alone: for: 5 counts measured steps.
    from gradwatch.rules import Engine, load_default_rules

    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    fired = []
    for t in range(1, 400):
        measured = t % 10 == 0
        norms = ratio_norms(0.2 if t < 200 else 1e-4) if measured else []
        fired += [tr.alert for tr in engine.observe(step(t, norms)) if tr.current == "firing"]
    (alert,) = fired
    assert alert.rule == "LayerGradNormRatioVanishing"
    # The ratio turned at step 200; the median of 5 holds from the 3rd measured step (220)
    # and for: 5 needs 5 measured steps: fired at 260, named from 220, never on unmeasured steps.
    assert alert.step == 220
