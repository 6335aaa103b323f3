"""Forward-activation statistics, measured only on cadence steps.

:class:`ActHooks` finds the model's nonlinearity modules once (ReLU, ReLU6,
LeakyReLU, Tanh, Sigmoid; the first ``MAX_ACT_MODULES`` in model order) and
registers forward hooks on them only for the forward pass of a cadence step
(``arm``), removing them at the next ``Monitor.log`` (``disarm``): every other
step pays nothing. Each hook writes, on the device and without a sync, the
module output's mean and (population) std from a float32 sum and sum of
squares, plus

* ``zero_frac`` for ReLU/ReLU6: the share of exact zeros;
* ``sat_frac`` for Tanh: the share with ``|y| > 0.99``; for Sigmoid: the
  share with ``y < 0.01`` or ``y > 0.99`` (outputs pinned near a bound);

into one preallocated float32 device vector (MISSING where not measured). An
output of more than ``SAMPLE`` elements is measured on an evenly strided
sample of about ``SAMPLE`` elements. If the module runs more than once in that
window (gradient accumulation, an eval forward), the last call wins.

Hooks would make ``torch.compile`` recompile, so a compiled model gets no
activation statistics (one warning at attach); other signals are unaffected.

Example::

    >>> import torch
    >>> from gradwatch.agent.activations import ActHooks
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> hooks = ActHooks.attach(model, torch.device("cpu"), on_error=None)
    >>> hooks.columns
    ('act/1/relu/mean', 'act/1/relu/std', 'act/1/relu/zero_frac')
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradwatch.agent.layout import fill_missing
from gradwatch.wire import columns as wc

logger = logging.getLogger(__name__)

# Hooked modules at most (the first in model order); the rest are not measured.
MAX_ACT_MODULES = 256
# Outputs larger than this are measured on a strided sample of about this size.
SAMPLE = 1 << 20
# Tanh |y| above this, or Sigmoid y within this of 0 or 1, counts as saturated.
TANH_SATURATED = 0.99
SIGMOID_MARGIN = 0.01

_COMPILED_PREFIX = "_orig_mod."


def _kind(module: nn.Module) -> str | None:
    """The nonlinearity family ``ActStats.kind`` names, or None when not measured."""
    if isinstance(module, nn.ReLU6):  # a Hardtanh, not a ReLU, in torch
        return "relu6"
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.Tanh):
        return "tanh"
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    if isinstance(module, nn.LeakyReLU):
        return "other"  # few exact zeros by design: mean and std only
    return None


def _frac_stat(kind: str) -> str | None:
    if kind in ("relu", "relu6"):
        return wc.ACT_ZERO_FRAC
    if kind in ("tanh", "sigmoid"):
        return wc.ACT_SAT_FRAC
    return None


def is_compiled(model: nn.Module) -> bool:
    """True for a ``torch.compile`` result or a module compiled in place (``.compile()``).

    Looked up in ``sys.modules``: a model can only be an ``OptimizedModule``
    once torch.compile has imported it, and importing dynamo here would cost
    a second at every ``watch()``.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled_type = getattr(eval_frame, "OptimizedModule", None)
    if isinstance(compiled_type, type) and isinstance(model, compiled_type):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


class ActHooks:
    """The hookable modules of one model and the device vector their statistics land in."""

    def __init__(self, modules: list[tuple[str, str, nn.Module]], device: torch.device,
                 on_error: Callable[[str, BaseException], None] | None) -> None:
        self._on_error = on_error
        columns: list[str] = []
        # (module, kind, first slot, whether a share is measured)
        self._plan: list[tuple[nn.Module, str, int, bool]] = []
        for name, kind, module in modules:
            first = len(columns)
            columns += [wc.act(name, kind, wc.ACT_MEAN), wc.act(name, kind, wc.ACT_STD)]
            frac = _frac_stat(kind)
            if frac is not None:
                columns.append(wc.act(name, kind, frac))
            self._plan.append((module, kind, first, frac is not None))
        self.columns = tuple(columns)
        self.values = torch.empty(len(columns), dtype=torch.float32, device=device)
        fill_missing(self.values)
        self._handles: list[Any] = []

    @classmethod
    def attach(cls, model: nn.Module, device: torch.device,
               on_error: Callable[[str, BaseException], None] | None,
               max_modules: int = MAX_ACT_MODULES) -> ActHooks | None:
        """Find the modules to measure; None for a compiled model (warned) or none found."""
        if is_compiled(model):
            logger.warning(
                "gradwatch: the model is compiled with torch.compile; activation statistics "
                "are off for compiled models (forward hooks would force recompiles). Gradient, "
                "weight and loss signals are unaffected.")
            return None
        found: list[tuple[str, str, nn.Module]] = []
        skipped = 0
        for name, module in model.named_modules():
            kind = _kind(module)
            if kind is None:
                continue
            if len(found) >= max_modules:
                skipped += 1
                continue
            found.append((name.removeprefix(_COMPILED_PREFIX) or type(module).__name__,
                          kind, module))
        if skipped:
            logger.warning("gradwatch: activation statistics cover the first %d of %d "
                           "nonlinearity modules (model order); the other %d are not measured",
                           max_modules, max_modules + skipped, skipped)
        return cls(found, device, on_error) if found else None

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Register the hooks for the next forward pass (a cadence step's)."""
        if self._handles:
            return
        fill_missing(self.values)  # a module that does not run stays MISSING
        for module, kind, first, frac in self._plan:
            self._handles.append(module.register_forward_hook(self._hook(kind, first, frac)))

    def disarm(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def snapshot(self) -> torch.Tensor:
        """A copy of the values (device), queued: the vector is reused at the next arm."""
        out = self.values.clone()
        if not self._handles:
            fill_missing(out)  # not armed for this step's forward: nothing was measured
        return out

    def _hook(self, kind: str, first: int, frac: bool) -> Callable[..., None]:
        values = self.values
        width = 3 if frac else 2

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            try:
                if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                    return
                n = output.numel()
                if n == 0:
                    return
                with torch.no_grad():
                    stats = _measure(output.detach(), kind, frac)
                    values[first:first + width].copy_(stats)
            except Exception as exc:  # never raise into the user's forward pass
                self.disarm()
                if self._on_error is not None:
                    self._on_error("measuring activation statistics in a forward hook", exc)

        return hook


def _measure(y: torch.Tensor, kind: str, frac: bool) -> torch.Tensor:
    """[mean, std(, share)] of ``y`` as a float32 device tensor; reads nothing on the host."""
    flat = y.reshape(-1)
    n = flat.numel()  # shape metadata: no sync
    if n > SAMPLE:
        flat = flat[:: -(-n // SAMPLE)]
        n = flat.numel()
    x = flat.float()
    total = x.sum()
    squares = torch.dot(x, x)
    mean = total / n
    std = (squares / n - mean * mean).clamp_min_(0.0).sqrt_()
    if not frac:
        return torch.stack((mean, std))
    if kind in ("relu", "relu6"):
        hits = (x == 0).sum()
    elif kind == "tanh":
        hits = (x.abs() > TANH_SATURATED).sum()
    else:  # sigmoid
        hits = ((x < SIGMOID_MARGIN) | (x > 1.0 - SIGMOID_MARGIN)).sum()
    return torch.stack((mean, std, hits.float() / n))
