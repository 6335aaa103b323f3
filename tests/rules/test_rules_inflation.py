"""WeightsInflatingLossStalled: weights inflating while the loss stalls (lr far too high)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.inflation import WeightInflationDetector
from gradwatch.rules.step import Stats

LAYERS = ("a.weight", "b.weight", "c.weight")


def run(
    weight_at: Callable[[int], float],
    loss_at: Callable[[int], float],
    grad_at: Callable[[int], float],
    steps: int = 400,
    first: int = 1,
) -> list[tuple[int, bool]]:
    """Feed a detector every step and a cadence sample every 10; (step, active) per sample."""
    det = WeightInflationDetector()
    out = []
    for t in range(first, first + steps):
        det.observe(Step(job="j", step=t, time=0.0, loss=loss_at(t), grad_norm=grad_at(t)))
        if t == first or t % 10 == 0:
            norms = np.full(3, weight_at(t) / math.sqrt(3))
            found = det.observe_stats(
                Stats(job="j", step=t, time=0.0, layers=LAYERS, weight_norms=norms)
            )
            assert found is not None
            out.append((t, found.active))
    return out


def first_active(samples: list[tuple[int, bool]]) -> int | None:
    return next((t for t, active in samples if active), None)


# The lr x100 shape of the nanoGPT, minGPT and HF GPT-2 trials: weights x10 within ~120
# steps, the loss down from 4.4 to a plateau at 3.2 by step 20, grad norms falling from 5.
def inflating(t: int) -> float:
    return 15.0 * min(10.0, 1.0 + t / 12.0)


def plateau(t: int) -> float:
    return 3.2 + 1.2 * math.exp(-t / 5.0) + 0.02 * math.sin(t)


def falling_grads(t: int) -> float:
    return 5.0 if t <= 5 else 0.4


def test_weights_inflating_over_a_stalled_loss_fire_within_the_window() -> None:
    samples = run(inflating, plateau, falling_grads)
    start = first_active(samples)
    assert start is not None and start <= 130
    # One incident: it holds while the weights stay up and the loss stays stalled.
    assert all(active for t, active in samples if t >= start)


def test_the_same_growth_while_the_loss_falls_is_fast_learning() -> None:
    assert first_active(run(inflating, lambda t: 4.4 * 0.99**t, falling_grads)) is None


def test_a_converged_run_is_flat_far_below_its_start() -> None:
    # The fault suite's least-squares control: a small init grown x3.7 in 20 steps, the
    # loss from 41 to its noise floor 0.002.
    def weights(t: int) -> float:
        return 1.66 + 4.4 * (1 - math.exp(-(t - 1) / 5.0))

    def loss(t: int) -> float:
        return 41.0 * math.exp(-t / 2.0) + 0.002 + 0.0005 * math.sin(t)

    assert first_active(run(weights, loss, lambda t: 16.0 * math.exp(-t / 5.0) + 0.1)) is None


def test_a_small_init_waking_up_is_not_a_high_lr() -> None:
    # nanoGPT init x0.01: grads 0.22 at the start, x13.7 by step 23, back to ~0.4-1 later.
    def grads(t: int) -> float:
        return 0.22 if t <= 5 else 3.0 if t <= 40 else 0.5

    assert first_active(run(lambda t: 0.19 * min(40.0, 1.0 + t / 4.0), plateau, grads)) is None


def test_healthy_weight_growth_does_not_fire_over_a_plateau() -> None:
    # Healthy: <= x1.24 in any 200 steps, however long the loss sits still.
    assert first_active(run(lambda t: 14.0 * (1.0 + t / 2000.0), plateau, falling_grads)) is None


def test_zero_initialised_matrices_growing_alone_are_not_inflation() -> None:
    # LoRA: A random (norm 1.6), B zero-initialised and learning; B's growth alone can triple
    # the total while every matrix that started with a real norm stays put.
    det = WeightInflationDetector()
    layers = tuple(f"l{i}.lora_{ab}.weight" for i in range(4) for ab in ("A", "B"))
    fired = []
    for t in range(1, 301):
        det.observe(Step(job="j", step=t, time=0.0, loss=plateau(t), grad_norm=falling_grads(t)))
        if t == 1 or t % 10 == 0:
            b = 0.04 * t  # 0.04 after one step, 8.0 by step 200: the total grows x5
            norms = np.array([1.6, b] * 4)
            found = det.observe_stats(
                Stats(job="j", step=t, time=0.0, layers=layers, weight_norms=norms)
            )
            assert found is not None
            fired.append(found.active)
    assert not any(fired)


def test_a_run_joined_mid_way_has_no_start_to_compare() -> None:
    samples = run(
        lambda t: inflating(t - 500), lambda t: plateau(t - 500), falling_grads, first=501
    )
    assert first_active(samples) is None


def test_the_default_rule_pages_as_lr_too_high() -> None:
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    fired = []
    for t in range(1, 300):
        fired += engine.observe(
            Step(job="j", step=t, time=0.0, loss=plateau(t), grad_norm=falling_grads(t))
        )
        if t == 1 or t % 10 == 0:
            norms = np.full(3, inflating(t) / math.sqrt(3))
            fired += engine.observe_stats(
                Stats(job="j", step=t, time=0.0, layers=LAYERS, weight_norms=norms)
            )
    alert = next(f.alert for f in fired if f.alert.rule == "WeightsInflatingLossStalled")
    assert alert.category == "lr_too_high" and alert.severity == "warning"
    assert alert.evidence["growth"] >= 3.0 and alert.evidence["loss_last"] > 3.0
    assert alert.diagnosis is not None
    assert alert.diagnosis["next_checks"][0].startswith("lower the learning rate")


def test_a_gradient_rise_late_in_the_run_is_no_init_waking_up() -> None:
    # Only a rise early in the run (WAKE_STEPS) marks a small init; a burst of large
    # gradients at steps 250-290 must not switch the rule off for the rest of the run.
    def grads(t: int) -> float:
        return 20.0 if 250 <= t < 290 else falling_grads(t)

    samples = run(lambda t: 15.0 if t < 300 else inflating(t - 300), plateau, grads, steps=600)
    start = first_active(samples)
    assert start is not None and 300 < start <= 450


def test_roles_that_arrive_after_the_first_samples_rejudge_them_under_the_roles() -> None:
    # pytorch/examples' time_sequence_prediction (LSTMCell): its first samples came before
    # any step with roles, so every layer counted as a matrix (names alone); once the roles
    # arrived, 3 of its 5 layers did. Comparing the two choices raised IndexError in replay;
    # now every sample is judged under the roles known when it is judged.
    det = WeightInflationDetector()
    layers = ("cell.weight_ih", "cell.weight_hh", "cell.bias_ih", "cell.bias_hh", "head.weight")
    roles = ("weight", "weight", "bias", "bias", "weight")
    norms = np.array([3.0, 3.0, 0.5, 0.5, 1.0])
    early = Stats(job="j", step=1, time=0.0, layers=layers, weight_norms=norms)
    assert det.observe_stats(early) is not None
    det.observe(Step(job="j", step=2, time=0.0, loss=1.0, layers=layers, layer_roles=roles))
    for t in (2, 3):
        later = Stats(job="j", step=t, time=0.0, layers=layers, weight_norms=norms * 10 * t)
        found = det.observe_stats(later)
        assert found is not None and not found.active  # no loss series: the weights alone


def test_the_weights_a_run_started_from_stay_its_base_when_the_roles_come_later() -> None:
    # minDiffusion's DDPM at lr x100 (benchmarks/ddpm_trial.py): a BatchNorm CNN whose conv
    # weights grew x2.4 in Adam's first update and x8 by step 63 while the loss sat at 1.0,
    # the trivial predictor's, for 200 steps. The agent's first sample (the weights before
    # any update) and the next ones arrive before the step batch that carries the roles;
    # when the history was dropped there, the growth from the start was never seen.
    det = WeightInflationDetector(learn_z=5.0)
    # Its BatchNorm layers sit in nn.Sequential: their names alone say nothing of a norm.
    layers = ("c.0.0.weight", "c.0.1.weight", "c.1.0.weight", "c.1.1.weight", "c.2.weight")
    roles = ("weight", "norm", "weight", "norm", "weight")
    start = np.array([2.0, 2.8, 3.0, 4.0, 2.0])
    grown = np.array([8.0, 2.9, 19.0, 4.1, 16.0])

    def sample(t: int, norms: np.ndarray) -> bool:
        found = det.observe_stats(
            Stats(job="j", step=t, time=0.0, layers=layers, weight_norms=norms)
        )
        assert found is not None
        return found.active

    assert not sample(1, start)  # the weights the run started from, before any roles
    for t in range(1, 161):
        loss = 1.0 + 0.004 * math.sin(3.0 * t)  # the trivial predictor's MSE, flat
        det.observe(
            Step(
                job="j",
                step=t,
                time=0.0,
                loss=loss,
                grad_norm=0.05 if t > 3 else 2.0,
                layers=layers,
                layer_roles=roles,
            )
        )
    fired = [t for t in range(20, 161, 20) if sample(t, grown)]
    assert fired and fired[0] <= 100  # the loss has been flat for a span: paged
    found = det.observe_stats(Stats(job="j", step=161, time=0.0, layers=layers, weight_norms=grown))
    assert found is not None and found.evidence["base_step"] == 1


def test_a_zero_initialised_table_learning_slowly_is_not_inflation() -> None:
    # karpathy/makemore's bigram: one zero-initialised table under AdamW; its norm grows
    # from one update's size (x36 by step 97) while the loss falls 1%, steadily (slope
    # t = -28.7 over 50 losses). The lr-too-high runs that page here plateau (t >= -2.5).
    def run_table(learn_z: float) -> list[bool]:
        det = WeightInflationDetector(learn_z=learn_z)
        out = []
        for t in range(1, 301):
            loss = 3.29 - 0.0003 * t + 0.002 * math.sin(7.0 * t)
            det.observe(Step(job="j", step=t, time=0.0, loss=loss, grad_norm=0.094))
            if t == 1 or t % 10 == 0:
                stats = Stats(
                    job="j",
                    step=t,
                    time=0.0,
                    layers=("logits",),
                    weight_norms=np.array([0.012 * t]),
                )
                found = det.observe_stats(stats)
                assert found is not None
                out.append(found.active)
        return out

    assert any(run_table(learn_z=math.inf))  # without the trend test: "lr too high"
    assert not any(run_table(learn_z=5.0))


def test_it_keeps_only_the_samples_its_window_can_compare_with() -> None:
    # One array of per-layer norms a sample, per rank: 256 of them for a 300-tensor model
    # under FSDP was ~600 KiB a rank; only the latest `within` steps are ever a base.
    det = WeightInflationDetector(within=200)
    norms = np.full(300, 1.0)
    layers = tuple(f"h.{i}.weight" for i in range(300))
    for t in range(50, 50 * 300, 50):
        det.observe_stats(Stats(job="j", step=t, time=0.0, layers=layers, weight_norms=norms))
    assert len(det._kept) == 5  # steps 14,750 .. 14,950
