"""One training step as the rules see it: host-side numbers, already decoded.

The collector builds these from wire batches; ``gradwatch replay`` builds them
from trace lines. ``None`` always means "not measured", never zero.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import cast

import numpy as np

from gradwatch.wire.census import ROLES, Census

__all__ = [
    "FLOAT32_MAX",
    "ROLES",
    "ActStats",
    "Census",
    "Eval",
    "Liveness",
    "QuietRows",
    "Stats",
    "Step",
    "build_liveness",
    "build_step",
    "nonfinite_layers",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True, slots=True)
class Step:
    """Signals of one optimizer step of one job (one rank, or ranks combined).

    ``layer_norms`` are per-parameter gradient L2 norms in model order, float64,
    aligned with ``layers``; a non-finite entry means that layer's gradient held
    a NaN or Inf. ``grad_norm`` is the total norm *before* clipping when the loop
    reported it (``mon.log(grad_norm=clip_grad_norm_(...))``), else the norm of
    the gradients the optimizer saw.
    """

    job: str
    step: int
    time: float
    rank: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    layers: tuple[str, ...] = ()
    layer_norms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    lr: tuple[float, ...] = ()
    loss_scale: float | None = None
    skipped: bool = False
    scalars: Mapping[str, float] = field(default_factory=dict)
    # Largest finite value of the gradients' dtype: the growth detector projects
    # how many steps remain until the total norm overflows it.
    dtype_max: float = FLOAT32_MAX
    # True when ``grad_norm`` is what the loop logged, not the layers' total.
    grad_norm_logged: bool = False
    # Multi-rank jobs (gradwatch.rules.assembly): the world size and shard
    # count the agent declared (``shards`` 0: not declared, each rank is judged
    # alone). An assembled step combines ``assembled`` rank reports; ``blame``
    # names, per non-finite layer (and "loss"), the rank where it went
    # non-finite first in the current incident.
    world: int = 1
    shards: int = 0
    assembled: int = 0
    blame: Mapping[str, int] = field(default_factory=dict)
    # Contract C1: each layer's role, aligned with ``layers`` ("weight",
    # "embedding", "tied", "norm", "bias", "other"; see gradwatch.wire.census).
    # Empty: unknown (an older agent, an imported log), so rules fall back to
    # name and shape heuristics.
    layer_roles: tuple[str, ...] = ()


class _StepBuilder:
    """Builds a ``Step`` at the cost of a plain class (see :func:`build_step`).

    A frozen dataclass sets each field through ``object.__setattr__``: 19 calls,
    ~4 us per ``Step``; the collector builds one per rank per step (163,840 per
    flush of a 16,384-rank job, issue 17). This class has the same slots, so it
    assigns them directly, then becomes a ``Step``: a CPython-supported
    ``__class__`` assignment between classes of identical layout. The result is
    an ordinary ``Step``: frozen, equal to one built by ``Step(...)``.
    """

    __slots__ = Step.__slots__

    def __init__(
        self,
        job: str,
        step: int,
        time: float,
        rank: int,
        loss: float | None,
        grad_norm: float | None,
        layers: tuple[str, ...],
        layer_norms: np.ndarray,
        lr: tuple[float, ...],
        loss_scale: float | None,
        skipped: bool,
        scalars: Mapping[str, float],
        dtype_max: float,
        grad_norm_logged: bool,
        world: int,
        shards: int,
        layer_roles: tuple[str, ...],
    ) -> None:
        self.job = job
        self.step = step
        self.time = time
        self.rank = rank
        self.loss = loss
        self.grad_norm = grad_norm
        self.layers = layers
        self.layer_norms = layer_norms
        self.lr = lr
        self.loss_scale = loss_scale
        self.skipped = skipped
        self.scalars = scalars
        self.dtype_max = dtype_max
        self.grad_norm_logged = grad_norm_logged
        self.world = world
        self.shards = shards
        self.assembled = 0
        self.blame: Mapping[str, int] = {}
        self.layer_roles = layer_roles
        self.__class__ = Step  # type: ignore[assignment]  # same slots: see the class doc


def _check_builder(builder: type, cls: type, defaults: tuple[str, ...]) -> None:
    """A field added to ``cls`` must be added to its ``builder`` too (checked at import)."""
    wanted = tuple(f.name for f in fields(cls))
    init = vars(builder)["__init__"].__code__  # the builder's own, not an inherited one
    given = (*init.co_varnames[1 : init.co_argcount], *defaults)
    if getattr(builder, "__slots__", ()) != wanted or sorted(given) != sorted(wanted):
        raise RuntimeError(
            f"gradwatch.rules.step: {builder.__name__} sets {sorted(given)} but "
            f"{cls.__name__} has {sorted(wanted)}; update {builder.__name__}.__init__"
        )


_check_builder(_StepBuilder, Step, ("assembled", "blame"))


# ``Step(...)`` with every field but ``assembled`` and ``blame`` given (by keyword,
# as _StepBuilder.__init__ names them), ~4x cheaper: for hot paths that build one
# per rank report (collector/rows.py). The result is a ``Step``, equal to
# ``Step(...)`` with the same arguments, and as frozen.
build_step = cast(Callable[..., Step], _StepBuilder)


@dataclass(frozen=True, slots=True, eq=False)
class QuietRows:
    """The rows of one rank's batch that carries no layer norms, as columns.

    At 16,384 ranks of a 3D-parallel job only one replica per model shard sends
    layer norms: a flush is 16,352 batches like this one (issue 17). The
    collector's per-rank state and the assembler read these columns instead of
    one ``Step`` per row (``StateStore.observe_quiet``, ``Assembler.add_quiet``),
    and build a row's ``Step`` (``step(r)``: the one the collector would have
    built for that row) only where one is kept: a rank's latest step, a pending
    step's lowest rank, a report that takes the assembler's general path.

    Per row ``r``: ``loss`` and ``grad_norm`` (None: not measured), ``skipped``,
    ``flagged`` (the rank's own gradients went non-finite: its
    ``grad_nonfinite`` scalar is over 0.5), ``data`` (its ``data_seconds``
    scalar) and ``busy`` (the sum of its step-phase scalars, None without any),
    as ``rules.liveness.PhaseTimes.observe`` reads them from a ``Step``.
    """

    job: str
    rank: int
    world: int
    shards: int
    steps: tuple[int, ...]
    times: tuple[float, ...]
    loss: Sequence[float | None]
    grad_norm: Sequence[float | None]
    skipped: Sequence[bool]
    flagged: Sequence[bool]
    data: Sequence[float | None]
    busy: Sequence[float | None]
    build: Callable[[int], Step]  # row r's Step

    def step(self, r: int) -> Step:
        return self.build(r)

    def all_steps(self) -> tuple[Step, ...]:
        return tuple(self.build(r) for r in range(len(self.steps)))


@dataclass(frozen=True, slots=True)
class ActStats:
    """Forward-activation statistics of one module on a cadence step.

    ``kind`` is the module's nonlinearity family: "relu", "relu6", "tanh",
    "sigmoid", "gelu", "silu", "softmax" or "other" (mean and std only).
    ``zero_frac`` is the share of *dead* outputs: exact zeros for ReLU/ReLU6,
    the flat negative tail for GELU (input below -3) and SiLU (input below -6).
    ``sat_frac`` is the share of *saturated* outputs: pinned near a bound for
    tanh/sigmoid, and for softmax the share of rows whose largest probability
    exceeds 0.99 (one-hot attention). Each is None where it does not apply.
    A ``module`` ending in ":input" is the input of that module, measured as
    the activation the user named (functional activations; agent/activations.py).
    """

    module: str
    kind: str
    mean: float
    std: float
    zero_frac: float | None = None
    sat_frac: float | None = None


@dataclass(frozen=True, slots=True)
class Stats:
    """Cadence-step statistics (every ``stats_every`` steps) of one rank.

    ``weight_norms`` and ``update_ratios`` (‖Δw‖/‖w‖ of the step's update) are
    aligned with ``layers`` (parameter names in model order); None means not
    measured.
    """

    job: str
    step: int
    time: float
    rank: int = 0
    layers: tuple[str, ...] = ()
    weight_norms: np.ndarray | None = None
    update_ratios: np.ndarray | None = None
    act: tuple[ActStats, ...] = ()
    # As on ``Step``: declared topology, and how many rank reports were combined.
    world: int = 1
    shards: int = 0
    assembled: int = 0
    # Contract C2: the model's census on this cadence step (frozen and
    # optimizer-less parameters, tied groups, modules in eval mode while
    # training). The agent sends one on every cadence sample; None: not
    # measured (an older agent, an imported log, or stats from before attach).
    census: Census | None = None


@dataclass(frozen=True, slots=True)
class Eval:
    """An evaluation the loop logged with ``mon.log_eval(loss=...)``.

    ``train_mode_modules`` names the BatchNorm/Dropout-family modules that were
    in training mode when the eval was logged (they should be none).
    """

    job: str
    step: int
    time: float
    rank: int = 0
    loss: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    train_mode_modules: tuple[str, ...] = ()
    assembled: int = 0  # nonzero: judged as the job's, not as this rank's


@dataclass(frozen=True, slots=True)
class Liveness:
    """What the collector knows of one rank's progress at ``now`` (from ticks).

    A rank whose heartbeats keep arriving while ``last_step`` stays put is hung
    (e.g. a stuck collective); one whose heartbeats stop is silent.
    """

    job: str
    rank: int
    now: float
    last_step: int
    last_step_time: float
    last_heartbeat_time: float
    step_seconds: float | None = None
    # The step whose forward began (heartbeat ``started``), None if unknown: a
    # rank stalled at ``last_step`` that has not started the next step is the one
    # the others wait for.
    started: int | None = None
    # Median host seconds per step waiting for data, and before the gradient
    # sync (data plus forward passes), as the agent measured them; the
    # straggler detector compares ranks on these, since synchronous ranks
    # share one step time.
    data_seconds: float | None = None
    busy_seconds: float | None = None


class _LivenessBuilder:
    """Builds a ``Liveness`` at the cost of a plain class, as ``_StepBuilder`` does a ``Step``.

    The collector builds one per rank every second (16,384 per tick, issue 17).
    """

    __slots__ = Liveness.__slots__

    def __init__(
        self,
        job: str,
        rank: int,
        now: float,
        last_step: int,
        last_step_time: float,
        last_heartbeat_time: float,
        step_seconds: float | None,
        started: int | None,
        data_seconds: float | None,
        busy_seconds: float | None,
    ) -> None:
        self.job = job
        self.rank = rank
        self.now = now
        self.last_step = last_step
        self.last_step_time = last_step_time
        self.last_heartbeat_time = last_heartbeat_time
        self.step_seconds = step_seconds
        self.started = started
        self.data_seconds = data_seconds
        self.busy_seconds = busy_seconds
        self.__class__ = Liveness  # type: ignore[assignment]  # same slots: see _StepBuilder


_check_builder(_LivenessBuilder, Liveness, ())

# ``Liveness(...)`` with every field given, positionally in field order, ~4x cheaper.
build_liveness = cast(Callable[..., Liveness], _LivenessBuilder)


def nonfinite_layers(step: Step) -> frozenset[str]:
    """Names of the layers whose gradient norm is NaN or Inf at ``step``."""
    norms = step.layer_norms
    if norms.size == 0 or np.isfinite(norms).all():
        return frozenset()
    bad = (~np.isfinite(norms)).tolist()
    return frozenset(name for name, is_bad in zip(step.layers, bad, strict=True) if is_bad)
