"""Cadence weight statistics at a bounded cost per step and in memory.

Two statistics ride on a cadence sample, and both used to cost a whole model
at once on one step: the weight norms (one read of every parameter) and the
update ratios ``||dw|| / ||w||`` (a transient copy of every trainable
parameter: ~14 GB for a 7B bf16 model, on every rank under DDP).

* **Update ratios from a fixed sample** (agent/updateratios.py): at most
  ``SAMPLE`` elements per tensor, whatever the model's size.
* **Weight norms spread over steps.** The parameters' flattened element space
  is cut into at most ``MAX_PHASES`` ranges of about equal size (cutting
  through tensors); while a sample waits, one range is read per step, in
  rotation, and a sample ships once a full rotation was read since its step;
  the per-layer norm is the root of the summed squared partial norms. The
  norms of a large model therefore mix the weights of up
  to ``MAX_PHASES`` consecutive steps: off by at most what those updates
  moved them (an update ratio of ~1e-3 per step), while no step pays more
  than ``1/MAX_PHASES`` of a full read. A model under ``MIN_PHASE_ELEMENTS``
  per phase is read in one step, exactly.
* **The rest of a sample on the same steps.** The update ratios are measured
  a group of layers per phase (``Round.phase``: the monitor passes it to
  ``sample_before`` and ``ratios``), and the activation hooks a group of
  modules per phase (agent/activations.py), so a sample's whole cost is
  spread over its phases instead of landing on its first step.

Nothing here reads a device value on the host. Views onto the parameters are
made anew on each use: a loop (or FSDP) may swap a parameter's storage.

Example::

    >>> import torch
    >>> from gradwatch.agent.gradients import GradReader
    >>> from gradwatch.agent.weightstats import WeightStats
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> ws = WeightStats(GradReader.attach(model, opt))
    >>> ws.phases, ws.sample_elements  # tiny: one phase, sampled whole
    (1, 10)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradwatch.agent.gradients import GradReader, local
from gradwatch.agent.layout import fill_missing
from gradwatch.agent.updateratios import NARROW, SAMPLE, RatioSampler, flat_view, weights_of

# A round reads the weights over at most this many steps.
MAX_PHASES = 8
# Below this many elements per phase the per-step Python cost outweighs the read saved.
MIN_PHASE_ELEMENTS = 1 << 17


@dataclass
class Round:
    """One cadence sample, measured over its phases: what it has gathered so far."""

    step: int
    time: float
    columns: tuple[str, ...]
    left: int  # phases still to read before its norms are complete
    n_acts: int = 0  # its first columns are activation statistics (agent/activations.py)
    ratios: torch.Tensor | None = None  # per-layer update ratios, filled a group per phase
    spread: bool = False  # measured a group per phase (else whole on its first step)
    acts: torch.Tensor | None = None  # the activation statistics, once taken
    phase: int = 0  # phases read so far: the group the next step measures
    norms: torch.Tensor | None = None  # the per-layer weight norms, once complete


class WeightStats:
    """The sampling and phase plan of one model's trainable parameters (training thread)."""

    def __init__(
        self,
        reader: GradReader,
        sample: int = SAMPLE,
        max_phases: int = MAX_PHASES,
        min_phase_elements: int = MIN_PHASE_ELEMENTS,
        seed: int = 0,
    ) -> None:
        self._reader = reader
        self._device = reader.device
        weights = weights_of(reader)
        self._plan_phases(weights, max_phases, min_phase_elements)
        # The update ratios, in as many groups as there are phases.
        self.ratio = RatioSampler(reader, sample, groups=self.phases, seed=seed)
        self.sample_elements = self.ratio.sample_elements
        self._n_layers = len(weights)
        # float32/16 weights on the reader's device, not sharded: a phase's slices are
        # one strided view each and one fused norm (dtype or device changes make a
        # new WeightStats, agent/recovery.py).
        self._plain = not (reader.sharded or reader.multi_device) and all(
            w.dtype in NARROW and w.device == self._device for w in weights
        )
        # The latest norm of each slice (read in rotation) and the samples waiting on them.
        self._partials = torch.zeros(self._n_slices, dtype=torch.float32, device=self._device)
        self._partial_views = [self._partials[a:b] for a, b in self._bounds]
        self._next_phase = 0
        # The samples waiting for their weight norms (the monitor tests it on every
        # step: an attribute, not the ``busy`` property, whose call costs more there).
        self.waiting: list[Round] = []

    # ------------------------------------------------------------ plan

    def _plan_phases(self, weights: list[torch.Tensor], max_phases: int, minimum: int) -> None:
        total = sum(w.numel() for w in weights)
        self.phases = max(1, min(max_phases, math.ceil(total / minimum)))
        target = math.ceil(total / self.phases) if total else 1
        # Each phase: (param index, start, stop) slices; stop None = the whole tensor.
        plan: list[list[tuple[int, int, int | None]]] = [[]]
        room = target
        for i, w in enumerate(weights):
            n = w.numel()
            if flat_view(w) is None:
                plan[-1].append((i, 0, None))
                room -= n
            else:
                start = 0
                while n - start > room and len(plan) < self.phases:
                    if room > 0:
                        plan[-1].append((i, start, start + room))
                        start += room
                    plan.append([])
                    room = target
                plan[-1].append((i, start, n))
                room -= n - start
        self._plan = [p for p in plan if p]
        self.phases = len(self._plan)
        layer_of = [i for phase in self._plan for i, _, _ in phase]
        self._slice_layer = torch.tensor(layer_of, dtype=torch.long, device=self._device)
        self._n_slices = len(layer_of)
        bounds, at = [], 0
        for phase in self._plan:
            bounds.append((at, at + len(phase)))
            at += len(phase)
        self._bounds = bounds
        self.largest_phase = max(
            (
                sum((b if b is not None else weights[i].numel()) - a for i, a, b in p)
                for p in self._plan
            ),
            default=0,
        )

    # ------------------------------------------------------------ update ratios

    def sample_before(self, keep_views: bool = True, group: int | None = None) -> None:
        """Gather ``group``'s update-ratio samples (None: all) before the update;
        see ``RatioSampler.sample_before``."""
        self.ratio.sample_before(group, keep_views)

    def ratios(self, group: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``group``'s update ratios (None: all) after the update; see
        ``RatioSampler.ratios``."""
        return self.ratio.ratios(group, out)

    def drop(self) -> None:
        """Forget a pending before-sample and the waiting samples (switching off)."""
        self.ratio.drop()
        self.waiting = []

    # ------------------------------------------------------------ weight norms

    @property
    def busy(self) -> bool:
        """Samples are waiting for their weight norms: read a phase at each step."""
        return bool(self.waiting)

    def begin(
        self,
        step: int,
        time: float,
        columns: tuple[str, ...],
        n_acts: int,
        ratios: bool,
        spread: bool = False,
    ) -> Round:
        """Queue a cadence step's sample; ``advance`` then reads a phase per step.

        Phases are read in rotation into one vector of slice norms that every
        waiting sample shares: a sample is complete once a full rotation has
        been read since its step, so samples closer together than ``phases``
        steps share reads, and no step reads more than one phase. ``ratios``:
        the sample carries update ratios (its ``ratios`` vector, MISSING until a
        group's are measured); ``spread``: they and the activations are measured
        a group per phase (the monitor starts no other sample until it is complete).
        """
        vector = None
        if ratios:
            vector = torch.empty(self._n_layers, dtype=torch.float32, device=self._device)
            fill_missing(vector)
        started = Round(step, time, columns, self.phases, n_acts, vector, spread)
        self.waiting.append(started)
        return started

    def advance(self) -> list[Round]:
        """Read the next phase if a sample waits; return the samples it completes."""
        if not self.waiting:
            return []
        with torch.no_grad():
            self._read_phase(self._next_phase)
        self._next_phase = (self._next_phase + 1) % self.phases
        for waiting in self.waiting:
            waiting.left -= 1
            waiting.phase += 1
        return self._complete()

    def finish(self) -> list[Round]:
        """Complete every waiting sample now (closing): one full rotation at once."""
        if not self.waiting:
            return []
        with torch.no_grad():
            for phase in range(self.phases):
                self._read_phase(phase)
        for waiting in self.waiting:
            waiting.left = 0
        return self._complete()

    def _complete(self) -> list[Round]:
        done = [w for w in self.waiting if w.left <= 0]
        if not done:
            return []
        self.waiting = [w for w in self.waiting if w.left > 0]
        with torch.no_grad():
            norms = torch.zeros(self._n_layers, dtype=torch.float32, device=self._device)
            norms.index_add_(0, self._slice_layer, self._partials.square())
            norms.sqrt_()
        for sample in done:
            sample.norms = norms
        return done

    def _read_phase(self, phase: int) -> None:
        params = self._reader.params
        norms: Sequence[torch.Tensor]
        if self._plain:
            # Each call on a cold cache costs microseconds: one view per slice.
            views: list[torch.Tensor] = []
            for i, start, stop in self._plan[phase]:
                param = params[i]
                if stop is None:
                    views.append(param)
                elif param.is_contiguous():
                    views.append(
                        param.as_strided((stop - start,), (1,), param.storage_offset() + start)
                    )
                else:
                    break  # channels_last: the general path below
            else:
                norms = torch._foreach_norm(views, 2, dtype=torch.float32)
                torch.stack(norms, out=self._partial_views[phase])
                return
        slices = []
        for i, start, stop in self._plan[phase]:
            w: torch.Tensor = params[i]
            if self._reader.sharded:
                w = local(w)
            flat = None if stop is None else flat_view(w)
            # The plan cuts only tensors that have a flat view (_plan_phases).
            slices.append(w if flat is None else flat[start:stop])
        if any(t.dtype not in NARROW or t.device != self._device for t in slices):
            # float64, or model parallel: normed in their own precision and place,
            # then cast and moved: still no sync.
            norms = [
                torch.linalg.vector_norm(t).to(self._device, torch.float32, non_blocking=True)
                for t in slices
            ]
        else:
            norms = torch._foreach_norm(slices, 2, dtype=torch.float32)
        torch.stack(norms, out=self._partial_views[phase])
