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

Memory is bounded: fixed-size deques and one record per precursor signal.

Example::

    history = JobHistory()
    for step in steps:
        history.observe_step(step)
    diagnose(history, alert)["verdict"]   # "numerical", "vanishing_gradients", ...
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from gradwatch.rules.alert import Alert
from gradwatch.rules.detector import is_amp_skip
from gradwatch.rules.evals import gap_in
from gradwatch.rules.growth import total_grad_norm
from gradwatch.rules.ratio import LayerEnds
from gradwatch.rules.roles import roles_of
from gradwatch.rules.series import flat_since_start, trending_up
from gradwatch.rules.step import Eval, Stats, Step
from gradwatch.rules.weights import UpdateRatioDetector

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
            "check initialisation and biases of the ReLU layers",
            "consider leaky ReLU/GELU",
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
LARGE_NORM = 1.0  # nanoGPT's grad_clip and HF Trainer's max_grad_norm default
RATIO_LIMIT = 2.0  # seed Stage 3: two orders of magnitude between first and last layers
SATURATED = (
    0.5  # share of tanh/sigmoid outputs pinned near the bounds (smdebug threshold_layer 50%)
)
DEAD = 0.9  # share of exact-zero ReLU outputs (healthy nets have ~50%)
DEAD_TAIL = 0.5  # share of GELU/SiLU outputs in the flat negative tail (healthy ~0.1%)
EPISODE_GAP = 200  # steps a precursor may pause before a new episode starts
SMALL_INIT_STEPS = (
    20  # a first weight sample this early describes the init (WeightsStartedTooSmall)
)
WAKING_UP = (
    "update_ratio_high",
    "grad_norm_growth",
    "weight_growth",
)  # a small init's consequences


@dataclass(slots=True)
class Precursor:
    """One warning sign's latest episode: where it began, its worst value, when it last held."""

    signal: str
    category: str
    step: int
    value: float
    detail: str
    peak: float
    peak_step: int
    last_step: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "class": self.category,
            "step": self.step,
            "value": self.value,
            "peak": self.peak,
            "peak_step": self.peak_step,
            "summary": self.detail,
        }


class JobHistory:
    """Bounded history of one job (its lowest-numbered reporting rank) for the diagnosis."""

    def __init__(
        self, steps: int = 1024, evals: int = 256, stats: int = 256, head: int = 64
    ) -> None:
        self.losses: deque[tuple[int, float]] = deque(maxlen=steps)
        self.norms: deque[tuple[int, float]] = deque(maxlen=steps)
        self.head: list[float] = []
        self.head_size = head
        self.first_step: int | None = None
        self.latest_step: int | None = None
        self.nonfinite: tuple[int, str, float] | None = None  # latest (step, signal, value)
        self.evals: deque[tuple[int, float, float | None]] = deque(maxlen=evals)
        self.weight_norms: deque[tuple[int, float]] = deque(maxlen=stats)
        self.precursors: dict[str, Precursor] = {}
        self._early_norms: list[float] = []
        self._early_first: list[float] = []
        self._first_weight: float | None = None
        self._first_weight_step = 0
        self._roles: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._ratios: deque[float] = deque(maxlen=5)
        self._ends = LayerEnds()

    # ------------------------------------------------------------ inputs

    def observe_step(self, step: Step) -> None:
        """Take one step of the job's reporting rank into account."""
        if self.first_step is None:
            self.first_step = step.step
        self.latest_step = step.step
        if step.layer_roles:
            self._roles = (step.layers, step.layer_roles)
        if is_amp_skip(step):
            return  # overflow by design, recovered by the scaler
        if step.loss_scale is not None and step.loss_scale <= 1.0:
            self._mark(
                "loss_scale_floor",
                "loss_scale_collapse",
                step.step,
                step.loss_scale,
                f"AMP loss scale down to {step.loss_scale:g}",
                high=False,
            )
        loss = step.loss
        if loss is not None:
            if math.isfinite(loss):
                self.losses.append((step.step, loss))
                if len(self.head) < self.head_size:
                    self.head.append(loss)
            else:
                self.nonfinite = (step.step, "loss", loss)
        norm = total_grad_norm(step)
        if norm is not None:
            if math.isfinite(norm):
                self._observe_norm(step.step, norm)
            elif self.nonfinite is None or self.nonfinite[0] != step.step:
                self.nonfinite = (step.step, "grad_norm", norm)
        if step.layer_norms.size:
            self._observe_layers(step)

    def observe_stats(self, stats: Stats) -> None:
        """Take one cadence sample into account: activations, weight norms, update ratios."""
        for act in stats.act:
            if (
                act.sat_frac is not None
                and act.kind in ("tanh", "sigmoid")
                and act.sat_frac >= SATURATED
            ):
                self._mark(
                    "activation_saturation",
                    "saturation",
                    stats.step,
                    act.sat_frac,
                    f"{act.kind} outputs of {act.module!r} {act.sat_frac:.0%} saturated",
                )
            dead = (
                DEAD
                if act.kind in ("relu", "relu6")
                else DEAD_TAIL
                if act.kind in ("gelu", "silu")
                else None
            )
            if act.zero_frac is not None and dead is not None and act.zero_frac >= dead:
                what = (
                    "exactly zero" if act.kind in ("relu", "relu6") else "in the flat negative tail"
                )
                self._mark(
                    "dead_units",
                    "dead_units",
                    stats.step,
                    act.zero_frac,
                    f"{act.kind} outputs of {act.module!r} {act.zero_frac:.0%} {what}",
                )
        if stats.weight_norms is not None:
            w = np.asarray(stats.weight_norms, dtype=np.float64)
            if w.size and np.isfinite(w).all():
                w = w[
                    self._matrices(stats.layers, w.size)
                ]  # LayerNorm gains start at 1 whatever the init
                total = math.sqrt(float(np.dot(w, w)))
                self.weight_norms.append((stats.step, total))
                if self._first_weight is None:
                    self._first_weight, self._first_weight_step = total, stats.step
                elif self._first_weight > 0 and total >= 10 * self._first_weight:
                    grown = total / self._first_weight
                    if self._first_weight_step <= SMALL_INIT_STEPS:
                        # Grown 10x from the init itself: weights waking up from a too-small init.
                        self._mark(
                            "small_init",
                            "vanishing_gradients",
                            stats.step,
                            grown,
                            f"total weight norm ×{grown:.0f} its value at step "
                            f"{self._first_weight_step}"
                            " (initialisation too small)",
                        )
                    else:
                        self._mark(
                            "weight_growth",
                            "weight_runaway",
                            stats.step,
                            grown,
                            f"total weight norm ×{grown:.0f} its first value",
                        )
        if stats.update_ratios is not None:
            r = np.asarray(stats.update_ratios, dtype=np.float64)
            finite = np.isfinite(r)
            # As UpdateRatioTooLarge measures it (weighted by weight norm): a median over layers
            # reads a tiny-init model's small layers as "updates too large".
            value = (
                UpdateRatioDetector.global_ratio(r, finite, stats.weight_norms)
                if finite.any()
                else 0.0
            )
            if value > 0.1:
                self._mark(
                    "update_ratio_high",
                    "update_ratio",
                    stats.step,
                    value,
                    f"‖Δw‖/‖w‖ {value:.3g} over the model (healthy ~1e-3)",
                )

    def _matrices(self, layers: tuple[str, ...], size: int) -> np.ndarray:
        """Mask of the weight matrices among ``layers`` (every layer when none is known as one)."""
        if len(layers) != size:
            return np.ones(size, dtype=bool)
        roles = roles_of(layers, self._roles[1] if self._roles[0] == layers else ())
        mask = np.array([r == "weight" for r in roles], dtype=bool)
        return mask if mask.any() else np.ones(size, dtype=bool)

    def observe_eval(self, ev: Eval) -> None:
        """Take one evaluation into account, with the training level at that time."""
        if ev.loss is None or not math.isfinite(ev.loss):
            return
        recent = [v for _, v in list(self.losses)[-50:]]
        self.evals.append(
            (ev.step, ev.loss, statistics.median(recent) if len(recent) >= 5 else None)
        )

    # ------------------------------------------------------------ precursors

    def _observe_norm(self, step: int, norm: float) -> None:
        self.norms.append((step, norm))
        if len(self._early_norms) < 10:
            self._early_norms.append(norm)
            return
        base = statistics.median(self._early_norms)
        # Growth from a tiny start towards a normal level (weights waking up) is no explosion:
        # the norm must also be large (the growth rule's min_norm, where clipping starts).
        if base > 0 and norm >= 100 * base and norm >= LARGE_NORM:
            self._mark(
                "grad_norm_growth",
                "exploding_gradients",
                step,
                norm / base,
                f"total grad norm ×{norm / base:.0f} its early level",
            )

    def _observe_layers(self, step: Step) -> None:
        # The same ends as the ratio rule: weight matrices, not norm gains or tied embeddings.
        end = self._ends.measure(step)
        if end is None:
            return
        self._ratios.append(end.log_ratio)
        if len(self._ratios) == self._ratios.maxlen:
            log_ratio = statistics.median(self._ratios)
            if abs(log_ratio) >= RATIO_LIMIT:
                vanishing = log_ratio < 0
                ratio = 10.0**log_ratio
                how = f"1:{1 / ratio:.0f}" if vanishing else f"{ratio:.0f}:1"
                self._mark(
                    "layer_ratio",
                    "vanishing_gradients" if vanishing else "exploding_gradients",
                    step.step,
                    ratio,
                    f"first/last layer grad-norm ratio {how} ({end.first!r} vs {end.last!r})",
                    high=not vanishing,
                )
        if len(self._early_first) < 10:
            self._early_first.append(end.first_norm)
        elif (
            end.first_norm < 1e-2 * statistics.median(self._early_first) and not self._converging()
        ):
            # A loss that fell 10x shrinks every gradient with it (a memorized batch does):
            # that is convergence, not the first layer's gradient vanishing.
            drop = end.first_norm / statistics.median(self._early_first)
            self._mark(
                "first_layer_collapse",
                "vanishing_gradients",
                step.step,
                drop,
                f"first layer's grad norm fell to {drop:.2g}× its early level",
                high=False,
            )

    def _converging(self) -> bool:
        if len(self.head) < 10 or len(self.losses) < 3:
            return False
        start = statistics.median(self.head[:10])
        level = statistics.median(v for _, v in list(self.losses)[-3:])  # the gradients' loss now
        return level <= 0.1 * abs(start)

    def _mark(
        self, signal: str, category: str, step: int, value: float, detail: str, high: bool = True
    ) -> None:
        mark = self.precursors.get(signal)
        if mark is None or step - mark.last_step > EPISODE_GAP or step < mark.step:
            self.precursors[signal] = Precursor(
                signal, category, step, value, detail, value, step, step
            )
            return
        mark.last_step = step
        if (value > mark.peak) if high else (value < mark.peak):
            mark.peak, mark.peak_step = value, step
            mark.detail = detail


# ---------------------------------------------------------------- the tree


def diagnose(
    history: JobHistory, alert: Alert, rule_checks: Sequence[str] = ()
) -> Mapping[str, Any]:
    """The diagnosis of ``alert`` from ``history``: verdict, summary, evidence, checks, cause.

    The verdict is the alert's own class, stated with the alert's own evidence
    (its summary): a diagnosis never contradicts the alert it explains. The
    seed's tree over the loss and grad norms (``tree``) adds what it finds
    when that is something else, and precursors add a likely earlier cause.
    Checks run from the most specific: the rule's own, then the earlier
    cause's, then the class's generic ones.
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
    checks: list[str] = list(rule_checks)
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
            checks += CHECKS.get(link["class"], ())
    summary += ". This narrows the search; it is not a certain cause."
    if not rule_checks:
        checks += CHECKS.get(verdict, ())  # the rule's own checks are the specific form of these
    return MappingProxyType(
        {
            "verdict": verdict,
            "tree": tree,
            "summary": summary,
            "evidence": tuple(evidence),
            "next_checks": tuple(dict.fromkeys(checks))[:10],
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
