"""Activation detectors on cadence statistics (seed Stage 4): saturation and dead units.

"Saturating activations (values pinned near ±1 for tanh, or a large fraction
of exact zeros for ReLU) indicate poor initialization scale or a learning rate
that pushed units into a dead regime."

* :class:`SaturationDetector` -- a tanh/sigmoid module's share of outputs
  pinned near its bounds (``ActStats.sat_frac``) at or above ``threshold``.
  smdebug's SaturatedActivation flags a layer with more than 50% of its
  nodes saturated (``threshold_layer=50``); 0.5 is the default here too.
* :class:`DeadUnitsDetector` -- a ReLU module's share of exact zeros
  (``ActStats.zero_frac``) at or above ``threshold``. A healthy ReLU layer
  outputs ~50% zeros, so smdebug DeadRelu's 50% (which counts *units* dead
  across a batch, not zero *values*) would fire on every healthy net; the
  default 0.9 is calibrated here on synthetic runs. With ``kinds=("gelu",
  "silu")`` it reads the agent's dead share of smooth activations (outputs in
  the flat negative tail), whose healthy level is near zero.

Both must hold on ``samples`` consecutive cadence samples of one module, so
one odd batch decides nothing, and a reported module is released only below
90% of the threshold (one episode, one incident). Memory is one counter per
module.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Annotated, Literal

from pydantic import Field

from gradwatch.rules.detector import INACTIVE, Finding, validated_params
from gradwatch.rules.loss import finite_loss
from gradwatch.rules.step import ActStats, Stats, Step
from gradwatch.rules.updates import FIRST_STEP_MAX, model_update_ratio

# Losses per block when DeadUnitsDetector asks whether the run learns (its latest and
# the block before).
LOSS_BLOCK = 10

RELEASE = 0.9  # a reported module is released below this share of the threshold
# A module whose share in the run's first sample was under this fraction of the threshold
# did not start saturated: its init is not the first suspect (SaturationDetector).
UNSATURATED_START = 0.2
_SMOOTH = frozenset({"gelu", "silu"})  # dead share = the flat negative tail, not exact zeros

# How a module came to saturate (SaturationDetector ``rise``): "abrupt" is every episode
# but a gradual one, "gradual" only those, "any" both.
Rise = Literal["any", "abrupt", "gradual"]


class _ShareDetector:
    """Shared logic: a per-module share at or above a threshold for ``samples`` cadence samples."""

    field_name = ""
    what = ""

    def __init__(
        self, threshold: float, samples: int, kinds: tuple[str, ...], max_named: int
    ) -> None:
        self.threshold, self.samples, self.kinds, self.max_named = (
            threshold,
            samples,
            tuple(kinds),
            max_named,
        )
        self._held: dict[str, int] = {}
        self._since: dict[str, int] = {}
        # Modules whose episode began while the run was learning (_learning): not reported
        # until their share falls back and they cross the threshold again.
        self._excused: set[str] = set()

    def _learning(self) -> bool:
        """Whether the run learns now, so a module crossing the threshold is excused."""
        return False

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Judge one cadence sample; None when it carries no activation statistics."""
        shares = [(a, self._share(a)) for a in stats.act if a.kind in self.kinds]
        measured = [(a, s) for a, s in shares if s is not None]
        if not measured:
            return None
        over: list[tuple[str, float, int]] = []
        for act, share in measured:
            # Hysteresis: a module already reported stays so until it falls below 90% of the
            # threshold, so a share hovering at the threshold is one incident, not many.
            reported = self._held.get(act.module, 0) >= self.samples
            if share >= (RELEASE * self.threshold if reported else self.threshold):
                held = self._held.get(act.module, 0) + 1
                self._held[act.module] = held
                self._since.setdefault(act.module, stats.step)
                if held == self.samples and self._learning():
                    self._excused.add(act.module)
                if held >= self.samples and act.module not in self._excused:
                    over.append((act.module, share, self._since[act.module]))
            else:
                self._held.pop(act.module, None)
                self._since.pop(act.module, None)
                self._excused.discard(act.module)
        return self._finding(stats, over) if over else INACTIVE

    def _share(self, act: ActStats) -> float | None:
        value = getattr(act, self.field_name)
        return None if value is None or value != value else float(value)

    def _finding(self, stats: Stats, over: list[tuple[str, float, int]]) -> Finding:
        over.sort(key=lambda item: (item[2], -item[1]))  # earliest first: the likely origin
        first = over[0]
        worst = max(over, key=lambda item: item[1])
        named = [m for m, _, _ in over[: self.max_named]]
        summary = (
            f"{len(over)} module(s) with {self.what} at or above {self.threshold:.0%} for "
            f"{self.samples}+ samples; first {first[0]!r} ({first[1]:.0%}) since step {first[2]}"
        )
        evidence = {
            "module": first[0],
            "share": first[1],
            "since_step": first[2],
            "worst_module": worst[0],
            "worst_share": worst[1],
            "modules": named,
            "count": len(over),
            "threshold": self.threshold,
            "step": stats.step,
        }
        return Finding(True, summary, evidence)


class SaturationDetector(_ShareDetector):
    """Active while a tanh/sigmoid module's saturated share is >= ``threshold`` (module docstring).

    The seed names the initialisation scale first, and a too-large init saturates from
    the first step (its worked example: Xavier x10). A module that the run's first sample
    found far below the threshold (under ``UNSATURATED_START`` of it, at a step up to
    ``FIRST_STEP_MAX``) was saturated by what training did since, so its alert leads with
    that instead (evidence ``lead_check``): CleanRL's PPO critic, 0% at step 1 and 60% at
    step 2,035 as its values grew with the returns, and the same script with the sign of
    its advantages flipped, whose actor went 0% -> 53%, were both told "initialisation
    scale" first.

    ``rise`` tells episodes apart by how the module got there. *Gradual*: seen under
    ``UNSATURATED_START`` of the threshold, then at least one sample between that and the
    threshold (the share climbed, it did not jump), while every sample of the climb had
    the model's update ratio (``model_update_ratio``, as UpdateRatioTooLarge reads it) at
    or under ``calm_ratio`` (updates of a healthy size). Healthy-sized steps that saturate
    a layer over many samples are the model fitting targets or inputs of a growing scale:
    CleanRL's PPO critic climbed 0% -> 11% -> 49% -> 66% over steps 1,035-2,235 at ratios
    ~2-4e-4 and solved CartPole (returns 500). Every other episode is *abrupt*: saturated
    from the first sample (the init), in one jump between two samples (inputs or an
    update that changed at once), or with oversized updates (lr x1000 on the same script:
    3% -> 60% in one step at ratios 0.3-0.6); or with no climb seen (joined mid-run), or
    no ratios measured.

    Example::

        SaturationDetector(threshold=0.5, samples=3).observe_stats(stats)
    """

    field_name = "sat_frac"
    what = "outputs pinned near their bounds"

    @validated_params
    def __init__(
        self,
        *,
        threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5,
        samples: Annotated[int, Field(ge=1)] = 3,
        kinds: tuple[str, ...] = ("tanh", "sigmoid"),
        max_named: Annotated[int, Field(ge=1)] = 10,
        rise: Rise = "any",
        calm_ratio: Annotated[float, Field(gt=0.0)] = 0.03,
    ) -> None:
        super().__init__(threshold, samples, kinds, max_named)
        self.rise, self.calm_ratio = rise, calm_ratio
        # Each module's share in the run's first sample (at a step up to FIRST_STEP_MAX).
        self._start: dict[str, tuple[int, float]] = {}
        self._seen_start = False
        # Per module under the threshold since a sample under UNSATURATED_START of it:
        # (that step, whether a sample between the two came since, the largest update
        # ratio since: inf where one was not measured). Frozen while over it.
        self._climb: dict[str, tuple[int, bool, float]] = {}

    def observe_stats(self, stats: Stats) -> Finding | None:
        """Keep the run's first sample's shares and each module's climb, then judge
        (``_ShareDetector``)."""
        if not self._seen_start:
            self._seen_start = True
            if stats.step <= FIRST_STEP_MAX:
                for act in stats.act:
                    share = self._share(act) if act.kind in self.kinds else None
                    if share is not None:
                        self._start[act.module] = (stats.step, share)
        if self.rise != "any":
            self._follow_climbs(stats)
        return super().observe_stats(stats)

    def _follow_climbs(self, stats: Stats) -> None:
        measured = model_update_ratio(stats)
        ratio = float("inf") if measured is None else measured
        for act in stats.act:
            share = self._share(act) if act.kind in self.kinds else None
            if share is None or self._held.get(act.module, 0):
                continue  # not measured, or over the threshold: its climb is what it was
            if share < UNSATURATED_START * self.threshold:
                self._climb[act.module] = (stats.step, False, ratio)
            elif (climb := self._climb.get(act.module)) is not None:
                if share < self.threshold:
                    self._climb[act.module] = (climb[0], True, max(climb[2], ratio))
                else:  # the crossing sample: its update counts, no middle sample now
                    self._climb[act.module] = (climb[0], climb[1], max(climb[2], ratio))

    def _gradual(self, module: str) -> bool:
        climb = self._climb.get(module)
        return climb is not None and climb[1] and climb[2] <= self.calm_ratio

    def _finding(self, stats: Stats, over: list[tuple[str, float, int]]) -> Finding:
        if self.rise != "any":
            gradual = self.rise == "gradual"
            over = [item for item in over if self._gradual(item[0]) is gradual]
            if not over:
                return INACTIVE
        found = super()._finding(stats, over)
        module = over[0][0]
        evidence = dict(found.evidence)
        climb = self._climb.get(module)
        if self.rise == "gradual" and climb is not None:
            evidence["climb_from_step"], evidence["climb_max_update_ratio"] = climb[0], climb[2]
            evidence["lead_check"] = (
                f"targets or inputs growing in scale: {module!r} climbed from under "
                f"{UNSATURATED_START * self.threshold:.0%} at step {climb[0]} over healthy-sized "
                f"updates (update ratio at most {climb[2]:.1e}); harmless while the "
                "layers before it still learn"
            )
            return Finding(True, found.summary, evidence)
        start = self._start.get(module)
        if start is None or start[1] >= UNSATURATED_START * self.threshold:
            return found
        at, share = start
        evidence["start_share"], evidence["start_step"] = share, at
        evidence["lead_check"] = (
            "the learning rate, or inputs or regression targets growing in scale: training "
            f"saturated it ({module!r} was {share:.0%} saturated at step {at}, so not the "
            "initialisation)"
        )
        return Finding(True, found.summary, evidence)


class DeadUnitsDetector(_ShareDetector):
    """Active while a ReLU module's share of exact zeros is >= ``threshold`` (module docstring).

    Dead units are a pathology because they stop learning; a layer that turns sparse
    while the run learns is not one. With ``falling`` set, a module whose episode (its
    share at or over the threshold for ``samples`` samples) begins while the last
    ``LOSS_BLOCK`` losses sit ``falling`` below the ``LOSS_BLOCK`` before them is
    excused until its share falls back (a supervised loss only: never after a loss
    below zero; under ``2 * LOSS_BLOCK`` losses the share alone decides).

    Example::

        DeadUnitsDetector(threshold=0.9, samples=3).observe_stats(stats)
    """

    field_name = "zero_frac"
    what = "exact-zero outputs"

    @validated_params
    def __init__(
        self,
        *,
        threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9,
        samples: Annotated[int, Field(ge=1)] = 3,
        kinds: tuple[str, ...] = ("relu", "relu6"),
        max_named: Annotated[int, Field(ge=1)] = 10,
        falling: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0,
    ) -> None:
        super().__init__(threshold, samples, kinds, max_named)
        self.falling = falling
        self._recent: deque[float] = deque(maxlen=2 * LOSS_BLOCK)
        self._signed = False
        # A GELU/SiLU is never exactly zero: its dead share is the flat negative tail, and a
        # summary saying "exact-zero outputs" of one contradicted the number it showed.
        smooth = {k for k in self.kinds if k in _SMOOTH}
        if smooth and smooth == set(self.kinds):
            self.what = "outputs in the flat negative tail (slope ~1% of linear)"
        elif smooth:
            self.what = "dead outputs (ReLU: exact zeros; GELU/SiLU: the flat negative tail)"

    def loss_not_supervised(self) -> None:
        """The job declared its loss no supervised loss (rules/engine.py; a loss below zero
        says the same, ``observe``): a falling loss then says nothing of whether the run
        learns, so no module is excused. CleanRL's DQN at lr x100 ends at a return of 128
        (498 healthy) with 97-99% of its first ReLU layer's outputs zero, excused while its
        TD loss fell (benchmarks/cleanrl_trial.py)."""
        self._signed = True

    def observe(self, step: Step) -> None:
        """Track the loss for ``falling``; judged on cadence samples."""
        if not self.falling or (loss := finite_loss(step)) is None:
            return
        self._signed = self._signed or loss < 0.0
        self._recent.append(loss)

    def _learning(self) -> bool:
        if not self.falling or self._signed or len(self._recent) < 2 * LOSS_BLOCK:
            return False  # too few losses (or no supervised loss) to say it learns
        recent = list(self._recent)
        older = statistics.median(recent[:LOSS_BLOCK])
        return statistics.median(recent[LOSS_BLOCK:]) <= (1.0 - self.falling) * older
