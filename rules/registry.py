"""Detectors by name, as rule files refer to them, and validation of their params.

A detector's keyword arguments *are* its rule-file ``params``: the pydantic
model that validates them is derived from the constructor's signature, so a
threshold is declared once, typed once, and defaulted once.

Example::

    make_detector("growth", {"window": 32})
    register_detector("mine", MyDetector)  # a class or function with keyword-only args
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Strict, create_model

from gradwatch.rules.activations import DeadUnitsDetector, SaturationDetector
from gradwatch.rules.agent_health import AgentDegradedDetector
from gradwatch.rules.amp import LossScaleCollapseDetector
from gradwatch.rules.collapse import LrTooLowDetector, SignedLossDetector, ZeroLossDetector
from gradwatch.rules.detector import Detector
from gradwatch.rules.evals import (
    EvalLossNonFiniteDetector,
    EvalModeWiringDetector,
    GeneralizationGapDetector,
    ValTrainGapDetector,
)
from gradwatch.rules.events import ExtremeStepDetector
from gradwatch.rules.growth import GeometricGrowthDetector
from gradwatch.rules.inflation import WeightInflationDetector
from gradwatch.rules.liveness import SilentRankDetector, StalledDetector, StragglerDetector
from gradwatch.rules.loss import (
    FlatFromStartDetector,
    LossAboveStartDetector,
    RisingLossDetector,
)
from gradwatch.rules.modelstate import (
    FrozenMidRunDetector,
    NotInOptimizerDetector,
    TrainingInEvalModeDetector,
)
from gradwatch.rules.nonfinite import NonFiniteDetector
from gradwatch.rules.ratio import LayerRatioDetector
from gradwatch.rules.rewrites import RewrittenWeightsDetector
from gradwatch.rules.spike import LossSpikeDetector
from gradwatch.rules.stepping import OptimizerIdleDetector
from gradwatch.rules.vanishing import (
    VanishingGradientDetector,
    WeightsCutOffDetector,
    ZeroGradientsDetector,
)
from gradwatch.rules.weights import (
    LaggingLayersDetector,
    SmallInitDetector,
    UpdateRatioDetector,
    WeightRunawayDetector,
)

DetectorFactory = Callable[..., Detector]

_FACTORIES: dict[str, DetectorFactory] = {}
_PARAMS: dict[str, type[BaseModel]] = {}


def register_detector(name: str, factory: DetectorFactory) -> None:
    """Make ``factory`` available to rule files as ``detector: name``.

    Every parameter of ``factory`` must be keyword-only, typed and defaulted,
    so a rule with ``params: {}`` always works and every param can be checked.
    """
    if name in _FACTORIES and _FACTORIES[name] is not factory:
        raise ValueError(f"a different detector is already registered as {name!r}")
    _PARAMS[name] = _params_model(name, factory)
    _FACTORIES[name] = factory


def detector_names() -> tuple[str, ...]:
    """Names rule files may use, sorted."""
    return tuple(sorted(_FACTORIES))


def params_model(name: str) -> type[BaseModel]:
    """The pydantic model of detector ``name``'s params; ``KeyError`` if unknown."""
    return _PARAMS[name]


def make_detector(name: str, params: Mapping[str, Any] | None = None) -> Detector:
    """A fresh detector ``name`` built from validated ``params``.

    Raises ``KeyError`` for an unknown name and ``pydantic.ValidationError``
    (a ``ValueError``) for params of the wrong name, type or range.
    """
    factory = _FACTORIES[name]
    checked = _PARAMS[name].model_validate(dict(params or {}))
    # Only what the rule set explicitly: the factory's own defaults stay authoritative.
    return factory(**{k: getattr(checked, k) for k in checked.model_fields_set})


def _params_model(name: str, factory: DetectorFactory) -> type[BaseModel]:
    # A class's params are its __init__'s keyword arguments (mypy flags reading __init__ off a
    # type as unsound for subclasses; here the class itself is what the rule file names).
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    hints = typing.get_type_hints(target, include_extras=True)
    fields: dict[str, Any] = {}
    for param in inspect.signature(factory).parameters.values():
        if (
            param.kind is not inspect.Parameter.KEYWORD_ONLY
            or param.default is inspect.Parameter.empty
        ):
            raise TypeError(
                f"detector {name!r}: parameter {param.name!r} must be keyword-only with a default"
            )
        if param.name not in hints:
            raise TypeError(f"detector {name!r}: parameter {param.name!r} needs a type annotation")
        fields[param.name] = (_strict_scalars(hints[param.name]), param.default)
    config = ConfigDict(extra="forbid", frozen=True)
    return create_model(f"{factory.__name__}Params", __config__=config, **fields)


def _strict_scalars(hint: Any) -> Any:
    # Lax pydantic turns `window: true` into 1 and "16" into 16; in a rule file
    # both are mistakes worth an error, so numbers and bools are strict. Other
    # types stay lax: YAML has no tuples, so a list must become one.
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    if base in (int, float, bool):
        return Annotated[hint, Strict()]
    return hint


register_detector("nonfinite", NonFiniteDetector)
register_detector("agent_degraded", AgentDegradedDetector)
register_detector("growth", GeometricGrowthDetector)
register_detector("ratio", LayerRatioDetector)
register_detector("vanishing", VanishingGradientDetector)
register_detector("zero_grads", ZeroGradientsDetector)
register_detector("weights_cut_off", WeightsCutOffDetector)
register_detector("flat_start", FlatFromStartDetector)
register_detector("optimizer_idle", OptimizerIdleDetector)
register_detector("loss_spike", LossSpikeDetector)
register_detector("rising_loss", RisingLossDetector)
register_detector("above_start", LossAboveStartDetector)
register_detector("generalization_gap", GeneralizationGapDetector)
register_detector("eval_mode", EvalModeWiringDetector)
register_detector("eval_nonfinite", EvalLossNonFiniteDetector)
register_detector("val_train_gap", ValTrainGapDetector)
register_detector("extreme_step", ExtremeStepDetector)
register_detector("weights_rewritten", RewrittenWeightsDetector)
register_detector("zero_loss", ZeroLossDetector)
register_detector("signed_loss", SignedLossDetector)
register_detector("lr_too_low", LrTooLowDetector)
register_detector("saturation", SaturationDetector)
register_detector("dead_units", DeadUnitsDetector)
register_detector("weight_runaway", WeightRunawayDetector)
register_detector("update_ratio", UpdateRatioDetector)
register_detector("lagging_layers", LaggingLayersDetector)
register_detector("small_init", SmallInitDetector)
register_detector("weight_inflation", WeightInflationDetector)
register_detector("loss_scale", LossScaleCollapseDetector)
register_detector("frozen_mid_run", FrozenMidRunDetector)
register_detector("train_in_eval_mode", TrainingInEvalModeDetector)
register_detector("not_in_optimizer", NotInOptimizerDetector)
register_detector("stalled", StalledDetector)
register_detector("silent_rank", SilentRankDetector)
register_detector("straggler", StragglerDetector)
