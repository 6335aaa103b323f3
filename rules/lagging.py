"""Layers that learn far slower than the rest of the model, and why (LayersLagging).

:class:`LaggingLayersDetector` compares the weight matrices' update ratios
‖Δw‖/‖w‖ on a cadence sample, then rules out what explains a lag other than
the optimizer giving those layers smaller steps: smaller gradients (under
SGD), the layer's own weight growth, and, where the census names each layer's
param group, a group learning rate set lower on purpose.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.roles import roles_of
from gradwatch.rules.step import Stats, Step

# LaggingLayersDetector's running mean of log gradient norms: one step in GRAD_EVERY is
# folded in at weight 1/4, so the mean follows the last ~8 steps (the offline check on
# the kept traces used the median of the last 16).
GRAD_MEAN_WEIGHT = 0.25
GRAD_EVERY = 2
# What a lag that the layers' own param-group rate accounts for does (LaggingLayersDetector):
# "ignore" judges every lag alike; "exclude" leaves such layers out (LayersLagging pages the
# rest); "only" judges those alone (LayersLaggingByGroupRate, info).
GroupRates = Literal["ignore", "exclude", "only"]
# LaggingLayersDetector: param-group learning rates within this factor of each other are
# one rate (a float32 round trip, or a scheduler's rounding).
SAME_LR = 1.0 + 1e-6
# A weight matrix whose norm is below this share of the median matrix's has no update
# ratio to compare: LoRA's zero-initialised B reads 0.008 of the median after one step
# (and ‖Δw‖/‖w‖ ~0.2, its update over almost nothing), which made the A matrices "lag
# 30x" at step 2 of a healthy LoRA fine-tune. Healthy full models: the smallest weight
# matrix is >= 0.22 of the median (nanoGPT, minGPT, the HF GPT-2 and the fault suite).
SIZED_SHARE = 0.1


def _sized(weight_norms: np.ndarray | None, weight: np.ndarray) -> np.ndarray:
    """The layers whose weight norm is at least SIZED_SHARE of the median weight matrix's
    (all of them when the sample carries no weight norms)."""
    if weight_norms is None:
        return np.ones_like(weight)
    norms = np.asarray(weight_norms, dtype=np.float64)
    if norms.shape != weight.shape or not weight.any():
        return np.ones_like(weight)
    with np.errstate(invalid="ignore"):
        return np.asarray(norms >= SIZED_SHARE * float(np.median(norms[weight])), dtype=bool)


def _besides(weight: np.ndarray, lagging: np.ndarray) -> np.ndarray:
    """The weight matrices other than the lagging ones: the reference each check weighs a
    lagging layer against."""
    others: np.ndarray = weight.copy()
    others[lagging] = False
    return others


class LaggingLayersDetector:
    """Active while some weight matrices update ``factor`` times slower than the model's fast
    ones, not because their gradients are smaller.

    ‖Δw‖/‖w‖ per layer, on weight matrices only (roles as for the layer ratio:
    norm gains, biases and embeddings move at rates of their own). A layer far
    below the others learns ~``factor`` times slower. The reference is the upper
    decile of the layers' ratios, not their median: when most layers lag (every
    hidden layer of an MLP behind its head), the median is a lagging layer
    itself. Layers below ``low`` are frozen (LayersFrozen's) and left out, and so
    are matrices far smaller than the median one (``SIZED_SHARE``: a
    zero-initialised LoRA B).

    A lag counts only when the optimizer moved the layer less *per unit of its
    gradient*: its step ‖Δw‖/‖g‖ (‖g‖ a running mean of its gradient norms, in
    logs) at least ``unexplained`` times below the median step of the layers that
    do not lag. A param group with a far smaller learning rate (the cause this
    rule names first) does that under any optimizer. A layer whose gradient is
    small moves little under SGD (the same step per unit of gradient for every
    layer) with nothing misconfigured: a healthy LSTM's first ~40 steps
    (pytorch/examples' word_language_model, hand-written SGD at lr 20: lags up to
    93x). That is gradients vanishing on the way down, which
    LayerGradNormRatioVanishing and the activation rules judge against the run's
    own history. A sample is not judged before its layers' gradient norms arrive
    (a rank that sends none sends no samples either).

    Nor does a lag count that the layer's own growth explains: a ratio is small
    when ‖Δw‖ is small *or* when ‖w‖ grew. A layer counts only while its lag, net
    of how much more its weight norm grew since the first sample than the median
    matrix's, is still ``factor``. CleanRL's PPO (healthy, Adam): the value head
    grew x10.5 as its outputs climbed towards the returns and lagged 30-45x, its
    steps the size they had been. A param group at a smaller rate barely grows.

    A lag that the layer's own param-group rate accounts for (the census's
    ``groups``; the steps carry each group's rate) is the loop's choice: net of
    how far that rate is below the other matrices' median rate, it falls short of
    ``factor``. ``group_rates`` "exclude" leaves such layers out (LayersLagging),
    "only" judges them alone (LayersLaggingByGroupRate, info: discriminative
    rates suit a pretrained backbone and starve one trained from scratch), and
    "ignore" (the default) judges every lag alike.

    Example::

        det = LaggingLayersDetector(factor=100.0)
        det.observe_stats(stats).evidence["lagging_layers"]
    """

    @validated_params
    def __init__(
        self,
        *,
        factor: Annotated[float, Field(gt=1.0)] = 100.0,
        low: Annotated[float, Field(ge=0.0)] = 1e-6,
        samples: Annotated[int, Field(ge=1)] = 3,
        min_layers: Annotated[int, Field(ge=3)] = 3,
        max_named: Annotated[int, Field(ge=1)] = 10,
        unexplained: Annotated[float, Field(ge=1.0)] = 1.0,
        group_rates: GroupRates = "ignore",
    ) -> None:
        self.factor, self.low, self.samples = factor, low, samples
        self.min_layers, self.max_named = min_layers, max_named
        self.unexplained, self.group_rates = unexplained, group_rates
        self._sent: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        # log10 of each layer's gradient norm, a running mean over recent steps: one array
        # per rank, where a window of the last 16 steps would hold 16 (on every rank).
        self._grads: tuple[tuple[str, ...], np.ndarray] | None = None
        self._since_fold = 0
        self._held = 0
        self._since: int | None = None
        # Each layer's weight norm in the first sample that had it (a layer started at
        # zero: its first non-zero one), for the layer set that sample named.
        self._first: tuple[tuple[str, ...], np.ndarray] | None = None
        # The latest step's learning rate per param group: () when none was sent; and each
        # layer's group, from the latest census that named them.
        self._lrs: tuple[float, ...] = ()
        self._groups: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())

    def observe(self, step: Step) -> None:
        """Keep the roles the agent sent with the step's layers, its learning rates and
        its gradient norms."""
        if step.layer_roles:
            self._sent = (step.layers, step.layer_roles)
        if step.lr:
            self._lrs = step.lr
        if self.unexplained <= 1.0 or not step.layers or step.layer_norms.size != len(step.layers):
            return
        # Folded in every GRAD_EVERY-th step only: a few array operations per fold, where
        # the collector handles every step of every reporting rank.
        self._since_fold += 1
        last = self._grads
        if last is not None and last[0] == step.layers and self._since_fold < GRAD_EVERY:
            return
        self._since_fold = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.asarray(step.layer_norms, dtype=np.float64))
        if last is None or last[0] != step.layers:
            self._grads = (step.layers, logs)
            return
        # A layer without a finite norm this step (none yet, NaN) keeps its mean.
        mean = last[1]
        fine = np.isfinite(logs)
        start = fine & ~np.isfinite(mean)
        mean[start] = logs[start]
        move = fine & ~start
        mean[move] += GRAD_MEAN_WEIGHT * (logs[move] - mean[move])

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no usable update ratios."""
        if stats.update_ratios is None or len(stats.layers) != np.asarray(stats.update_ratios).size:
            return None
        ratios = np.asarray(stats.update_ratios, dtype=np.float64)
        roles = roles_of(stats.layers, self._sent[1] if self._sent[0] == stats.layers else ())
        weight = (
            np.array([r == "weight" for r in roles]) & np.isfinite(ratios) & (ratios >= self.low)
        )
        weight &= _sized(stats.weight_norms, weight)
        if int(weight.sum()) < self.min_layers:
            return None
        logs = np.log10(ratios[weight])
        median = float(np.median(logs))
        upper = float(np.quantile(logs, 0.9, method="higher"))  # a layer, not between two
        lagging = np.flatnonzero(weight)[logs < upper - math.log10(self.factor)]
        with np.errstate(divide="ignore", invalid="ignore"):
            lags = upper - np.log10(ratios)
        lagging = self._not_grown(stats, weight, lagging, lags)
        if stats.census is not None:
            self._groups = (stats.layers, stats.census.groups)
        rates = self._rates(stats, weight, lagging)
        if rates is not None and self.group_rates != "ignore":
            # Net of its group's rate below the others' (log10), a lag short of `factor`
            # is the rate the loop set: by design for a pretrained backbone.
            by_rate = lags[lagging] - rates < math.log10(self.factor)
            lagging = lagging[by_rate if self.group_rates == "only" else ~by_rate]
        elif self.group_rates == "only":
            lagging = lagging[:0]
        counted = self._unexplained(stats, ratios, weight, lagging)
        if counted is None:
            return None  # no gradient norms for these layers yet: no judgement
        lagging = counted
        if lagging.size == 0:
            self._held, self._since = 0, None
            return INACTIVE
        self._held += 1
        if self._since is None:
            self._since = stats.step
        if self._held < self.samples:
            return INACTIVE
        names = [stats.layers[i] for i in lagging]
        slowest = float(ratios[lagging].min())
        shown = ", ".join(repr(n) for n in names[: self.max_named]) + (
            " …" if len(names) > self.max_named else ""
        )
        summary = (
            f"{len(names)} weight layer(s) update over {self.factor:g}× slower than the model's "
            "fastest "
            f"(‖Δw‖/‖w‖ down to {slowest:.3g} against {10.0**upper:.3g} in the upper decile, "
            "median "
            f"{10.0**median:.3g}) for {self._held} samples since step {self._since}: {shown}"
        )
        evidence = {
            "lagging_layers": names[: self.max_named],
            "count": len(names),
            "slowest_ratio": slowest,
            "median_ratio": 10.0**median,
            "reference_ratio": 10.0**upper,
            "samples": self._held,
            "since_step": self._since,
        }
        if self.group_rates == "only":
            return self._by_rate(lagging, evidence, shown)
        lrs = self._lrs
        rates = self._rates(stats, weight, lagging)
        if lrs and all(math.isfinite(lr) for lr in lrs):
            evidence["group_lrs"] = list(lrs)
            rate = f"every param group runs at {lrs[0]:.3g}"
            one_rate = max(lrs) <= min(lrs) * SAME_LR
            if rates is not None:  # the census names each layer's group
                rate = "their param group's rate is not below the other layers'"
                one_rate = bool((rates <= math.log10(SAME_LR)).all())
            if one_rate:
                # No smaller rate for these layers: the rule's first suspect, a param group
                # at a smaller rate, cannot be it (CleanRL's PPO at lr x1000, one Adam
                # group: the collapsed actor's steps, scaled by second moments of its first
                # huge gradients, lagged 10,000x; it was told to check group rates).
                evidence["lead_check"] = (
                    f"not a smaller learning rate ({rate}): "
                    "the optimizer's own scaling shrinks these layers' steps, most often "
                    "Adam's second moments still holding far larger earlier gradients (an "
                    "earlier blow-up: lower the learning rate), else a per-layer trust ratio "
                    "(LARS, LAMB) or a hook that scales their updates"
                )
                evidence["ruled_out"] = [
                    "per-parameter-group learning rates",
                    "layer-wise learning-rate decay",
                ]
        return Finding(True, summary, evidence)

    def _rates(self, stats: Stats, weight: np.ndarray, lagging: np.ndarray) -> np.ndarray | None:
        """How far (log10) each lagging layer's param-group learning rate is below the
        median rate of the other weight matrices; None while the census has not named
        every judged layer's group or the steps carried no rates for them."""
        layers, groups = self._groups
        lrs = self._lrs
        if lagging.size == 0 or layers != stats.layers or len(groups) != weight.size or not lrs:
            return None
        index = np.asarray(groups)
        known = (index >= 0) & (index < len(lrs))
        if not known[weight].all():
            return None
        rate = np.full(weight.size, np.nan)
        rate[known] = np.log10(np.maximum(np.asarray(lrs, dtype=np.float64)[index[known]], 1e-300))
        others = _besides(weight, lagging)
        if not others.any() or not np.isfinite(rate[weight]).all():
            return None
        below: np.ndarray = np.maximum(float(np.median(rate[others])) - rate[lagging], 0.0)
        return below

    def _by_rate(self, lagging: np.ndarray, evidence: dict[str, object], shown: str) -> Finding:
        """The finding of layers that lag by their param group's rate (``group_rates``
        "only"): the rate the loop set, intended on a pretrained backbone."""
        groups = self._groups[1]
        rates = sorted({self._lrs[groups[i]] for i in lagging})
        others = sorted(set(self._lrs) - set(rates), reverse=True)
        evidence["group_lrs"] = list(self._lrs)
        evidence["lagging_lrs"] = rates
        slowest, reference = evidence["slowest_ratio"], evidence["reference_ratio"]
        assert isinstance(slowest, float) and isinstance(reference, float)
        summary = (
            f"{len(lagging)} weight layer(s) update up to {reference / slowest:.3g}× slower "
            "than the model's fastest, as their param group's learning rate sets ("
            + ", ".join(f"{r:.3g}" for r in rates)
            + (" against " + ", ".join(f"{r:.3g}" for r in others[:3]) if others else "")
            + "): discriminative or layer-wise rates, which suit a pretrained backbone; "
            f"from scratch these layers barely learn. Since step {self._since}: {shown}"
        )
        return Finding(True, summary, evidence)

    def _not_grown(
        self, stats: Stats, weight: np.ndarray, lagging: np.ndarray, lags: np.ndarray
    ) -> np.ndarray:
        """The lagging layers whose lag (``lags``: log10 below the upper decile) is still
        ``factor`` net of their weight norm's growth since the first sample, beyond the
        median matrix's growth (the class docstring: a ratio small because ‖w‖ grew)."""
        norms = stats.weight_norms
        if norms is None or len(norms) != weight.size:
            return lagging
        now = np.asarray(norms, dtype=np.float64)
        first = self._first
        if first is None or first[0] != stats.layers:
            self._first = (stats.layers, now.copy())
            return lagging
        start = first[1]
        unset = ~(start > 0)  # NaN (not read yet) or zero (a zero-initialised layer)
        start[unset] = now[unset]
        if lagging.size == 0:
            return lagging
        with np.errstate(divide="ignore", invalid="ignore"):
            growth = np.log10(now / start)
        others = _besides(weight, lagging)
        known = others & np.isfinite(growth)
        if not known.any():
            return lagging
        excess = np.nan_to_num(growth[lagging] - float(np.median(growth[known])), nan=0.0)
        result: np.ndarray = lagging[
            lags[lagging] - np.maximum(excess, 0.0) >= math.log10(self.factor)
        ]
        return result

    def _unexplained(
        self, stats: Stats, ratios: np.ndarray, weight: np.ndarray, lagging: np.ndarray
    ) -> np.ndarray | None:
        """The lagging layers whose step per unit of gradient (‖Δw‖/‖g‖) is ``unexplained``
        times below the median of the other weight matrices' (the class docstring); None
        while no gradient norms of these layers have arrived (a sample can arrive before
        its steps' batch)."""
        grads, norms = self._grads, stats.weight_norms
        if lagging.size == 0 or self.unexplained <= 1.0:
            return lagging
        if grads is None or grads[0] != stats.layers:
            return None
        if norms is None or len(norms) != ratios.size:
            return lagging
        with np.errstate(divide="ignore", invalid="ignore"):
            steps = np.log10(ratios * np.asarray(norms, dtype=np.float64)) - grads[1]
        others = _besides(weight, lagging)
        known = others & np.isfinite(steps)
        if not known.any():
            return lagging
        reference = float(np.median(steps[known]))
        # A lagging layer whose step is not known (no finite gradient norm yet) counts.
        kept = ~(steps[lagging] >= reference - math.log10(self.unexplained))
        result: np.ndarray = lagging[kept]
        return result
