"""Detectors on the model census (CONTRACTS C2): a freeze that began mid-run, training in eval mode.

The census rides on cadence statistics (``Stats.census``): how many parameter
elements are frozen (``requires_grad`` off) and where, and which modules were
in eval mode during a training step. Freezing is often intended -- a head-only
fine-tune, LoRA, a frozen backbone from the start -- so a frozen share is not
an anomaly; a frozen share that *jumps* while the run is under way is: the
user froze (or a library call froze) part of the model mid-run, and the rest
keeps training around it.

* :class:`FrozenMidRunDetector` -- the frozen share of the model's elements
  rose by at least ``min_share`` over what it was at the first census of the
  run (after an announced data change: of the new phase), while some
  parameters still train. A run frozen from attach is its own baseline.
* :class:`TrainingInEvalModeDetector` -- a training step ran with modules
  whose mode changes the output (BatchNorm tracking statistics, Dropout with
  p > 0) in eval mode, typically the whole model after ``model.eval()`` for
  validation was never undone. A model with no such module trains the same in
  either mode and is left alone. Modules inside a frozen module are left out
  too: a frozen backbone's BatchNorm kept in eval on purpose is standard
  fine-tuning practice (torchvision detection's FrozenBatchNorm2d). So is
  BatchNorm alone kept in eval while the model trains, its affine parameters
  still learning (OpenMMLab's ``norm_eval``, the default of its detection
  backbones): ``norm_stats`` "exclude" leaves that to a rule of its own, "only".

Example::

    det = FrozenMidRunDetector(min_share=0.01)
    det.observe_stats(stats).evidence["newly_frozen"]
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.step import Census, Stats


class FrozenMidRunDetector:
    """Active while the frozen share is ``min_share`` above the run's first census (module doc)."""

    @validated_params
    def __init__(
        self,
        *,
        min_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.01,
        max_named: Annotated[int, Field(ge=1)] = 10,
    ) -> None:
        self.min_share, self.max_named = min_share, max_named
        self._base: Census | None = None
        self._base_step = 0

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no census."""
        census = stats.census
        if census is None or census.params_total <= 0:
            return None
        if self._base is None:
            self._base, self._base_step = census, stats.step
            return INACTIVE
        rise = census.frozen_share - self._base.frozen_share
        if rise < self.min_share or census.params_trainable <= 0:
            return INACTIVE  # no new freeze, or nothing trains at all (WeightsFrozen's case)
        before = {name for name, _ in self._base.frozen_modules}
        newly = [(name, n) for name, n in census.frozen_modules if name not in before]
        shown = (
            ", ".join(f"{name!r} ({n:,})" for name, n in newly[: self.max_named])
            or "unnamed parameters"
        )
        summary = (
            f"{rise:.0%} of the model's parameters became frozen after step {self._base_step} "
            f"({self._base.frozen_share:.0%} -> {census.frozen_share:.0%} frozen) while "
            f"{census.params_trainable:,} still train: {shown}; requires_grad_(False) left on?"
        )
        evidence = {
            "frozen_share": census.frozen_share,
            "baseline_frozen_share": self._base.frozen_share,
            "baseline_step": self._base_step,
            "newly_frozen": [name for name, _ in newly[: self.max_named]],
            "params_frozen": census.params_frozen,
            "params_trainable": census.params_trainable,
        }
        return Finding(True, summary, evidence)


class TrainingInEvalModeDetector:
    """Active while the census of a training step shows eval mode; see the module docstring."""

    @validated_params
    def __init__(
        self,
        *,
        max_named: Annotated[int, Field(ge=1)] = 10,
        norm_stats: Literal["judge", "exclude", "only"] = "judge",
    ) -> None:
        self.max_named, self.norm_stats = max_named, norm_stats

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no census."""
        census = stats.census
        if census is None:
            return None
        frozen = tuple(name for name, _ in census.frozen_modules)
        modules = [m for m in census.eval_modules if not _inside(m, frozen)]
        # Normalisation layers alone in eval while the model trains: their statistics
        # frozen on purpose (norm_eval), a rule of its own.
        norms = census.model_training and census.eval_norms_only
        if (self.norm_stats == "exclude" and norms) or (self.norm_stats == "only" and not norms):
            return INACTIVE
        if not modules:
            # Even with the root in eval mode: no module whose mode changes the output (a
            # Linear+ReLU model), so training is exactly what train mode would do.
            return INACTIVE
        shown = ", ".join(repr(m) for m in modules[: self.max_named]) + (
            " …" if len(modules) > self.max_named else ""
        )
        if self.norm_stats == "only":
            summary = (
                f"training step {stats.step} ran with {len(modules)} normalisation layer(s) in "
                f"eval mode and nothing else: {shown}; their running statistics stay frozen "
                "while their weights train (OpenMMLab's norm_eval: usual when fine-tuning with "
                "small batches). Intended? If not, a .eval() on part of the model left on"
            )
        elif not census.model_training:
            summary = (
                f"training step {stats.step} ran with the model in eval mode (model.training is "
                f"False), so these modules behave as in evaluation: {shown}; model.eval() for "
                "validation not undone by model.train()?"
            )
        else:
            summary = (
                f"training step {stats.step} ran with {len(modules)} module(s) in eval mode whose "
                f"mode changes the output: {shown}; a .eval() call on part of the model left on?"
            )
        evidence = {
            "model_training": census.model_training,
            "eval_modules": modules[: self.max_named],
            "count": len(modules),
            "step": stats.step,
        }
        return Finding(True, summary, evidence)


def _inside(module: str, prefixes: tuple[str, ...]) -> bool:
    """True when ``module`` is one of ``prefixes`` or nested under one."""
    return any(module == p or module.startswith(p + ".") or p == "" for p in prefixes)


class NotInOptimizerDetector:
    """Active while parameters that require gradients are held by no optimizer param group.

    They receive gradients and never change: a layer added after the optimizer
    was built is the classic cause. Sometimes intended (a GAN's generator seen
    from the discriminator's optimizer), so the default rule is informational.

    Example::

        NotInOptimizerDetector().observe_stats(stats).evidence["not_in_optimizer"]
    """

    @validated_params
    def __init__(self, *, max_named: Annotated[int, Field(ge=1)] = 10) -> None:
        self.max_named = max_named

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no census."""
        census = stats.census
        if census is None:
            return None
        if census.params_not_in_optimizer <= 0:
            return INACTIVE
        names = list(census.not_in_optimizer[: self.max_named])
        share = census.params_not_in_optimizer / census.params_total if census.params_total else 0.0
        summary = (
            f"{census.params_not_in_optimizer:,} parameter elements ({share:.1%} of the model) "
            "require "
            f"gradients but are in no param group of the watched optimizer"
            + (f": {', '.join(repr(n) for n in names)}" if names else "")
            + "; they never change unless another optimizer updates them (built after the "
            "optimizer? a second optimizer, as for sparse embeddings or a GAN's other model?)"
        )
        return Finding(
            True,
            summary,
            {"not_in_optimizer": names, "elements": census.params_not_in_optimizer, "share": share},
        )
