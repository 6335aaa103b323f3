"""What every detector is: fed one step at a time, it says whether its condition holds now.

A detector only judges; holding a condition for a while, deduplicating and
resolving is the lifecycle's job (:mod:`gradwatch.rules.lifecycle`). Detectors
keep bounded state (deques with ``maxlen``, fixed-size numpy arrays) and do
O(layers) work per step, because the collector runs one per (job, rank, rule).

Example::

    det = NonFiniteDetector()
    finding = det.observe(step)
    if finding.active:
        print(finding.summary, dict(finding.evidence))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import numpy as np
from pydantic import ConfigDict, validate_call

from gradwatch.rules.step import Step

_DTYPE_NAMES = {
    float(np.finfo(np.float16).max): "float16",
    3.3895313892515355e38: "bfloat16",
    float(np.finfo(np.float32).max): "float32",
    float(np.finfo(np.float64).max): "float64",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's verdict on the latest step, with the numbers behind it."""

    active: bool
    summary: str = ""
    evidence: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


INACTIVE = Finding(False)

# Decorates detector constructors: their annotated keyword args (``Annotated[int,
# Field(ge=6)]``) are the single declaration of each param's type and range, so a
# detector built in Python is checked exactly like one built from a rule file.
# Bad values raise pydantic.ValidationError, a ValueError.
validated_params = validate_call(config=ConfigDict(strict=True))


@runtime_checkable
class Detector(Protocol):
    """A streaming judge of one condition; see the module docstring."""

    def observe(self, step: Step) -> Finding:
        """Take one step into account and say whether the condition holds now."""
        ...


def dtype_name(dtype_max: float) -> str:
    """Name the floating-point type whose largest finite value is ``dtype_max``, for summaries."""
    for value, name in _DTYPE_NAMES.items():
        if abs(dtype_max - value) <= 1e-6 * value:
            return name
    return f"dtype (max {dtype_max:.3g})"


def is_amp_skip(step: Step) -> bool:
    """True for a step a GradScaler skipped on overflow: normal, and recovered by the scaler.

    Such steps carry Inf/NaN gradients by design; judging them belongs to the
    loss-scale-collapse rule, and counting them elsewhere is a false alarm.
    """
    return step.skipped and step.loss_scale is not None
