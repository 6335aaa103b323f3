"""Layer-ratio detector: first and last layers' grad norms two orders of magnitude apart.

Seed, Stage 3: "a ratio of more than roughly two orders of magnitude between the
first and last layers signals vanishing or exploding gradients depending on
direction" (first ≪ last: vanishing; first ≫ last: exploding). AUTOTRAINER
(Zhang et al., ICSE 2021) uses first/last below 1e-3 for vanishing and above 70
for exploding; the default here is the seed's 100 both ways, and a rule file
can set AUTOTRAINER's with one rule per direction.

Parameter tensors are grouped into modules by dropping the last dotted
component ("0.weight", "0.bias" -> "0") and combined as the root of the sum of
squares, so a tiny bias never decides the ratio. Modules whose norm is exactly
zero (frozen, or unused this step) or non-finite (the non-finite rule's job)
are skipped. The ratio is smoothed with a median over a short window, so one
noisy step cannot flip the verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from fnmatch import fnmatchcase
from collections.abc import Callable
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, is_amp_skip, validated_params
from gradwatch.rules.step import Step

Direction = Literal["both", "vanishing", "exploding"]


def module_of(layer: str) -> str:
    """The module a parameter tensor belongs to: its name without the last dotted part."""
    return layer.rpartition(".")[0]


def group_layers(layers: tuple[str, ...], ignore: tuple[str, ...] = (),
                 key: Callable[[str], str] = module_of) -> tuple[np.ndarray, list[str], np.ndarray]:
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
        return np.sqrt(np.bincount(inverse, weights=np.asarray(norms, np.float64) ** 2,
                                   minlength=groups))


class LayerRatioDetector:
    """Active while the median first/last module grad-norm ratio is beyond ``threshold``.

    ``direction`` limits it to ``"vanishing"`` (first ≪ last) or
    ``"exploding"`` (first ≫ last); ``"both"`` watches either. ``ignore`` takes
    glob patterns of module names to leave out (an embedding whose sparse
    gradient is small by nature, say).

    Example::

        det = LayerRatioDetector(threshold=100.0, direction="vanishing", window=5)
        det.observe(step).evidence["ratio"]
    """

    @validated_params
    def __init__(
        self,
        *,
        threshold: Annotated[float, Field(gt=1.0)] = 100.0,  # seed Stage 3: two orders of magnitude
        direction: Direction = "both",
        window: Annotated[int, Field(ge=1)] = 5,  # a median of 5 needs 3 agreeing steps
        ignore: tuple[str, ...] = (),
    ) -> None:
        self.threshold = threshold
        self.direction = direction
        self.window = window
        self.ignore = tuple(ignore)
        self._log_ratios: deque[float] = deque(maxlen=window)
        self._layers: tuple[str, ...] | None = None
        self._inverse = np.empty(0, dtype=np.int64)
        self._names: list[str] = []
        self._skip = np.empty(0, dtype=bool)
        self._last: Finding = INACTIVE

    def observe(self, step: Step) -> Finding:
        """Judge one step; see the class docstring."""
        norms = np.asarray(step.layer_norms, dtype=np.float64)
        if is_amp_skip(step) or norms.size == 0:
            return self._last  # no measurement: keep the verdict
        modules = self._module_norms(step.layers, norms)
        usable = np.flatnonzero(np.isfinite(modules) & (modules > 0.0) & ~self._skip)
        if usable.size < 2:
            return self._last
        first, last = int(usable[0]), int(usable[-1])
        # A difference of logs: the quotient of two extreme norms could overflow.
        self._log_ratios.append(math.log10(modules[first]) - math.log10(modules[last]))
        if len(self._log_ratios) < self.window:
            self._last = INACTIVE
        else:
            self._last = self._judge(first, last, modules)
        return self._last

    def _module_norms(self, layers: tuple[str, ...], norms: np.ndarray) -> np.ndarray:
        if layers != self._layers or self._inverse.size != norms.size:
            named = layers if len(layers) == norms.size else tuple(f"#{i}." for i in range(norms.size))
            self._inverse, self._names, self._skip = group_layers(named, self.ignore)
            self._layers = layers
        with np.errstate(over="ignore", invalid="ignore"):
            sums = np.bincount(self._inverse, weights=norms * norms, minlength=len(self._names))
        return np.sqrt(sums)

    def _judge(self, first: int, last: int, modules: np.ndarray) -> Finding:
        # statistics.median: for a handful of floats it is ~40x cheaper than numpy's.
        log_ratio = statistics.median(self._log_ratios)
        limit = math.log10(self.threshold)
        if log_ratio <= -limit and self.direction in ("both", "vanishing"):
            direction = "vanishing"
        elif log_ratio >= limit and self.direction in ("both", "exploding"):
            direction = "exploding"
        else:
            return INACTIVE
        ratio = 10.0**log_ratio
        first_name, last_name = self._names[first], self._names[last]
        if direction == "vanishing":
            how = f"{1.0 / ratio:.3g}× smaller than"
        else:
            how = f"{ratio:.3g}× larger than"
        summary = (
            f"{direction} gradients: first module {first_name!r} grad norm {how} last module "
            f"{last_name!r} (median over {self.window} steps; threshold {self.threshold:g}×)"
        )
        evidence = {
            "direction": direction,
            "first_module": first_name,
            "first_norm": float(modules[first]),
            "last_module": last_name,
            "last_norm": float(modules[last]),
            "ratio": ratio,
            "threshold": self.threshold,
            "window": self.window,
        }
        return Finding(True, summary, evidence)
