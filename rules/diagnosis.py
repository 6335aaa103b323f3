"""The seed's ``diagnose`` decision tree over a job's history, attached to every alert.

The tree, in the seed's order::

    any loss nan/inf                               -> numerical instability
    trending_up(norms) and trending_up(losses[-50:]) -> gradient explosion
    all(n < 1e-6 for n in norms[-50:]) and not converged(losses) -> vanishing gradients
    flat(losses) from the start                     -> dead pipeline
    losses decreasing but val_losses diverging      -> generalization gap
    otherwise                                       -> no anomaly in optimization signals

The surface symptom and its cause can be far apart: in the seed's worked
example the loss went NaN at step 40, but the layer-1/layer-6 grad-norm ratio
was ~1:800 by step 20, from tanh saturation under a 10x init. So the history
also keeps *precursors* -- the first step each warning sign appeared in its
latest episode (layer ratio beyond 100, early-layer norms collapsing,
activations saturating, ReLUs dying, grad norm or weights growing 100x/10x,
loss scale at 1, update ratio > 0.1) -- and a diagnosis names the earliest
one that began before the alert's step as its likely ``earlier_cause``.
Like the seed's tree, it narrows the search; it does not claim certainty.

The history and its precursors (:class:`JobHistory`) are kept by
:mod:`gradwatch.rules.history`; this module is the tree and the text built from it.
Memory is bounded: fixed-size deques and one record per precursor signal.

Example::

    history = JobHistory()
    for step in steps:
        history.observe_step(step)
    diagnose(history, alert)["verdict"]   # "numerical", "vanishing_gradients", ...
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from gradwatch.rules.alert import Alert
from gradwatch.rules.evals import gap_in
from gradwatch.rules.history import (
    DEAD,
    DEAD_TAIL,
    EPISODE_GAP,
    LARGE_NORM,
    RATIO_LIMIT,
    SATURATED,
    SMALL_INIT_STEPS,
    JobHistory,
    Precursor,
)
from gradwatch.rules.series import flat_since_start, trending_up

# The history and its precursors moved to gradwatch.rules.history; importers of this
# module keep finding them here.
__all__ = [
    "CHECKS",
    "DEAD",
    "DEAD_TAIL",
    "EPISODE_GAP",
    "LARGE_NORM",
    "NORM_FLOOR",
    "RATIO_LIMIT",
    "SATURATED",
    "SIGNAL_CATEGORIES",
    "SMALL_INIT_STEPS",
    "VERDICTS",
    "WAKING_UP",
    "JobHistory",
    "Precursor",
    "diagnose",
]

# A name for every alert category (the verdict of an alert is its own class) and
# for the seed tree's "nothing found".
VERDICTS: Mapping[str, str] = MappingProxyType(
    {
        "numerical": "numerical instability",
        "exploding_gradients": "gradient explosion",
        "vanishing_gradients": "vanishing gradients",
        "dead_pipeline": "dead pipeline",
        "loss_spike": "loss spike",
        "lr_too_high": "learning rate too high",
        "lr_too_low": "learning rate too low",
        "generalization_gap": "generalization gap",
        "saturation": "activation saturation",
        "dead_units": "dead units",
        "weight_runaway": "weight runaway",
        "update_ratio": "update size out of band",
        "loss_scale_collapse": "loss-scale collapse",
        "eval_mode_wiring": "train/eval mode wiring",
        "stalled": "stalled job",
        "straggler": "straggler rank",
        "agent_health": "monitoring degraded",
        "none": "no anomaly detected in optimization signals",
    }
)

# The seed's advice per verdict, then per precursor class.
CHECKS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "numerical": (
            "log/exp and division on values that can reach 0 or overflow",
            "numeric precision (fp16/bf16 range) where values first went non-finite",
        ),
        "exploding_gradients": (
            "lower the learning rate",
            "add or tighten gradient clipping",
            "check initialisation scale",
        ),
        "vanishing_gradients": (
            "check activation saturation",
            "check depth without residual connections or normalisation",
            "check initialisation scale",
        ),
        "dead_pipeline": (
            "check data loading (do batches change?)",
            "check labels",
            "check loss wiring (is the loss connected to the parameters; does the optimizer step?)",
        ),
        "generalization_gap": (
            "revisit regularization (weight decay, dropout, augmentation, more data), "
            "not optimization",
        ),
        "saturation": (
            "reduce the initialisation scale (a too-large init saturates tanh/sigmoid)",
            "normalise inputs / add normalisation layers",
        ),
        "dead_units": (
            "lower the learning rate",
            "check initialisation and biases of the layers feeding the dead units",
            "consider an activation with a slope below zero (leaky ReLU)",
        ),
        "loss_scale_collapse": ("find the op that overflows in fp16 (keep it in fp32)",),
        "weight_runaway": ("add weight decay", "lower the learning rate"),
        "update_ratio": ("lower the learning rate",),
        "none": (),
    }
)

# Alerts about the training signals themselves: only these get an earlier cause.
SIGNAL_CATEGORIES = frozenset(
    {
        "numerical",
        "exploding_gradients",
        "vanishing_gradients",
        "dead_pipeline",
        "loss_spike",
        "lr_too_high",
        "lr_too_low",
        "saturation",
        "dead_units",
        "weight_runaway",
        "update_ratio",
        "loss_scale_collapse",
    }
)

NORM_FLOOR = 1e-6  # seed: all(n < 1e-6 for n in norms[-50:])
WAKING_UP = (
    "update_ratio_high",
    "grad_norm_growth",
    "weight_growth",
)  # a small init's consequences


# ---------------------------------------------------------------- the tree


def diagnose(
    history: JobHistory, alert: Alert, rule_checks: Sequence[str] = ()
) -> Mapping[str, Any]:
    """The diagnosis of ``alert`` from ``history``: verdict, summary, evidence, checks, cause.

    The verdict is the alert's own class, stated with the alert's own evidence
    (its summary): a diagnosis never contradicts the alert it explains. The
    seed's tree over the loss and grad norms (``tree``) adds what it finds
    when that is something else, and precursors add a likely earlier cause.
    Checks run from the most specific: the one the alert's evidence names as
    its ``lead_check`` (what the detector measured), "lower the learning rate"
    when the earlier cause is a measured step size far above the healthy band,
    the rule's own, then the earlier cause's, then the class's generic ones.
    """
    tree, reason, evidence = _verdict(history)
    verdict = alert.category if alert.category in VERDICTS else tree
    cause = _earlier_cause(history, alert)
    own = alert.summary.rstrip(".")
    # A summary that already opens with the class ("vanishing gradients: ...") is not
    # prefixed twice.
    summary = (
        own
        if own.lower().startswith(VERDICTS[verdict])
        else f"{VERDICTS[verdict]}: {own}"
        if own
        else VERDICTS[verdict]
    )
    if tree == verdict and reason:
        summary += f"; the seed's tree agrees ({reason})"
    elif tree != "none":
        summary += f"; the seed's tree also reads {VERDICTS[tree]} ({reason})"
    # A detector that measured which lever applies names it first (evidence "lead_check":
    # WeightNormRunaway under updates far above the healthy band leads with the lr).
    lead = alert.evidence.get("lead_check")
    checks: list[str] = [lead] if isinstance(lead, str) and lead else []
    cause_checks: list[str] = []
    if cause is not None:
        first = cause["chain"][0]
        summary += (
            f". Likely earlier cause, {cause['steps_before']} step(s) before this alert: "
            f"{first['summary']} (began at step {first['step']})"
        )
        summary += "".join(
            f"; then {c['summary']} (began at step {c['step']})" for c in cause["chain"][1:3]
        )
        for link in cause["chain"]:
            cause_checks += CHECKS.get(link["class"], ())
    # A measured step size far above the healthy band (an update_ratio precursor: the
    # whole model moved by percents per step) is the lever, like a detector's lead_check,
    # ahead of the rule's general list (llama2.c at lr x100: a grad-ratio alert 544 steps
    # after updates of 5% a step began led with "initialisation scale"). Other precursor
    # classes follow the rule's own checks: a chain can hold a misread one.
    lever = CHECKS["update_ratio"][0]
    own_first = (checks + list(rule_checks))[:1]
    if (
        cause is not None
        and any(link["class"] == "update_ratio" for link in cause["chain"])
        and not any(c.startswith(lever) for c in own_first)  # said already, more exactly
    ):
        checks.append(lever)
    # A detector that measured a rule check impossible says so (evidence "ruled_out":
    # prefixes of those checks): LayersLagging with one rate for every param group.
    ruled_out = alert.evidence.get("ruled_out")
    if isinstance(ruled_out, (list, tuple)) and ruled_out:
        prefixes = tuple(p for p in ruled_out if isinstance(p, str) and p)
        rule_checks = [c for c in rule_checks if not c.startswith(prefixes)]
    checks += list(rule_checks) + cause_checks
    summary += ". This narrows the search; it is not a certain cause."
    if not rule_checks:
        checks += CHECKS.get(verdict, ())  # the rule's own checks are the specific form of these
    return MappingProxyType(
        {
            "verdict": verdict,
            "tree": tree,
            "summary": summary,
            "evidence": tuple(evidence),
            "next_checks": _distinct(checks)[:10],
            "earlier_cause": cause,
        }
    )


def _verdict(h: JobHistory) -> tuple[str, str, list[dict[str, Any]]]:
    evidence: list[dict[str, Any]] = []
    if h.losses:
        evidence.append(_ev("latest_finite_loss", h.losses[-1][1], h.losses[-1][0]))
    if h.norms:
        evidence.append(_ev("latest_finite_grad_norm", h.norms[-1][1], h.norms[-1][0]))
    bad = h.nonfinite
    if bad is not None and h.latest_step is not None and bad[0] >= h.latest_step - 1000:
        evidence.insert(0, _ev(bad[1], bad[2], bad[0]))
        return "numerical", f"{bad[1]} was {bad[2]} at step {bad[0]}", evidence
    norms = [n for _, n in list(h.norms)[-100:]]
    losses = [v for _, v in list(h.losses)[-50:]]
    if trending_up(norms, 4.0) and trending_up(losses, 1.2):
        evidence.append(_ev("grad_norm_growth", norms[-1] / max(norms[0], 1e-300), h.norms[-1][0]))
        return "exploding_gradients", "grad norms and the loss are both trending up", evidence
    tail = [n for _, n in list(h.norms)[-50:]]
    if len(tail) == 50 and max(tail) == 0.0:
        # Exactly zero everywhere: nothing reached the parameters, nothing vanished with depth.
        evidence.append(_ev("max_grad_norm_last_50", 0.0, h.norms[-1][0]))
        return "dead_pipeline", "every gradient of the last 50 steps is exactly zero", evidence
    if len(tail) == 50 and max(tail) < NORM_FLOOR and not _converged(h):
        evidence.append(_ev("max_grad_norm_last_50", max(tail), h.norms[-1][0]))
        return (
            "vanishing_gradients",
            f"every grad norm of the last 50 steps < {NORM_FLOOR:g}",
            evidence,
        )
    flat = _flat(h)
    if flat is not None:
        evidence.append(_ev("loss_change_since_start", flat, h.losses[-1][0]))
        return "dead_pipeline", f"the loss moved {flat:+.2%} since step one", evidence
    gap = _gap(h)
    if gap is not None:
        evidence += gap
        return "generalization_gap", "validation loss rising while training loss falls", evidence
    return "none", "", evidence


def _ev(signal: str, value: float, step: int) -> dict[str, Any]:
    return {"signal": signal, "value": value, "step": step}


def _converged(h: JobHistory) -> bool:
    if not h.head or not h.losses:
        return False  # unknown: the seed's condition cannot exclude vanishing
    start = statistics.median(h.head[:10])
    level = statistics.median(v for _, v in list(h.losses)[-50:])
    return level <= 1e-3 or level <= 0.1 * abs(start)


def _flat(h: JobHistory) -> float | None:
    if (
        h.first_step is None
        or h.first_step > 10
        or len(h.head) < h.head_size
        or len(h.losses) < 2 * h.head_size
    ):
        return None
    tail = [v for _, v in list(h.losses)[-200:]]
    verdict = flat_since_start(h.head[:5], h.head, tail, tolerance=0.02, z=3.0)
    return verdict.change if verdict.flat else None


def _gap(h: JobHistory) -> list[dict[str, Any]] | None:
    found = gap_in(list(h.evals))
    if found is None:
        return None
    step = h.evals[-1][0]
    return [
        _ev("val_loss_level", found["val_level"], step),
        _ev("best_val_loss", found["best_val_loss"], int(found["best_step"])),
        _ev("train_loss", found["train_loss"], step),
    ]


def _earlier_cause(h: JobHistory, alert: Alert) -> dict[str, Any] | None:
    if alert.category not in SIGNAL_CATEGORIES:
        return None
    # Weights waking up from a too-small init move fast relative to themselves and take
    # their gradients up with them: those signs are its consequences, not a high lr.
    explained = WAKING_UP if "small_init" in h.precursors else ()
    chain = sorted(
        (
            p
            for p in h.precursors.values()
            if p.step < alert.step
            and p.category != alert.category
            and p.signal not in explained
            and p.last_step >= alert.step - 2 * EPISODE_GAP
        ),
        key=lambda p: (p.step, p.signal),
    )
    if not chain:
        return None
    first = chain[0]
    return {
        **first.to_dict(),
        "steps_before": alert.step - first.step,
        "chain": [p.to_dict() for p in chain],
    }


def _distinct(checks: list[str]) -> tuple[str, ...]:
    """Each check once; a general one ("lower the learning rate") that an earlier, more exact
    one already begins with is said already."""
    kept: list[str] = []
    for check in dict.fromkeys(checks):
        if not any(k.startswith(check) for k in kept):
            kept.append(check)
    return tuple(kept)
