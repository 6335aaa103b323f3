"""A scored fault suite: small real PyTorch runs through the real gradwatch path.

Each :class:`Scenario` trains a tiny model on CPU (seeded, seconds at most) with
the agent attached; the agent ships over ZeroMQ loopback to an in-process
collector ``Server`` (fresh ``CollectorRegistry``, default rules) whose only
sink captures alert transitions in memory. :func:`run_scenario` returns what
fired and scores it against the scenario's expectation: the expected category
fired or not, steps from the fault's onset to the alert's step, and "other
alerts" (for a fault: alerts of another category that began before the
expected one; for a healthy control: every alert, i.e. false alarms).

Used by ``tests/scenarios/test_scenarios.py`` and ``benchmarks/fault_suite.py``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch import nn
from torch.nn import functional as F

import gradwatch
from gradwatch import seed_example
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.collector.sinks import SinkStats

DRAIN_TIMEOUT_S = 10.0
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


# --------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Fired:
    rule: str
    category: str
    step: int
    severity: str = "warning"


class CaptureSink:
    """A ``Sink`` that keeps every firing transition in memory."""

    name = "capture"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.alerts: list[Any] = []  # the firing Alert records, diagnosis included

    def start(self) -> None:
        pass

    def notify(self, transition: Any) -> None:
        if transition.current == "firing":
            a = transition.alert
            with self._lock:
                self.alerts.append(a)

    @property
    def fired(self) -> list[Fired]:
        with self._lock:
            return [
                Fired(a.rule, str(a.category), int(a.step), str(a.severity)) for a in self.alerts
            ]

    def close(self, timeout: float) -> None:
        pass

    def alive(self) -> bool:
        return False  # no thread of its own; stop() reads this as "closed"

    def stats(self) -> SinkStats:
        return SinkStats()


class Ctx:
    """What a scenario's ``run`` gets: ``watch`` bound to the collector, and a clock to move."""

    def __init__(self, server: Server, job: str, clock: _Clock) -> None:
        self.server = server
        self.job = job
        self._clock = clock
        self.monitors: list[Any] = []

    def watch(self, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> Any:
        kw.setdefault("flush_every", 10)
        kw.setdefault("stats_every", 10)
        mon = gradwatch.watch(model, opt, job=self.job, endpoint=self.server.bound_endpoint, **kw)
        self.monitors.append(mon)
        return mon

    def advance_clock(self, seconds: float) -> None:
        self._clock.offset += seconds

    def drain(self, mon: Any) -> None:
        """Wait until the collector has handled every step this monitor logged so far.

        Call it at a flush boundary (steps a multiple of ``flush_every``): rows still
        in the agent's device buffer are not shipped until the next flush.
        """
        _wait_drained(self.server, [mon])


class _Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def _sent(mon: Any) -> int:
    s = mon.stats
    return s.batches_sent + s.heartbeats_sent + s.events_sent + s.stats_sent


def _shipped(mon: Any) -> bool:
    """Every logged step has left the agent (sent or dropped): none waits in its queue."""
    s = mon.stats
    return s.steps_sent + s.steps_dropped >= s.steps_logged


def _wait_drained(server: Server, monitors: Sequence[Any]) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        # The shipper polls its queue (agent/workqueue.py): a batch logged just now may
        # not be sent yet, and counting only what was sent would return before it is.
        if not all(_shipped(m) for m in monitors):
            time.sleep(0.01)  # bounded poll of the agent's own counters, not a settle wait
            continue
        want = sum(_sent(m) for m in monitors)
        if server.wait_for_messages(want, timeout=0.2) and sum(_sent(m) for m in monitors) == want:
            return


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """``category`` None: a healthy control. ``also``: other categories that count as a catch.

    ``allow``: for a control, the highest severity it may raise (None: nothing at all;
    "info": a deliberate choice worth a note, e.g. a frozen backbone). ``needs``: a known
    gap (strict xfail). ``pending``: waits for a feature being built (non-strict xfail).
    ``slow``: too slow for CI; run by ``benchmarks/fault_suite.py`` only.
    """

    name: str
    category: str | None
    onset: int
    run: Callable[[Ctx], None]
    also: tuple[str, ...] = ()
    needs: str | None = None  # why the current system cannot catch it (xfail), if so
    requires: str | None = None  # a module the detection depends on (absent: xfail)
    allow: str | None = None
    pending: str | None = None
    slow: bool = False

    @property
    def accepted(self) -> tuple[str, ...]:
        return ((self.category,) if self.category else ()) + self.also


@dataclass
class Result:
    scenario: Scenario
    fired: list[Fired]
    seconds: float
    detected: bool = False
    latency: int | None = None
    other: list[Fired] = field(default_factory=list)
    alerts: list[Any] = field(default_factory=list)

    @property
    def false_alarm(self) -> bool:
        return self.scenario.category is None and bool(self.other)

    def to_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "name": s.name,
            "category": s.category,
            "onset": s.onset,
            "detected": self.detected,
            "latency": self.latency,
            "fired": [f.__dict__ for f in self.fired],
            "other": [f.__dict__ for f in self.other],
            "known_undetectable": s.needs,
            "pending": s.pending,
            "seconds": round(self.seconds, 2),
        }


def score(s: Scenario, fired: list[Fired], seconds: float) -> Result:
    r = Result(s, sorted(fired, key=lambda f: f.step), seconds)
    if s.category is None:
        allowed = SEVERITY_RANK[s.allow] if s.allow else -1
        r.other = [f for f in r.fired if SEVERITY_RANK.get(f.severity, 2) > allowed]
        return r
    hits = [f for f in r.fired if f.category in s.accepted]
    if hits:
        first = min(f.step for f in hits)
        r.detected = True
        r.latency = first - s.onset
        r.other = [f for f in r.fired if f.category not in s.accepted and f.step < first]
    else:
        r.other = [f for f in r.fired if f.category not in s.accepted]
    return r


def run_scenario(s: Scenario) -> Result:
    clock = _Clock()
    sink = CaptureSink()
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"),
        registry=CollectorRegistry(),
        clock=clock,
        sinks=[sink],
    )
    server.start()
    ctx = Ctx(server, s.name, clock)
    started = time.monotonic()
    threads = torch.get_num_threads()
    # One intra-op thread: tiny models gain nothing from more, and OpenMP workers spinning
    # beside the agent's and the collector's threads on a small, busy machine cost 10x.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        s.run(ctx)
        for mon in ctx.monitors:
            mon.close()
        _wait_drained(server, ctx.monitors)
    finally:
        for mon in ctx.monitors:
            mon.close()
        server.stop(timeout=5.0)
        torch.set_num_threads(threads)
    result = score(s, list(sink.fired), time.monotonic() - started)
    result.alerts = list(sink.alerts)
    return result


# --------------------------------------------------------------------------- training helpers

N_IN, N_CLS = 16, 4


def teacher(seed: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(N_IN, 32, generator=g), torch.randn(32, N_CLS, generator=g)
    return lambda x: (torch.tanh(x @ w1) @ w2).argmax(1)


def mlp(
    depth: int = 2,
    width: int = 32,
    act: type[nn.Module] = nn.ReLU,
    n_in: int = N_IN,
    n_out: int = N_CLS,
    bn: bool = False,
    dropout: float = 0.0,
) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = n_in
    for _ in range(depth):
        layers.append(nn.Linear(d, width))
        if bn:
            layers.append(nn.BatchNorm1d(width))
        layers.append(act())
        if dropout:
            layers.append(nn.Dropout(dropout))
        d = width
    layers.append(nn.Linear(d, n_out))
    return nn.Sequential(*layers)


def classify(
    ctx: Ctx,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    batch: int = 64,
    label: Callable[[torch.Tensor], torch.Tensor] | None = None,
    inputs: Callable[[int], torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    before_step: Callable[[int], None] | None = None,
    after_backward: Callable[[int], None] | None = None,
    do_step: Callable[[int], bool] | None = None,
    eval_every: int = 0,
    eval_fn: Callable[[], torch.Tensor] | None = None,
    sched: Any = None,
    data_change_at: int | None = None,
    **watch_kw: Any,
) -> Any:
    """One plain classification loop; the hooks inject each fault at its step.

    ``data_change_at``: the loop announces a planned data change before that step.
    """
    label = label or teacher()
    mon = ctx.watch(model, opt, **watch_kw)
    for step in range(1, steps + 1):
        if step == data_change_at:
            mon.data_changed("switched to a new task")
        if before_step:
            before_step(step)
        x = inputs(step) if inputs else torch.randn(batch, N_IN)
        y = label(x)
        out = model(x)
        loss = loss_fn(out, y, step) if loss_fn else F.cross_entropy(out, y)
        loss.backward()
        if after_backward:
            after_backward(step)
        if do_step is None or do_step(step):
            opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if eval_every and step % eval_every == 0 and eval_fn is not None:
            with torch.no_grad():
                mon.log_eval(loss=eval_fn())
    return mon


def least_squares(
    ctx: Ctx,
    steps: int,
    lr: Callable[[int], float],
    *,
    sign: float = 1.0,
    noise: float = 0.1,
    batch: int = 64,
    **watch_kw: Any,
) -> Any:
    """SGD on least squares: stable only for lr < 2/lambda_max(H) (about 0.6 here)."""
    feats = torch.randn(512, 32)
    targets = feats @ torch.randn(32, 1) + noise * torch.randn(512, 1)
    model = nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr(1))
    mon = ctx.watch(model, opt, **watch_kw)
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr(step)
        idx = torch.randint(0, 512, (batch,))
        loss = sign * F.mse_loss(model(feats[idx]), targets[idx])
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
    return mon


# --------------------------------------------------------------------------- faults


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


def _frozen_zero_grad_before_step(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # zero_grad() between backward and step: every update is zero
    classify(ctx, model, opt, 300, after_backward=lambda s: opt.zero_grad())


def _frozen_requires_grad_off(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for p in list(model.parameters())[:-2]:
        p.requires_grad_(False)  # "freeze the backbone" forgotten on
    classify(ctx, model, opt, 300)


def _lr_zero(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # scheduler bug: lr multiplied by 0
    classify(ctx, model, opt, 300)


def _detached_graph(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bias = nn.Parameter(torch.zeros(N_CLS))  # the only parameter still in the graph
    opt.add_param_group({"params": [bias]})

    def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        return F.cross_entropy(out.detach() + bias * 0, y)

    classify(ctx, model, opt, 300, loss_fn=loss_fn)


def _constant_inputs(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    classify(
        ctx,
        model,
        opt,
        400,
        inputs=lambda s: torch.zeros(64, N_IN),
        label=lambda x: torch.randint(0, N_CLS, (len(x),), generator=g),
    )


def _shuffled_labels(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(4)
    classify(ctx, model, opt, 400, label=lambda x: torch.randint(0, N_CLS, (len(x),), generator=g))


def _missing_optimizer_step(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 300, do_step=lambda s: False)


def _overfit(ctx: Ctx, n_train: int = 32, noise: float = 0.0) -> None:
    model = mlp(depth=2, width=128)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()
    xtr, xva = torch.randn(n_train, N_IN), torch.randn(512, N_IN)
    ytr, yva = t(xtr), t(xva)
    if noise:
        flip = torch.rand(n_train) < noise
        ytr[flip] = torch.randint(0, N_CLS, (int(flip.sum()),))
    classify(
        ctx,
        model,
        opt,
        400,
        inputs=lambda s: xtr,
        label=lambda x: ytr,
        eval_every=20,
        eval_fn=lambda: F.cross_entropy(model(xva), yva),
    )


def _eval_train_mode(ctx: Ctx, bn: bool, dropout: float) -> None:
    model = mlp(bn=bn, dropout=dropout)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t = teacher()
    xva = torch.randn(256, N_IN)
    # forgot model.eval() before validation (and model.train() after)
    classify(
        ctx, model, opt, 100, eval_every=20, eval_fn=lambda: F.cross_entropy(model(xva), t(xva))
    )


def _weight_runaway(ctx: Ctx, in_loss: bool) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    if in_loss:  # an L2 penalty added with the wrong sign

        def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
            return F.cross_entropy(out, y) - 0.2 * sum((p * p).sum() for p in params)

        classify(ctx, model, opt, 200, loss_fn=loss_fn)
    else:  # hand-written decoupled weight decay with the wrong sign

        def decay(step: int) -> None:
            with torch.no_grad():
                for p in params:
                    p.grad.add_(p, alpha=-0.4)

        classify(ctx, model, opt, 200, after_backward=decay)


def _amp_overflow_storm(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    t = teacher()
    mon = ctx.watch(model, opt, scaler=scaler)
    for step in range(1, 301):
        x = torch.randn(64, N_IN)
        if step >= 100:
            x = x * 1e5  # an unnormalised feature shard: fp16 activations overflow
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), t(x))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        mon.log(loss=loss)
        opt.zero_grad()


def _hung_step(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = classify(ctx, model, opt, 100, heartbeat_every=0.1)
    ctx.drain(mon)  # every step is in; the loop now "hangs" with heartbeats running
    for _ in range(3):
        ctx.advance_clock(200.0)  # 600 s of injected time, no step
        before = ctx.server.messages_handled
        ctx.server.wait_for_messages(before + 1, timeout=2.0)  # a heartbeat at the new time
        ctx.server.tick()


def _saturated_tanh(ctx: Ctx) -> None:
    model = mlp(depth=4, width=64, act=nn.Tanh)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.mul_(8.0)  # init far too large: tanh pinned at +-1
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    classify(ctx, model, opt, 200)


def _saturated_sigmoid_inputs(ctx: Ctx) -> None:
    model = mlp(depth=3, width=64, act=nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 200, inputs=lambda s: torch.randn(64, N_IN) * 50)


def _dead_relu_bias(ctx: Ctx) -> None:
    model = mlp(depth=3, width=64)
    with torch.no_grad():
        for m in list(model)[:-1]:
            if isinstance(m, nn.Linear):
                m.bias.fill_(-6.0)  # a bad bias init: nearly every ReLU outputs 0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classify(ctx, model, opt, 200)


def _bf16_updates_rounded_away(ctx: Ctx) -> None:
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)  # every update below bf16's precision
    classify(
        ctx,
        model,
        opt,
        300,
        inputs=lambda s: torch.randn(64, N_IN, dtype=torch.bfloat16),
        label=lambda x: teacher()(x.float()),
        loss_fn=lambda o, y, s: F.cross_entropy(o.float(), y),
    )


# --------------------------------------------------------------------------- controls


def _healthy_sgd(ctx: Ctx) -> None:
    model = mlp()
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 400)


def _healthy_adam(ctx: Ctx) -> None:
    model = mlp(depth=3)
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), 400)


def _converged_flat_tail(ctx: Ctx) -> None:
    least_squares(ctx, 600, lambda s: 0.1, noise=0.05)


def _many_inactive_relus(ctx: Ctx) -> None:
    model = mlp(depth=1, width=256)
    with torch.no_grad():
        model[0].bias.fill_(-0.6)  # ~85% of ReLU outputs are zero; the rest learn fine
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 400)


def _noisy_small_batch(ctx: Ctx) -> None:
    model = mlp()
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.02), 500, batch=2)


def _dataset_shift(ctx: Ctx) -> None:
    model = mlp()
    t = teacher()
    # the same task on a new input distribution from step 250 (a second data source)
    classify(
        ctx,
        model,
        torch.optim.Adam(model.parameters(), lr=2e-3),
        500,
        inputs=lambda s: (
            torch.randn(64, N_IN) * (1.0 if s < 250 else 1.3) + (0.0 if s < 250 else 0.3)
        ),
        label=t,
    )


def _task_switch(ctx: Ctx, announced: bool = True) -> None:
    model = mlp()
    t1, t2 = teacher(1), teacher(2)
    box = [0]
    classify(
        ctx,
        model,
        torch.optim.Adam(model.parameters(), lr=2e-3),
        500,
        label=lambda x: t1(x) if box[0] < 250 else t2(x),
        before_step=lambda s: box.__setitem__(0, s),
        data_change_at=250 if announced else None,
    )


def seed_worked_example(
    ctx: Ctx | None, init_scale: float, full_steps: int = 300, **watch_kw: Any
) -> list[float]:
    """The seed's worked example (``gradwatch.seed_example``), watched through ``ctx``."""
    x, y = seed_example.tabular()
    watch = (lambda model, opt: ctx.watch(model, opt, **watch_kw)) if ctx is not None else None
    return seed_example.run(seed_example.seed_model(init_scale), x, y, watch, full_steps=full_steps)


def _warmup_cosine(ctx: Ctx) -> None:
    model = mlp(depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps, warm = 500, 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warm
            if s < warm
            else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
        ),
    )
    classify(ctx, model, opt, steps, sched=sched)


def _step_decay(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    classify(ctx, model, opt, 400, sched=torch.optim.lr_scheduler.StepLR(opt, 150, 0.1))


def _amp_healthy(ctx: Ctx) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    t = teacher()
    mon = ctx.watch(model, opt, scaler=scaler)
    for _ in range(1, 301):
        x = torch.randn(64, N_IN)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), t(x))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        mon.log(loss=loss)
        opt.zero_grad()


def _healthy_eval_bn(ctx: Ctx) -> None:
    model = mlp(bn=True, dropout=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    t = teacher()
    xva = torch.randn(512, N_IN)
    yva = t(xva)
    mon = ctx.watch(model, opt)
    for step in range(1, 401):
        x = torch.randn(64, N_IN)
        loss = F.cross_entropy(model(x), t(x))
        loss.backward()
        opt.step()
        mon.log(loss=loss)
        opt.zero_grad()
        if step % 25 == 0:
            model.eval()
            with torch.no_grad():
                mon.log_eval(loss=F.cross_entropy(model(xva), yva))
            model.train()


def _healthy_residual_deep(ctx: Ctx) -> None:
    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(N_IN, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))
            self.out = nn.Linear(32, N_CLS)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = h + 0.5 * F.relu(b(h))
            return self.out(h)

    model = Res()
    classify(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), 400)


def _healthy_tanh(ctx: Ctx) -> None:
    model = mlp(depth=3, act=nn.Tanh)
    classify(ctx, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 400)


def _healthy_weight_decay_long(ctx: Ctx) -> None:
    model = mlp(width=64)
    classify(ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05), 800)


ACT = "gradwatch.agent.activations"  # the agent's activation statistics (saturation, dead units)
PARTIAL_FREEZE = (
    "a backbone frozen with requires_grad_(False) before watch(): the census "
    "counts it (params_frozen) but no rule pages on it, since a deliberate "
    "head-only fine-tune (families.healthy_head_only_finetune) looks the same "
    "except that its optimizer does not hold the frozen parameters"
)

SCENARIOS: tuple[Scenario, ...] = (
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
    # dead pipeline / frozen
    Scenario(
        "frozen_zero_grad_before_step",
        "dead_pipeline",
        1,
        _frozen_zero_grad_before_step,
        also=("update_ratio", "vanishing_gradients"),
    ),
    Scenario(
        "frozen_backbone_requires_grad_off",
        "update_ratio",
        1,
        _frozen_requires_grad_off,
        also=("dead_pipeline",),
        needs=PARTIAL_FREEZE,
    ),
    Scenario(
        "bf16_updates_rounded_away",
        "update_ratio",
        1,
        _bf16_updates_rounded_away,
        also=("dead_pipeline",),
    ),
    Scenario("lr_zero", "dead_pipeline", 1, _lr_zero, also=("update_ratio",)),
    Scenario(
        "detached_graph",
        "dead_pipeline",
        1,
        _detached_graph,
        also=("vanishing_gradients", "update_ratio"),
    ),
    Scenario("constant_inputs", "dead_pipeline", 1, _constant_inputs),
    Scenario("shuffled_labels", "dead_pipeline", 1, _shuffled_labels),
    Scenario(
        "missing_optimizer_step",
        "dead_pipeline",
        1,
        _missing_optimizer_step,
        also=("update_ratio",),
    ),
    # generalization
    Scenario("overfit_32_samples", "generalization_gap", 1, lambda c: _overfit(c, 32)),
    Scenario("overfit_noisy_labels", "generalization_gap", 1, lambda c: _overfit(c, 64, noise=0.3)),
    # eval wiring
    Scenario(
        "eval_batchnorm_train_mode",
        "eval_mode_wiring",
        20,
        lambda c: _eval_train_mode(c, bn=True, dropout=0.0),
    ),
    Scenario(
        "eval_dropout_train_mode",
        "eval_mode_wiring",
        20,
        lambda c: _eval_train_mode(c, bn=False, dropout=0.3),
    ),
    # weights
    Scenario(
        "negative_weight_decay", "weight_runaway", 1, lambda c: _weight_runaway(c, in_loss=False)
    ),
    Scenario(
        "negative_l2_penalty_in_loss",
        "weight_runaway",
        1,
        lambda c: _weight_runaway(c, in_loss=True),
    ),
    # AMP
    Scenario("amp_fp16_overflow_storm", "loss_scale_collapse", 100, _amp_overflow_storm),
    # liveness
    Scenario("hung_step_heartbeats_continue", "stalled", 100, _hung_step),
    # activations
    Scenario("tanh_saturated_init", "saturation", 1, _saturated_tanh, requires=ACT),
    Scenario("sigmoid_saturated_inputs", "saturation", 1, _saturated_sigmoid_inputs, requires=ACT),
    Scenario("dead_relu_bias_init", "dead_units", 1, _dead_relu_bias, requires=ACT),
    # the seed's worked example, run for real (README: what actually happens)
    Scenario(
        "seed_example_xavier_x10",
        "saturation",
        1,
        lambda c: seed_worked_example(c, init_scale=10.0),
        requires=ACT,
    ),
    # healthy controls
    Scenario("healthy_sgd_momentum", None, 0, _healthy_sgd),
    Scenario("healthy_adam", None, 0, _healthy_adam),
    Scenario("healthy_converged_flat_tail", None, 0, _converged_flat_tail),
    Scenario("healthy_many_inactive_relus", None, 0, _many_inactive_relus),
    Scenario("healthy_noisy_batch_of_2", None, 0, _noisy_small_batch),
    Scenario("healthy_dataset_shift_midrun", None, 0, _dataset_shift),
    Scenario("healthy_task_switch_announced", None, 0, _task_switch),
    # Unannounced, the jump is worth a note (LossLevelShift, info: "call mon.data_changed()"),
    # never a page: the run learns the new task (the loss falls steadily, gradients calm).
    Scenario(
        "healthy_task_switch_unannounced",
        None,
        0,
        lambda c: _task_switch(c, announced=False),
        allow="info",
    ),
    Scenario(
        "healthy_seed_example_fixed_init", None, 0, lambda c: seed_worked_example(c, init_scale=1.0)
    ),
    Scenario("healthy_warmup_cosine", None, 0, _warmup_cosine),
    Scenario("healthy_step_decay", None, 0, _step_decay),
    Scenario("healthy_amp_fp16", None, 0, _amp_healthy),
    Scenario("healthy_eval_bn_dropout", None, 0, _healthy_eval_bn),
    Scenario("healthy_residual_deep", None, 0, _healthy_residual_deep),
    Scenario("healthy_tanh", None, 0, _healthy_tanh),
    Scenario("healthy_adamw_long", None, 0, _healthy_weight_decay_long),
)

BY_NAME = {s.name: s for s in SCENARIOS}
