"""gradwatch.rules: pure, streaming detectors, rule files and the alert lifecycle.

No torch and no sockets: the same code runs live in the collector and offline
over a recorded trace (:mod:`gradwatch.rules.replay`). Steps, cadence stats,
evals and liveness go in; transitions, each alert with the seed's diagnosis,
come out.

Example::

    from gradwatch.rules import Engine, Step, load_default_rules

    engine = Engine(load_default_rules())
    for transition in engine.observe(Step(job="run-42", step=1, time=0.0, loss=float("nan"))):
        print(transition.current, transition.alert.summary)
"""

from __future__ import annotations

from gradwatch.rules.activations import DeadUnitsDetector, SaturationDetector
from gradwatch.rules.alert import CATEGORIES, SEVERITIES, Alert, Category, Severity, Transition
from gradwatch.rules.amp import LossScaleCollapseDetector
from gradwatch.rules.detector import Detector, Finding
from gradwatch.rules.diagnosis import JobHistory, diagnose
from gradwatch.rules.engine import Engine
from gradwatch.rules.evals import (
    EvalLossNonFiniteDetector,
    EvalModeWiringDetector,
    GeneralizationGapDetector,
)
from gradwatch.rules.growth import GeometricGrowthDetector
from gradwatch.rules.lifecycle import AlertLifecycle, AlertRule, parse_duration
from gradwatch.rules.liveness import (
    LivenessTracker,
    SilentRankDetector,
    StalledDetector,
    StragglerDetector,
)
from gradwatch.rules.loss import FlatFromStartDetector, RisingLossDetector
from gradwatch.rules.nonfinite import NonFiniteDetector
from gradwatch.rules.ratio import LayerRatioDetector
from gradwatch.rules.registry import detector_names, make_detector, register_detector
from gradwatch.rules.rulefile import (
    RuleFileError,
    RuleSpec,
    default_rules_path,
    load_default_rules,
    load_rules,
    load_rules_text,
)
from gradwatch.rules.spike import LossSpikeDetector
from gradwatch.rules.step import ActStats, Eval, Liveness, Stats, Step
from gradwatch.rules.vanishing import VanishingGradientDetector
from gradwatch.rules.weights import UpdateRatioDetector, WeightRunawayDetector

__all__ = [
    "CATEGORIES",
    "SEVERITIES",
    "ActStats",
    "Alert",
    "AlertLifecycle",
    "AlertRule",
    "Category",
    "DeadUnitsDetector",
    "Detector",
    "Engine",
    "Eval",
    "EvalModeWiringDetector",
    "Finding",
    "FlatFromStartDetector",
    "EvalLossNonFiniteDetector",
    "GeneralizationGapDetector",
    "GeometricGrowthDetector",
    "JobHistory",
    "LayerRatioDetector",
    "Liveness",
    "LivenessTracker",
    "LossScaleCollapseDetector",
    "LossSpikeDetector",
    "NonFiniteDetector",
    "RisingLossDetector",
    "RuleFileError",
    "RuleSpec",
    "SaturationDetector",
    "Severity",
    "SilentRankDetector",
    "StragglerDetector",
    "StalledDetector",
    "Stats",
    "Step",
    "Transition",
    "UpdateRatioDetector",
    "VanishingGradientDetector",
    "WeightRunawayDetector",
    "diagnose",
    "default_rules_path",
    "detector_names",
    "load_default_rules",
    "load_rules",
    "load_rules_text",
    "make_detector",
    "parse_duration",
    "register_detector",
]
