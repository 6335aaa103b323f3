"""Synthetic training streams: healthy controls and one stream per fault, for tests and calibration.

Every stream is a deterministic function of its :class:`Synth` spec (the
seed included) and yields ``Step``, ``Stats`` and ``Eval`` records in the
order a collector would see them. A healthy stream is a noisy loss decaying
towards a floor under a warm-up + cosine learning-rate schedule, layer grad
norms with lognormal noise, slowly growing weight norms, update ratios around
1e-3, ReLU outputs ~50% zeros (or tanh ~3% saturated) and evaluations a little
above the training loss. ``fault`` changes one thing from ``fault_at`` on.

Example::

    from gradwatch.rules import Engine, load_default_rules
    from gradwatch.rules.testing import Synth, feed_all

    alerts = feed_all(Engine(load_default_rules()), Synth(fault="spike").records())
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from gradwatch.rules.alert import Transition
from gradwatch.rules.engine import Engine
from gradwatch.rules.step import ActStats, Eval, Stats, Step

DEPTH = 6
LAYERS = tuple(f"layers.{i}.{kind}" for i in range(DEPTH) for kind in ("weight", "bias"))
ACT_MODULES = tuple(f"act.{i}" for i in range(DEPTH - 1))
FAULTS = (
    "nan",
    "spike",
    "divergence",
    "rising",
    "flat",
    "vanishing",
    "overfit",
    "saturation",
    "dead_relu",
    "weight_runaway",
    "update_high",
    "frozen",
    "loss_scale",
    "eval_mode",
    "idle",
    "partial_frozen",
)

Record = Step | Stats | Eval


@dataclass(frozen=True, slots=True)
class Synth:
    """One synthetic run; see the module docstring. ``step_seconds`` drives ``time``."""

    seed: int = 0
    steps: int = 3000
    job: str = "run"
    rank: int = 0
    first_step: int = 1
    noise: float = 0.1  # lognormal sigma of the per-step loss
    outliers: float = 0.0  # share of "hard batches": loss x U(1.2, 1.8) for one step
    start_loss: float = 2.5
    floor: float = 0.3
    speed: float = 500.0  # learning progress (in full-rate steps) to get half-way to the floor
    lr: float = 3e-4
    warmup: int = 100
    activation: str = "relu"
    stats_every: int = 50
    eval_every: int = 100
    amp: bool = False
    step_seconds: float = 0.5
    norm_noise: float = 0.3
    fault: str | None = None
    fault_at: int = 1000

    def records(self) -> Iterator[Record]:
        """The stream, in order."""
        return _Run(self).records()


class _Run:
    def __init__(self, spec: Synth) -> None:
        if spec.fault is not None and spec.fault not in FAULTS:
            raise ValueError(f"unknown fault {spec.fault!r}; expected one of {FAULTS}")
        self.s = spec
        self.rng = np.random.default_rng(spec.seed)
        self.scale = np.repeat(np.geomspace(0.3, 3.0, DEPTH), 2) * np.tile([1.0, 0.05], DEPTH)
        self.w0 = np.repeat(np.geomspace(8.0, 2.0, DEPTH), 2) * np.tile([1.0, 0.02], DEPTH)
        self.progress = 0.0
        self.frozen_level: float | None = None
        self.level = spec.start_loss
        self.loss_scale = 65536.0
        self.clean = 0
        self.eval_at_fault: float | None = None

    def faulty(self, t: int) -> bool:
        return self.s.fault is not None and t >= self.s.fault_at

    def lr(self, t: int) -> float:
        s = self.s
        if t < s.warmup:
            return s.lr * (t + 1) / s.warmup
        frac = (t - s.warmup) / max(1, s.steps - s.warmup)
        return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def records(self) -> Iterator[Record]:
        s = self.s
        for i in range(s.steps):
            t = s.first_step + i
            yield self.step(i, t)
            if s.stats_every and t % s.stats_every == 0:
                yield self.stats(i, t)
            if s.eval_every and t % s.eval_every == 0:
                yield self.eval(t)

    # ------------------------------------------------------------ per step

    def loss(self, i: int, t: int) -> float:
        s, rng = self.s, self.rng
        self.progress += self.lr(i) / s.lr
        level = s.floor + (s.start_loss - s.floor) / (1.0 + self.progress / s.speed)
        if s.fault == "flat":
            level = s.start_loss
        elif s.fault == "vanishing" and self.faulty(t):
            self.frozen_level = self.frozen_level or level
            level = self.frozen_level
        self.level = level
        noise = 0.005 if s.fault == "flat" else s.noise
        loss = level * float(rng.lognormal(0.0, noise)) if noise else level
        if s.outliers and rng.random() < s.outliers:
            loss *= float(rng.uniform(1.2, 1.8))
        if self.faulty(t):
            k = t - s.fault_at
            if s.fault == "spike" and k < 40:
                loss *= 1.0 + 2.0 * math.exp(-k / 6.0)
            elif s.fault == "divergence":
                loss *= math.exp(min(k / 30.0, 30.0))
            elif s.fault == "rising":
                loss *= 1.0 + k / 400.0
            elif s.fault == "nan" and k < 3:
                loss = math.nan
        return loss

    def norms(self, i: int, t: int) -> np.ndarray:
        s, rng = self.s, self.rng
        ramp = 0.2 + 0.8 * min(1.0, (i + 1) / max(1, s.warmup))
        norms: np.ndarray = (
            self.scale
            * ramp
            * float(rng.lognormal(0.0, s.norm_noise))
            * rng.lognormal(0.0, s.norm_noise / 2, self.scale.size)
        )
        if self.faulty(t):
            k = t - s.fault_at
            if s.fault == "spike" and k < 40:
                norms *= 1.0 + 4.0 * math.exp(-k / 6.0)
            elif s.fault == "divergence":
                norms *= 1.03 ** min(k, 2000)
            elif s.fault == "vanishing":
                norms *= 1e-9
            elif s.fault == "nan" and k < 3:
                norms[2 if k == 0 else slice(None)] = math.nan
        return norms

    def step(self, i: int, t: int) -> Step:
        s = self.s
        loss = self.loss(i, t)
        norms = self.norms(i, t)
        skipped = False
        scale: float | None = None
        if s.amp:
            skipped = (
                i < 3 or (i > 0 and i % 1499 == 0) or (s.fault == "loss_scale" and self.faulty(t))
            )
            if skipped:
                self.loss_scale /= 2.0
                self.clean = 0
                norms = np.full(norms.size, math.inf)
            else:
                self.clean += 1
                if self.clean % 2000 == 0:
                    self.loss_scale *= 2.0
            scale = self.loss_scale
        if s.fault == "idle" and self.faulty(t):
            skipped = True  # the loop stopped calling optimizer.step()
        grad_norm = float(np.sqrt(np.sum(norms**2)))
        return Step(
            job=s.job,
            step=t,
            time=t * s.step_seconds,
            rank=s.rank,
            loss=loss,
            grad_norm=grad_norm,
            layers=LAYERS,
            layer_norms=norms,
            lr=(self.lr(i),),
            loss_scale=scale,
            skipped=skipped,
        )

    def stats(self, i: int, t: int) -> Stats:
        s, rng = self.s, self.rng
        weights = (
            self.w0
            * (1.0 + 0.3 * (1.0 - math.exp(-i / 1000.0)))
            * rng.lognormal(0.0, 0.01, self.w0.size)
        )
        ratios = 1e-3 * (self.lr(i) / s.lr) * rng.lognormal(0.0, 0.3, self.w0.size)
        if self.faulty(t):
            k = (t - s.fault_at) // max(1, s.stats_every)
            if s.fault == "weight_runaway":
                weights = weights * 1.2 ** min(k, 300)
            elif s.fault == "update_high":
                ratios = ratios * 300.0
            elif s.fault == "frozen":
                ratios = np.zeros_like(ratios)
            elif s.fault == "partial_frozen":
                ratios[: ratios.size // 2] = 0.0  # the first blocks never move
        return Stats(
            job=s.job,
            step=t,
            time=t * s.step_seconds,
            rank=s.rank,
            layers=LAYERS,
            weight_norms=weights,
            update_ratios=ratios,
            act=self.acts(t),
        )

    def acts(self, t: int) -> tuple[ActStats, ...]:
        s, rng = self.s, self.rng
        kind = "tanh" if s.fault == "saturation" else s.activation
        out = []
        for j, module in enumerate(ACT_MODULES):
            if kind == "relu":
                zero = float(np.clip(0.5 + rng.normal(0.0, 0.05), 0.0, 1.0))
                if s.fault == "dead_relu" and self.faulty(t) and j == 1:
                    zero = float(np.clip(0.96 + rng.normal(0.0, 0.01), 0.0, 1.0))
                out.append(ActStats(module, "relu", mean=0.4, std=0.6, zero_frac=zero))
            else:
                sat = float(np.clip(0.03 * rng.lognormal(0.0, 0.3), 0.0, 1.0))
                if s.fault == "saturation" and self.faulty(t) and j == 0:
                    # Over the threshold from the fault's first sample on, as the real
                    # saturation faults are (a too-large init, inputs of a new scale, an lr
                    # x1000 step). A climb through the middle band over healthy-sized updates
                    # is the gradual kind, info (rules/activations.py: SaturationDetector).
                    sat = min(0.85, 0.6 + 0.05 * (t - s.fault_at) / max(1, s.stats_every))
                out.append(ActStats(module, kind, mean=0.0, std=0.5, sat_frac=sat))
        return tuple(out)

    def eval(self, t: int) -> Eval:
        s, rng = self.s, self.rng
        val = self.level * 1.08 * float(rng.lognormal(0.0, 0.01))
        if s.fault == "overfit" and self.faulty(t):
            self.eval_at_fault = self.eval_at_fault or val
            val = (
                self.eval_at_fault
                * (1.0 + (t - s.fault_at) / 1500.0)
                * float(rng.lognormal(0.0, 0.01))
            )
        modules = ("bn1", "dropout") if s.fault == "eval_mode" and self.faulty(t) else ()
        return Eval(
            job=s.job,
            step=t,
            time=t * s.step_seconds,
            rank=s.rank,
            loss=val,
            train_mode_modules=modules,
        )


# ---------------------------------------------------------------- catalogues


def healthy_controls(seed: int, steps: int = 3000) -> dict[str, Synth]:
    """Healthy runs that no default rule may alert on, one per shape that fools naive rules."""
    base = Synth(seed=seed, steps=steps)
    return {
        "baseline": base,
        "noisy_small_batch": replace(base, noise=0.3, speed=3000.0),
        "heavy_tailed": replace(base, outliers=0.01),
        "converged_flat_tail": replace(base, speed=30.0, floor=0.05),
        "long_warmup": replace(base, warmup=min(2000, steps // 2)),
        "smooth_full_batch": replace(base, noise=0.0, norm_noise=0.05),
        "amp": replace(base, amp=True),
        "tanh": replace(base, activation="tanh"),
        "resumed_converged": replace(base, first_step=50_000, start_loss=0.3, floor=0.3),
    }


def fault_run(fault: str, seed: int = 0, **changes: object) -> Synth:
    """The synthetic run of ``fault`` with sensible defaults for it (override any field)."""
    defaults: dict[str, object] = {"fault": fault, "seed": seed, "steps": 2000, "fault_at": 1000}
    if fault == "saturation":
        defaults["activation"] = "tanh"
    if fault == "loss_scale":
        defaults["amp"] = True
    defaults.update(changes)
    # The overrides arrive untyped (**changes: object); Synth's own fields check them.
    return Synth(**defaults)  # type: ignore[arg-type]


def worked_example(seed: int = 0, job: str = "seed-example") -> Iterator[Record]:
    """The seed's worked example: a 6-layer tanh MLP with a 10x too-large init, lr 0.1.

    tanh outputs saturate from the start; the layer-1/layer-6 grad-norm ratio
    sinks to ~1:800 by step 20; the loss goes NaN at step 40. Statistics every
    5 steps.
    """
    rng = np.random.default_rng(seed)
    for t in range(1, 41):
        log_ratio = -(1.0 + 1.9 * min(t, 20) / 20.0)  # 1:10 at the start, ~1:800 by step 20
        module = 10.0 ** (log_ratio * (1.0 - np.arange(DEPTH) / (DEPTH - 1)))
        norms = (
            np.repeat(module, 2) * np.tile([1.0, 0.1], DEPTH) * rng.lognormal(0.0, 0.05, 2 * DEPTH)
        )
        loss = 2.3 * (1.0 - 0.002 * t) * float(rng.lognormal(0.0, 0.02))
        if t == 40:
            loss, norms = math.nan, np.full(2 * DEPTH, math.nan)
        yield Step(
            job=job,
            step=t,
            time=float(t),
            loss=loss,
            layers=LAYERS,
            layer_norms=norms,
            lr=(0.1,),
            grad_norm=float(np.sqrt(np.sum(norms**2))),
        )
        if t % 5 == 0 and t < 40:
            acts = tuple(
                ActStats(
                    f"layers.{j}",
                    "tanh",
                    mean=0.0,
                    std=0.97,
                    sat_frac=float(min(1.0, 0.9 + rng.normal(0.0, 0.02))),
                )
                for j in range(DEPTH - 1)
            )
            yield Stats(job=job, step=t, time=float(t), layers=LAYERS, act=acts)


def feed_all(engine: Engine, records: Iterable[Record]) -> list[Transition]:
    """Feed ``records`` in order; return every transition they caused."""
    out: list[Transition] = []
    for record in records:
        out += engine.feed(record)
    return out
