"""Layer-ratio detector: the first and last layers' grad norms drift orders of magnitude apart.

Seed, Stage 3: "a ratio of more than roughly two orders of magnitude between the
first and last layers signals vanishing or exploding gradients depending on
direction" (first ≪ last: vanishing; first ≫ last: exploding). AUTOTRAINER
(Zhang et al., ICSE 2021) flags first/last below 1e-3 for vanishing.

What counts as a layer (:mod:`gradwatch.rules.roles`): the ratio's ends are
weight matrices (linear, convolution, attention projections), never a
normalisation gain, a bias or a tied embedding, whose gradients do not scale
with depth; plain embeddings serve only when a model has fewer than two weight
modules. A module's norm is the root sum of squares of its weight tensors.
Modules whose norm is exactly zero (frozen, or unused this step) or
non-finite (the non-finite rule's job) are skipped.

What matters is drift: a healthy network has its own ratio, set by its
architecture, and keeps it within an order of magnitude. So the detector
takes a reference, the median log-ratio of the run's first ``reference``
measured steps, and holds when the smoothed ratio (median over ``window``
steps) is beyond ``threshold`` *and* ``drift`` times away from that
reference. A ratio beyond ``extreme`` holds without drift (a network broken
from its first step has no healthy reference). Hysteresis: once holding, it
holds until the ratio is back within the square root of each bound (half the
distance in log space), so one episode is one incident.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Step

Direction = Literal["both", "vanishing", "exploding"]


def module_of(layer: str) -> str:
    """The module a parameter tensor belongs to: its name without the last dotted part."""
    return layer.rpartition(".")[0]


def group_layers(
    layers: tuple[str, ...], ignore: tuple[str, ...] = (), key: Callable[[str], str] = module_of
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Map each layer to a group index in model order (groups: modules, or ``key``'s).

    Returns the per-layer group index, the group names, and a per-group mask
    of groups to skip (names matching one of the ``ignore`` glob patterns).
    """
    index: dict[str, int] = {}
    inverse = np.empty(len(layers), dtype=np.int64)
    for i, layer in enumerate(layers):
        inverse[i] = index.setdefault(key(layer), len(index))
    names = list(index)
    skip = np.array([any(fnmatchcase(n, p) for p in ignore) for n in names], dtype=bool)
    return inverse, names, skip


def group_norms(inverse: np.ndarray, norms: np.ndarray, groups: int) -> np.ndarray:
    """Each group's L2 norm, sqrt of the sum of its layers' squared norms (see ``group_layers``).

    A non-finite layer makes its group non-finite; a square too large for
    float64 is reported as +Inf, which it nearly is.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(
            np.bincount(inverse, weights=np.asarray(norms, np.float64) ** 2, minlength=groups)
        )


# Roles that may be a ratio's ends: weight matrices, whose gradients scale with
# depth. Embeddings only when a model has fewer than two weight modules.
END_ROLES = frozenset({"weight"})
FALLBACK_ROLES = frozenset({"weight", "embedding"})


@dataclass(frozen=True, slots=True)
class EndRatio:
    """One step's first and last weight modules, their grad norms and log10(first/last)."""

    first: str
    last: str
    first_norm: float
    last_norm: float
    log_ratio: float


class LayerEnds:
    """Finds a step's ratio ends (see the module docstring); caches the plan per layout.

    Example::

        ends = LayerEnds()
        end = ends.measure(step)   # None when fewer than two usable weight modules
        end.first, end.log_ratio
    """

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = tuple(ignore)
        # The model's towers (census, agent/towers.py): layers and each one's tower.
        self._towers: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())
        self._key: tuple[tuple[str, ...], tuple[str, ...], int, tuple[int, ...]] | None = None
        self._inverse = np.empty(0, dtype=np.int64)
        self._names: list[str] = []
        self._use = np.empty(0, dtype=bool)

    def measure(self, step: Step) -> EndRatio | None:
        """The ends of ``step``, or None when it has no layer norms or under two usable modules."""
        norms = np.asarray(step.layer_norms, dtype=np.float64)
        if norms.size == 0:
            return None
        self._plan(step.layers, step.layer_roles, norms.size)
        groups = len(self._names)
        with np.errstate(over="ignore", invalid="ignore"):
            modules = np.sqrt(
                np.bincount(self._inverse, weights=norms * norms, minlength=groups + 1)
            )[:groups]
        usable = np.flatnonzero(np.isfinite(modules) & (modules > 0.0) & self._use)
        if usable.size < 2:
            return None
        first, last = int(usable[0]), int(usable[-1])
        # A difference of logs: the quotient of two extreme norms could overflow.
        log_ratio = math.log10(modules[first]) - math.log10(modules[last])
        return EndRatio(
            self._names[first],
            self._names[last],
            float(modules[first]),
            float(modules[last]),
            log_ratio,
        )

    def set_towers(self, layers: tuple[str, ...], towers: tuple[int, ...]) -> None:
        """The model's towers (each layer's, aligned with ``layers``): the ends are taken
        within one, the one with the most weight modules (the first such on a tie). An
        actor and a critic side by side are two paths, and their ratio says nothing of
        depth (CleanRL's PPO paged 182 times on a healthy run across them)."""
        self._towers = (layers, towers) if len(layers) == len(towers) else ((), ())

    def _plan(self, layers: tuple[str, ...], sent: tuple[str, ...], size: int) -> None:
        towers = self._towers[1] if self._towers[0] == layers and len(layers) == size else ()
        key = (layers, sent, size, towers)
        if key == self._key:
            return
        self._key = key
        named = layers if len(layers) == size else tuple(f"#{i}.w" for i in range(size))
        roles = roles_of(named, sent)
        if towers:
            roles = _one_tower(roles, towers)
        allowed = END_ROLES
        if len({module_of(n) for n, r in zip(named, roles, strict=True) if r in END_ROLES}) < 2:
            allowed = FALLBACK_ROLES
        index: dict[str, int] = {}
        for name, role in zip(named, roles, strict=True):
            if role in allowed:
                index.setdefault(module_of(name), len(index))
        self._names = list(index)
        # Parameters that are no end fall into one extra group, dropped after the sum.
        self._inverse = np.array(
            [
                index.get(module_of(n), len(index)) if r in allowed else len(index)
                for n, r in zip(named, roles, strict=True)
            ],
            dtype=np.int64,
        )
        self._use = np.array(
            [not any(fnmatchcase(n, p) for p in self.ignore) for n in self._names], dtype=bool
        )


def _one_tower(roles: tuple[str, ...], towers: tuple[int, ...]) -> tuple[str, ...]:
    """``roles`` with the weights outside the tower that holds the most turned "other"."""
    counts: dict[int, int] = {}
    for role, tower in zip(roles, towers, strict=True):
        if role in END_ROLES and tower >= 0:
            counts[tower] = counts.get(tower, 0) + 1
    if len(counts) < 2:
        return roles
    chosen = max(counts, key=lambda t: (counts[t], -t))
    return tuple(
        r if r not in FALLBACK_ROLES or t == chosen else "other"
        for r, t in zip(roles, towers, strict=True)
    )


class LayerRatioDetector:
    """Active while the first/last weight-module grad-norm ratio has drifted beyond its bounds.

    ``threshold``: the smoothed ratio must be beyond it (seed: two orders of
    magnitude); ``drift``: and this many times beyond the run's own reference
    (the median of its first ``reference`` measured steps); ``extreme``: beyond
    this the ratio holds without drift. ``direction`` limits the detector to
    ``"vanishing"`` (first ≪ last) or ``"exploding"`` (first ≫ last).
    ``ignore`` takes glob patterns of module names to leave out.

    Example::

        det = LayerRatioDetector(threshold=100.0, drift=10.0, direction="vanishing")
        det.observe(step).evidence["ratio"]
    """

    @validated_params
    def __init__(
        self,
        *,
        threshold: Annotated[float, Field(gt=1.0)] = 100.0,  # seed Stage 3: two orders of magnitude
        drift: Annotated[float, Field(ge=1.0)] = 10.0,
        extreme: Annotated[float, Field(gt=1.0)] = 1000.0,  # AUTOTRAINER: first/last below 1e-3
        reference: Annotated[int, Field(ge=1)] = 10,
        direction: Direction = "both",
        window: Annotated[int, Field(ge=1)] = 5,  # a median of 5 needs 3 agreeing steps
        ignore: tuple[str, ...] = (),
    ) -> None:
        self.threshold, self.drift, self.extreme = threshold, drift, extreme
        self.reference, self.direction, self.window = reference, direction, window
        self.ignore = tuple(ignore)
        self._ends = LayerEnds(self.ignore)
        self._pair: tuple[str, str] | None = None
        self._early: list[float] = []
        self._log_ratios: deque[float] = deque(maxlen=window)
        self._holding: str | None = None  # the direction of the episode in progress
        self._unsupervised = False  # loss_not_supervised: the vanishing direction let go

    def loss_not_supervised(self) -> None:
        """The job's loss is no supervised loss (a loss below zero, or the job's declaration;
        rules/engine.py): the vanishing direction is let go. A value function regressing
        returns that grow as the policy learns saturates its tanh units, and the ratio then
        says nothing of how the run fares: CleanRL's ppo.py on CartPole, which solves it,
        drifted from 1:1.4 to 1:1,150 within its critic (29 pages), and at lr x100, which
        solves it too, to 1:5,000,000 (benchmarks/cleanrl_trial.py). Exploding stays."""
        self._unsupervised = True

    def observe(self, step: Step) -> Finding | None:
        """Judge one step; None (no new verdict) when it carries no usable layer norms."""
        if is_amp_skip(step):
            return None
        end = self._ends.measure(step)
        if end is None:
            return None
        if (end.first, end.last) != self._pair:
            # Other ends (a module frozen or unfrozen): the old reference describes other layers.
            self._pair = (end.first, end.last)
            self._early.clear()
            self._log_ratios.clear()
            self._holding = None
        if len(self._early) < self.reference:
            self._early.append(end.log_ratio)
        self._log_ratios.append(end.log_ratio)
        if len(self._log_ratios) < self.window:
            return INACTIVE
        # statistics.median: for a handful of floats it is ~40x cheaper than numpy's.
        log_ratio = statistics.median(self._log_ratios)
        self._holding = self._holds(log_ratio)
        return INACTIVE if self._holding is None else self._finding(log_ratio, end)

    def observe_towers(self, layers: tuple[str, ...], towers: tuple[int, ...]) -> None:
        """The model's towers from its census (see ``LayerEnds.set_towers``)."""
        self._ends.set_towers(layers, towers)

    def reference_log_ratio(self) -> float | None:
        """log10 of the run's own early ratio, once ``reference`` steps were measured."""
        return statistics.median(self._early) if len(self._early) >= self.reference else None

    def _holds(self, log_ratio: float) -> str | None:
        direction = "vanishing" if log_ratio < 0 else "exploding"
        if self.direction not in ("both", direction) or (
            self._unsupervised and direction == "vanishing"
        ):
            return None
        # Hysteresis: an episode in progress ends only once back within the square roots.
        scale = 0.5 if self._holding == direction else 1.0
        size = abs(log_ratio)
        if size < scale * math.log10(self.threshold):
            return None
        if size >= scale * math.log10(self.extreme):
            return direction
        ref = self.reference_log_ratio()
        moved = (
            0.0
            if ref is None
            else abs(log_ratio - ref) * (1.0 if (log_ratio - ref) * log_ratio > 0 else -1.0)
        )
        return direction if moved >= scale * math.log10(self.drift) else None

    def _finding(self, log_ratio: float, end: EndRatio) -> Finding:
        ratio = 10.0**log_ratio
        ref = self.reference_log_ratio()
        direction = self._holding
        how = (
            f"{1.0 / ratio:.3g}× smaller than"
            if direction == "vanishing"
            else f"{ratio:.3g}× larger than"
        )
        start = (
            "" if ref is None else f"; {_times(ref)} over the run's first {self.reference} steps"
        )
        summary = (
            f"{direction} gradients: first weight module {end.first!r} grad norm {how} last "
            f"{end.last!r} (median over {self.window} steps{start}; bounds {self.threshold:g}× and "
            f"{self.drift:g}× drift, or {self.extreme:g}×)"
        )
        evidence = {
            "direction": direction,
            "first_module": end.first,
            "first_norm": end.first_norm,
            "last_module": end.last,
            "last_norm": end.last_norm,
            "ratio": ratio,
            "reference_ratio": None if ref is None else 10.0**ref,
            "drift": None if ref is None else 10.0 ** abs(log_ratio - ref),
            "threshold": self.threshold,
            "window": self.window,
        }
        return Finding(True, summary, evidence)


def _times(log_ratio: float) -> str:
    """A first/last ratio as people read it: "1:800" or "17:1"."""
    return f"1:{10.0**-log_ratio:.3g}" if log_ratio < 0 else f"{10.0**log_ratio:.3g}:1"
