"""The base suite's faults in the numbers: NaNs, a learning rate too high, a flipped loss
sign, loss spikes, a loss rising after an lr bump, vanishing gradients.

The first faults of ``scenario_lib.SCENARIOS``; ``faults_wiring`` holds the rest and
``scenario_lib`` the healthy controls. Split by theme so each module reads on its own.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from scenarios.runner import Ctx, Scenario
from scenarios.training import N_CLS, N_IN, classify, least_squares, mlp, teacher


def _nan_log_softmax(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        if step >= 80:
            out = out * 1e4  # over-confident logits (a temperature bug): softmax underflows to 0
        p = torch.exp(out) / torch.exp(out).sum(1, keepdim=True)  # hand-written, unstable
        return -torch.log(p.gather(1, y[:, None])).mean()

    classify(ctx, model, opt, 110, loss_fn=loss_fn)


def _nan_input_batch(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def inputs(step: int) -> torch.Tensor:
        x = torch.randn(64, N_IN)
        if step == 70:
            x[3, 5] = float("nan")  # one corrupt record
        return x

    classify(ctx, model, opt, 100, inputs=inputs, label=lambda x: teacher()(torch.nan_to_num(x)))


def _nan_zero_std(ctx: Ctx) -> None:
    model = mlp(n_out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)

    def inputs(step: int) -> torch.Tensor:
        return torch.ones(64, N_IN) if step >= 60 else torch.randn(64, N_IN)

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        target = y.float()[:, None]
        # per-batch target standardisation: 0/0 when a batch's targets are all equal
        target = (target - target.mean()) / target.std()
        return F.mse_loss(out, target)

    classify(ctx, model, opt, 90, inputs=inputs, loss_fn=loss_fn)


def _lr_far_too_high(ctx: Ctx) -> None:
    least_squares(ctx, 120, lambda s: 0.8)


def _lr_bump_explodes(ctx: Ctx) -> None:
    least_squares(ctx, 220, lambda s: 0.05 if s < 100 else 0.9)


def _lr_too_high_mlp(ctx: Ctx) -> None:
    model = mlp(depth=2, n_out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    w = torch.randn(N_IN, 1)
    classify(ctx, model, opt, 150, label=lambda x: x @ w, loss_fn=lambda o, y, s: F.mse_loss(o, y))


def _flipped_sign_regression(ctx: Ctx) -> None:
    least_squares(ctx, 200, lambda s: 0.05, sign=-1.0)


def _flipped_sign_mlp(ctx: Ctx) -> None:
    model = mlp(depth=2, n_out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = torch.randn(N_IN, 1)
    classify(ctx, model, opt, 250, label=lambda x: x @ w, loss_fn=lambda o, y, s: -F.mse_loss(o, y))


def _spike_bad_shard(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()

    def inputs(step: int) -> torch.Tensor:
        x = torch.randn(64, N_IN)
        return x * 30 if 300 <= step < 305 else x  # an unnormalised shard, 5 batches

    classify(ctx, model, opt, 400, inputs=inputs, label=lambda x: t(x))


def _spike_label_shard(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()
    step_box = [0]

    def label(x: torch.Tensor) -> torch.Tensor:
        y = t(x)
        return (y + 1) % N_CLS if 300 <= step_box[0] < 306 else y  # mislabelled shard

    classify(ctx, model, opt, 420, label=label, before_step=lambda s: step_box.__setitem__(0, s))


def _spike_lr_pulse(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def before(step: int) -> None:
        opt.param_groups[0]["lr"] = 3.0 if 300 <= step < 304 else 0.1

    classify(ctx, model, opt, 420, before_step=before)


def _rising_after_lr_bump(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    def before(step: int) -> None:
        opt.param_groups[0]["lr"] = 2e-3 if step < 250 else 0.1

    classify(ctx, model, opt, 500, before_step=before)


def _rising_sgd_lr_bump(ctx: Ctx) -> None:
    model = mlp(depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def before(step: int) -> None:
        opt.param_groups[0]["lr"] = 0.05 if step < 250 else 0.6

    classify(ctx, model, opt, 500, before_step=before)


def _deep_sigmoid(ctx: Ctx, depth: int = 16) -> None:
    model = mlp(depth=depth, width=32, act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 150)


def _deep_sigmoid_narrow(ctx: Ctx) -> None:
    model = mlp(depth=10, width=16, act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    classify(ctx, model, opt, 150)


NUMERIC_FAULTS: tuple[Scenario, ...] = (
    # numerical
    Scenario("nan_hand_written_log_softmax", "numerical", 80, _nan_log_softmax),
    Scenario("nan_corrupt_input_record", "numerical", 70, _nan_input_batch),
    Scenario("nan_zero_std_standardisation", "numerical", 60, _nan_zero_std),
    # exploding / lr too high
    Scenario(
        "lr_far_too_high_least_squares",
        "exploding_gradients",
        1,
        _lr_far_too_high,
        also=("numerical", "lr_too_high"),
    ),
    Scenario(
        "lr_bump_above_stability",
        "exploding_gradients",
        100,
        _lr_bump_explodes,
        also=("numerical", "lr_too_high"),
    ),
    Scenario(
        "lr_too_high_mlp_regression",
        "exploding_gradients",
        1,
        _lr_too_high_mlp,
        also=("numerical", "lr_too_high"),
    ),
    Scenario(
        "flipped_loss_sign_least_squares",
        "exploding_gradients",
        1,
        _flipped_sign_regression,
        also=("lr_too_high", "numerical"),
    ),
    Scenario(
        "flipped_loss_sign_mlp",
        "exploding_gradients",
        1,
        _flipped_sign_mlp,
        also=("lr_too_high", "numerical", "weight_runaway"),
    ),
    # loss spikes
    Scenario("spike_unnormalised_shard", "loss_spike", 300, _spike_bad_shard),
    Scenario("spike_mislabelled_shard", "loss_spike", 300, _spike_label_shard),
    Scenario("spike_lr_pulse", "loss_spike", 300, _spike_lr_pulse, also=("lr_too_high",)),
    # rising loss after an lr bump
    Scenario(
        "rising_after_adam_lr_bump", "lr_too_high", 250, _rising_after_lr_bump, also=("loss_spike",)
    ),
    Scenario(
        "rising_after_sgd_lr_bump",
        "lr_too_high",
        250,
        _rising_sgd_lr_bump,
        also=("loss_spike", "exploding_gradients"),
    ),
    # vanishing
    Scenario("deep_sigmoid_16", "vanishing_gradients", 1, _deep_sigmoid),
    Scenario("deep_sigmoid_10_narrow", "vanishing_gradients", 1, _deep_sigmoid_narrow),
)
