"""Non-finite detector on streams where the answer is known."""

from __future__ import annotations

import math

import numpy as np

from gradwatch.rules import NonFiniteDetector, Step

LAYERS = tuple(f"{i}.{kind}" for i in range(6) for kind in ("weight", "bias"))


def step(t: int, norms: np.ndarray | None = None, **kw: object) -> Step:
    values = np.ones(len(LAYERS)) if norms is None else norms
    return Step(
        job="j",
        step=t,
        time=float(t),
        loss=kw.pop("loss", 1.0),
        layers=LAYERS,
        layer_norms=values,
        **kw,
    )


def test_nan_at_step_k_fires_at_k_and_names_the_layer_that_went_first() -> None:
    det = NonFiniteDetector()
    for t in range(1, 41):
        assert not det.observe(step(t)).active
    norms = np.ones(len(LAYERS))
    norms[4] = math.nan  # "2.weight" goes first
    first = det.observe(step(41, norms))
    assert first.active
    assert first.evidence["first_nonfinite"] == ["2.weight"]
    assert first.evidence["first_nonfinite_step"] == 41
    assert first.evidence["nonfinite_layers"] == 1
    assert "2.weight" in first.summary
    # Next step everything is non-finite: the earliest layer still leads the list.
    everything = det.observe(step(42, np.full(len(LAYERS), math.inf), loss=math.nan))
    assert everything.active
    assert everything.evidence["first_nonfinite"][0] == "2.weight"
    assert everything.evidence["nonfinite_layers"] == len(LAYERS)
    assert math.isnan(everything.evidence["loss"])
    assert "loss is nan" in everything.summary


def test_names_are_capped_and_in_order_of_first_step_then_model_order() -> None:
    det = NonFiniteDetector(max_named=3)
    a = np.ones(len(LAYERS))
    a[[7, 9]] = math.nan
    det.observe(step(1, a))
    b = np.full(len(LAYERS), math.nan)
    found = det.observe(step(2, b))
    assert found.evidence["first_nonfinite"] == [LAYERS[7], LAYERS[9], LAYERS[0]]


def test_loss_or_total_norm_alone_is_enough() -> None:
    assert NonFiniteDetector().observe(step(1, loss=math.inf)).active
    only_total = NonFiniteDetector().observe(step(1, grad_norm=math.nan))
    assert only_total.active
    assert only_total.evidence["nonfinite_layers"] == 0
    assert only_total.evidence["first_nonfinite"] == []


def test_amp_overflow_skips_do_not_fire() -> None:
    det = NonFiniteDetector()
    for t in range(1, 200):
        overflow = t % 7 == 0
        norms = np.full(len(LAYERS), math.inf) if overflow else np.ones(len(LAYERS))
        s = step(
            t, norms, grad_norm=math.inf if overflow else 1.0, skipped=overflow, loss_scale=65536.0
        )
        assert not det.observe(s).active


def test_skipped_step_without_a_loss_scale_is_not_an_amp_skip() -> None:
    s = step(1, np.full(len(LAYERS), math.nan), skipped=True)
    assert NonFiniteDetector().observe(s).active


def test_a_clean_step_ends_the_incident_and_the_next_one_is_ranked_afresh() -> None:
    det = NonFiniteDetector()
    a = np.ones(len(LAYERS))
    a[0] = math.nan
    det.observe(step(1, a))
    assert not det.observe(step(2)).active
    b = np.ones(len(LAYERS))
    b[5] = math.nan
    found = det.observe(step(3, b))
    assert found.evidence["first_nonfinite"] == [LAYERS[5]]
    assert found.evidence["first_nonfinite_step"] == 3


def test_changed_layer_list_resets_tracking() -> None:
    det = NonFiniteDetector()
    det.observe(step(1, np.full(len(LAYERS), math.nan)))
    other = Step(
        job="j", step=2, time=2.0, layers=("a.w", "b.w"), layer_norms=np.array([1.0, math.nan])
    )
    assert det.observe(other).evidence["first_nonfinite"] == ["b.w"]
