"""Stage 1 of the seed's procedure: can the model memorise 8-16 examples?

If a model with enough capacity cannot drive the loss on a dozen fixed
examples close to zero, the bug is in the data pipeline, the loss, or the
forward/backward wiring -- not in the optimizer or the schedule. The check
trains a deep copy (your model and its parameters are left untouched) and,
when it fails, says which of those to look at, naming frozen parameters and
parameters no gradient reached.

Example::

    from gradwatch.preflight import memorization

    result = memorization(model, torch.nn.functional.cross_entropy, (x[:12], y[:12]))
    print(result)             # passed/failed, loss ratio, and what to check
    assert result.passed
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradwatch.preflight.batches import (
    Batch,
    BatchSource,
    LossFn,
    draw,
    finite,
    forward_loss,
    make_optimizer,
    same,
    scalar,
)

TARGET_RATIO = 1e-3  # seed: assert loss < 1e-3 * initial_loss
DEFAULT_LR = {"adam": 3e-3, "sgd": 0.05}
MAX_EXAMPLES = 16
DIVERGED = 1e6  # |loss| this many times the initial one: stop, it will not come back

CHECK_PIPELINE = (
    "data pipeline: are labels still aligned with their inputs (shuffled, re-sampled "
    "or augmented separately)? do the 8-16 examples stay the same every step?"
)
CHECK_LOSS = (
    "loss wiring: sign (minimise a loss >= 0, not a log-likelihood), reduction "
    "(mean/sum over the right axis), targets in the format the loss expects"
)
CHECK_FROZEN = "frozen parameters: requires_grad=False, or parameters missing from the optimizer"
CHECK_DETACHED = (
    "detached graph: a .detach(), .item(), .data, .numpy() or torch.no_grad() between "
    "the parameters and the loss"
)


@dataclass(frozen=True, slots=True)
class MemorizationResult:
    """What the memorisation test found. ``hints`` are ordered most specific first."""

    passed: bool
    initial_loss: float
    final_loss: float
    loss_ratio: float
    steps: int
    target_ratio: float
    hints: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    no_grad: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            (
                f"memorization {verdict}: loss {self.initial_loss:.4g} -> {self.final_loss:.4g} "
                f"(ratio {self.loss_ratio:.2e}, target < {self.target_ratio:.0e}) in {self.steps} "
                f"step(s), {self.seconds:.1f}s"
            )
        ]
        lines += [f"  check: {hint}" for hint in self.hints]
        lines += [f"  warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def memorization(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batch: BatchSource,
    steps: int = 300,
    lr: float | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adam",
    target_ratio: float = TARGET_RATIO,
) -> MemorizationResult:
    """Overfit ``batch`` (8-16 examples) on a copy of ``model``; passed when loss < ratio x initial.

    ``batch`` is ``(inputs, targets)`` or a callable returning one: pass your real
    pipeline as a callable to catch labels that move against their inputs.
    ``optimizer`` is ``"adam"``, ``"sgd"`` or a factory ``f(params, lr=...)``;
    ``lr`` defaults to 3e-3 (Adam) / 0.05 (SGD). Stops as soon as the ratio passes.
    """
    started = time.perf_counter()
    work = copy.deepcopy(model)
    work.train()
    named = list(work.named_parameters())
    frozen = tuple(name for name, p in named if not p.requires_grad)
    trainable = [(name, p) for name, p in named if p.requires_grad]
    first = draw(batch)
    hints, warnings = _probe_pipeline(batch, first), _size_warnings(first)
    if frozen:
        warnings.append(
            f"{len(frozen)} frozen parameter(s) (requires_grad=False): {_names(frozen)}"
        )
    if not trainable:
        hints.insert(0, f"{CHECK_FROZEN}: every parameter is frozen ({_names(frozen)})")
        loss = scalar(forward_loss(work, loss_fn, first))
        return MemorizationResult(
            False,
            loss,
            loss,
            1.0,
            0,
            target_ratio,
            tuple(hints),
            frozen,
            (),
            tuple(warnings),
            time.perf_counter() - started,
        )
    rate = (
        lr
        if lr is not None
        else DEFAULT_LR.get(optimizer if isinstance(optimizer, str) else "adam", 3e-3)
    )
    opt = make_optimizer(optimizer, (p for _, p in trainable), rate)
    run = _train(work, loss_fn, batch, opt, trainable, steps, target_ratio)
    passed = run.initial > 0 and finite(run.final) and abs(run.final) <= target_ratio * run.initial
    if run.no_grad:
        warnings.append(
            f"no gradient reached {len(run.no_grad)} parameter(s): {_names(run.no_grad)}"
        )
    if not passed:
        hints = _failure_hints(run, hints, frozen)
    ratio = run.final / run.initial if run.initial and finite(run.final) else float("nan")
    return MemorizationResult(
        passed,
        run.initial,
        run.final,
        ratio,
        run.steps,
        target_ratio,
        tuple(hints),
        frozen,
        run.no_grad,
        tuple(warnings),
        time.perf_counter() - started,
    )


@dataclass(slots=True)
class _Run:
    initial: float
    final: float
    steps: int
    no_grad: tuple[str, ...] = ()
    zero_grad: tuple[str, ...] = ()
    detached: bool = False


def _train(
    work: torch.nn.Module,
    loss_fn: LossFn,
    batch: BatchSource,
    opt: torch.optim.Optimizer,
    trainable: list[tuple[str, torch.nn.Parameter]],
    steps: int,
    target_ratio: float,
) -> _Run:
    run = _Run(float("nan"), float("nan"), 0)
    for step in range(max(1, steps)):
        loss = forward_loss(work, loss_fn, draw(batch))
        value = scalar(loss)
        run.final, run.steps = value, step
        if step == 0:
            run.initial = value
        if step > 0 and run.initial > 0 and abs(value) <= target_ratio * run.initial:
            break
        if not finite(value) or abs(value) > DIVERGED * max(abs(run.initial), 1e-12):
            break
        if not loss.requires_grad:
            run.detached = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            run.no_grad = tuple(name for name, p in trainable if p.grad is None)
            run.zero_grad = tuple(
                name for name, p in trainable if p.grad is not None and not bool(p.grad.any())
            )
        opt.step()
        run.steps = step + 1
    return run


def _probe_pipeline(batch: BatchSource, first: Batch) -> list[str]:
    """Draw again from a batch source: labels that change under the same inputs are shuffled."""
    if not callable(batch):
        return []
    (x1, y1), (x2, y2) = first, draw(batch)
    if same(x1, x2) and not same(y1, y2):
        return [
            (
                f"{CHECK_PIPELINE} -- two draws returned the same inputs with different labels: "
                "the pipeline shuffles labels against inputs"
            )
        ]
    if not same(x1, x2):
        return [
            (
                "data pipeline: the batch source returns different examples on every call; "
                "memorization needs the same 8-16 examples each step (fix a subset first)"
            )
        ]
    return []


def _size_warnings(batch: Batch) -> list[str]:
    targets = batch[1]
    n = len(targets) if hasattr(targets, "__len__") else 0
    if n > MAX_EXAMPLES:
        return [
            (
                f"the batch has {n} examples; the test is meant for 8-{MAX_EXAMPLES} "
                "(more may need more steps or capacity)"
            )
        ]
    return []


def _failure_hints(run: _Run, hints: list[str], frozen: tuple[str, ...]) -> list[str]:
    specific = list(hints)
    if run.detached:
        specific.append(f"{CHECK_DETACHED}: the loss does not require grad, so nothing can train")
    if run.no_grad or run.zero_grad:
        names = _names(run.no_grad + run.zero_grad)
        specific.append(f"{CHECK_DETACHED} or {CHECK_FROZEN}: no gradient reached {names}")
    if frozen:
        specific.append(f"{CHECK_FROZEN}: frozen {_names(frozen)}")
    if not finite(run.final):
        specific.append(
            f"numerics: the loss became {run.final} after {run.steps} step(s); lower lr, "
            "check log/exp/division in the loss"
        )
    elif run.initial <= 0 or run.final < 0:
        specific.append(
            f"{CHECK_LOSS} -- the loss is negative ({run.initial:.4g} -> {run.final:.4g}) and "
            "keeps falling: its sign looks flipped, so training maximises the real loss"
        )
    elif run.final > run.initial:
        specific.append(
            f"{CHECK_LOSS} -- the loss rose ({run.initial:.4g} -> {run.final:.4g}): flipped "
            "sign or a learning rate far too high"
        )
    generic = [
        c
        for c in (CHECK_PIPELINE, CHECK_LOSS, CHECK_FROZEN, CHECK_DETACHED)
        if not any(s.startswith(c.split(":")[0]) for s in specific)
    ]
    if finite(run.final) and 0 < run.final < run.initial and not specific:
        specific.append(
            f"the loss fell only to {run.final / run.initial:.2e} of its start in {run.steps} "
            "steps: try more steps or a larger lr before suspecting a bug"
        )
    return specific + generic


def _names(names: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
