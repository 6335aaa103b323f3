"""Stage 6 of the seed's procedure: BatchNorm and Dropout wired right for evaluation.

On a deep copy of the model (yours is not touched, nor its mode):

* ``model.eval()`` puts every BatchNorm/Dropout module in eval mode (the
  agent's ``log_eval`` check: modules left in training mode are named);
* each BatchNorm uses its running statistics in eval mode: its output for an
  example does not depend on the rest of the batch, and an eval forward
  leaves ``running_mean``/``running_var`` unchanged;
* each Dropout is off in eval mode: two eval forwards give identical outputs
  (the whole model too, and the loss when ``loss_fn`` is given);
* ``model.train()`` puts those modules back in training mode.

Example::

    from gradwatch.preflight import wiring

    report = wiring(model, (x, y), torch.nn.functional.cross_entropy)
    print(report)            # "wiring OK" or one finding per module
    assert report.ok
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.agent.monitor import MODE_SENSITIVE
from gradwatch.preflight.batches import Batch, LossFn, draw, forward, same

_BN = torch.nn.modules.batchnorm._BatchNorm
_DROPOUT = torch.nn.modules.dropout._DropoutNd
ATOL = 1e-5  # eval outputs computed from different batch slices agree to float32 rounding


@dataclass(frozen=True, slots=True)
class Finding:
    """One wiring problem: which check, which module, what happened."""

    check: str
    module: str
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.module}: {self.message}"


@dataclass(frozen=True, slots=True)
class WiringReport:
    """Findings of :func:`wiring`; ``ok`` when there are none."""

    findings: tuple[Finding, ...]
    batchnorm: tuple[str, ...]
    dropout: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def modules(self, check: str | None = None) -> tuple[str, ...]:
        """Names of the modules with a finding (of ``check`` when given)."""
        return tuple(dict.fromkeys(f.module for f in self.findings if check in (None, f.check)))

    def __str__(self) -> str:
        checked = f"{len(self.batchnorm)} BatchNorm, {len(self.dropout)} Dropout module(s) checked"
        if self.ok:
            return f"wiring OK: {checked}"
        return "\n".join(
            [f"wiring: {len(self.findings)} finding(s); {checked}"]
            + [f"  {finding}" for finding in self.findings]
        )


def wiring(model: torch.nn.Module, batch: Batch, loss_fn: LossFn | None = None) -> WiringReport:
    """Check BatchNorm/Dropout eval wiring on a copy of ``model`` with ``batch`` (>= 4 examples)."""
    inputs, targets = draw(batch)
    work = copy.deepcopy(model)
    sensitive = [
        (name or "<model>", m) for name, m in work.named_modules() if isinstance(m, MODE_SENSITIVE)
    ]
    bns = [(n, m) for n, m in sensitive if isinstance(m, _BN)]
    drops = [(n, m) for n, m in sensitive if isinstance(m, _DROPOUT)]
    findings: list[Finding] = []
    work.eval()
    findings += [
        Finding(
            "eval-mode",
            n,
            "still in training mode after model.eval() "
            "(check overridden train()/eval(), or a .train() call inside forward)",
        )
        for n, m in sensitive
        if m.training
    ]
    before = {n: _buffers(m) for n, m in bns}
    with torch.no_grad(), _capture(sensitive) as seen:
        first = forward(work, inputs)
    findings += [
        Finding(
            "batchnorm-stats",
            n,
            "an eval forward changed its running statistics: it "
            "normalises with batch statistics in eval mode",
        )
        for n, m in bns
        if not same(before[n], _buffers(m))
    ]
    with torch.no_grad():
        findings += _batch_independence(bns, seen)
        findings += _dropout_off(drops, seen)
        findings += _model_level(work, inputs, targets, first, loss_fn, bool(drops or bns))
    work.train()
    findings += [
        Finding("train-mode", n, "not back in training mode after model.train()")
        for n, m in sensitive
        if not m.training
    ]
    return WiringReport(tuple(findings), tuple(n for n, _ in bns), tuple(n for n, _ in drops))


def _buffers(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(b.detach().clone() for b in module.buffers())


@contextmanager
def _capture(
    modules: Sequence[tuple[str, torch.nn.Module]],
) -> Iterator[dict[str, tuple[Any, Any]]]:
    """Record each module's first input and its output during one forward."""
    seen: dict[str, tuple[Any, Any]] = {}

    def hook(name: str) -> Any:
        def record(_: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if (
                name not in seen
                and args
                and isinstance(args[0], torch.Tensor)
                and isinstance(out, torch.Tensor)
            ):
                seen[name] = (args[0].detach().clone(), out.detach().clone())

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in modules]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _batch_independence(
    bns: Sequence[tuple[str, torch.nn.Module]], seen: dict[str, tuple[Any, Any]]
) -> list[Finding]:
    """Run each BatchNorm again on half of the batch it saw: eval output must not change."""
    out: list[Finding] = []
    for name, module in bns:
        if name not in seen:
            continue
        inp, full = seen[name]
        half = max(2, inp.shape[0] // 2)
        if inp.shape[0] < 4:
            out.append(
                Finding(
                    "batchnorm-batch",
                    name,
                    f"batch of {inp.shape[0]} is too small to check; pass at least 4 examples",
                )
            )
            continue
        part = module(inp[:half])
        if not torch.allclose(part, full[:half], atol=ATOL, rtol=1e-4):
            diff = float((part - full[:half]).abs().max())
            out.append(
                Finding(
                    "batchnorm-batch",
                    name,
                    f"eval output depends on the rest of the batch "
                    f"(max change {diff:.3g} on half the batch): batch statistics used at eval "
                    "(training mode, or track_running_stats=False)",
                )
            )
    return out


def _dropout_off(
    drops: Sequence[tuple[str, torch.nn.Module]], seen: dict[str, tuple[Any, Any]]
) -> list[Finding]:
    out: list[Finding] = []
    for name, module in drops:
        if name not in seen:
            continue
        inp, first = seen[name]
        if not (same(module(inp), first) and same(first, inp)):
            out.append(
                Finding(
                    "dropout",
                    name,
                    "active at eval: its output differs from its input and "
                    "between two eval forwards",
                )
            )
    return out


def _model_level(
    work: torch.nn.Module,
    inputs: Any,
    targets: Any,
    first: Any,
    loss_fn: LossFn | None,
    sensitive: bool,
) -> list[Finding]:
    """Two eval forwards of the whole model must agree (and the loss, when given)."""
    second = forward(work, inputs)
    out: list[Finding] = []
    if not _close(first, second):
        where = (
            ""
            if sensitive
            else " (no BatchNorm/Dropout module found: look for functional dropout "
            "or randomness inside forward)"
        )
        out.append(
            Finding("determinism", "<model>", f"two eval forwards of the same batch differ{where}")
        )
    if loss_fn is not None:
        a, b = float(loss_fn(first, targets)), float(loss_fn(second, targets))
        if a != b:
            out.append(
                Finding(
                    "determinism",
                    "<loss>",
                    f"eval loss differs between two passes ({a:.6g} vs "
                    f"{b:.6g}): validation metrics are noisy",
                )
            )
    return out


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(
            torch.allclose(a, b, atol=ATOL, rtol=1e-4, equal_nan=True)
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return same(a, b)
