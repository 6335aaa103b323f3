"""Cadence weight statistics at a bounded cost per step and in memory.

Two statistics ride on a cadence sample, and both used to cost a whole model
at once on one step: the weight norms (one read of every parameter) and the
update ratios ``||dw|| / ||w||`` (a transient copy of every trainable
parameter: ~14 GB for a 7B bf16 model, on every rank under DDP).

* **Update ratios from a fixed sample** (agent/updateratios.py): at most
  ``SAMPLE`` elements per tensor, whatever the model's size.
* **Weight norms spread over steps.** The parameters' flattened element space
  is cut into ``slices`` (at most ``MAX_SLICES``, of at least
  ``MIN_SLICE_ELEMENTS``) of about equal size, cutting through tensors, and
  the slices into at most ``MAX_PHASES`` phases of ``per_phase`` slices. While
  a sample measured whole waits, a phase is read per step, in rotation, and
  it ships once a full rotation was read since its step; a spread sample reads
  one slice on each of the steps its plan gives (agent/spreadplan.py). The
  per-layer norm is the root of the summed squared partial norms, so the
  norms of a large model mix the weights of the steps a rotation took: off by
  at most what those updates moved them (an update ratio of ~1e-3 per step),
  while no step pays more than a phase of a full read. A model under
  ``MIN_PHASE_ELEMENTS`` per phase is read in one step, exactly.
* **The rest of a sample on other steps.** A spread sample gathers the update
  ratios a group of layers per step and hooks a group of activation modules
  per step (agent/sampling.py drives it), so its whole cost is spread instead
  of landing on its first step.

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
from gradwatch.agent.hostpart import HostPart
from gradwatch.agent.spreadplan import Part
from gradwatch.agent.updateratios import (
    NARROW,
    SAMPLE,
    RatioSampler,
    Span,
    flat_view,
    weights_of,
)
from gradwatch.wire.census import Census

# A round reads the weights over at most this many steps.
MAX_PHASES = 8
# Below this many elements per phase the per-step Python cost outweighs the read saved.
MIN_PHASE_ELEMENTS = 1 << 17
# A spread sample reads them in finer slices, one per step: each phase is cut into
# slices of at least MIN_SLICE_ELEMENTS, MAX_SLICES in all. On the GPT benchmark, in
# its loop, a phase (463k elements) took 0.24-0.26 ms of thread CPU and a slice takes
# 0.22-0.23 ms (benchmarks/agent_calls.py): most of either is fixed cost on the cold
# cache a backward pass leaves, so slices finer than 16 would add steps, not save time.
MAX_SLICES = 16
MIN_SLICE_ELEMENTS = 1 << 16


@dataclass
class Round:
    """One cadence sample, measured over its phases: what it has gathered so far."""

    step: int
    time: float
    columns: tuple[str, ...]
    left: int  # slices still to read before its norms are complete
    n_acts: int = 0  # its first columns are activation statistics (agent/activations.py)
    ratios: bool = False  # it carries update ratios
    spread: bool = False  # measured a part per step (else whole on its first step)
    # Its activation statistics and update ratios, once taken: device vectors (measured
    # whole) or host copies the shipper works out (spread, agent/hostpart.py).
    acts: torch.Tensor | HostPart | None = None
    ratio_values: torch.Tensor | HostPart | None = None
    phase: int = 0  # steps since it began: the part the next step measures, when spread
    norms: torch.Tensor | None = None  # the per-layer weight norms, once complete
    parts: tuple[Part, ...] = ()  # a spread sample's steps (agent/spreadplan.py)
    # The model census at its step (contract C2), not when it ships: a sample cut short
    # by close() ships after the loop's last evaluation, with the model in eval mode.
    census: Census | None = None


class WeightStats:
    """The sampling and phase plan of one model's trainable parameters (training thread)."""

    def __init__(
        self,
        reader: GradReader,
        sample: int = SAMPLE,
        max_phases: int = MAX_PHASES,
        min_phase_elements: int = MIN_PHASE_ELEMENTS,
        seed: int = 0,
        max_slices: int = MAX_SLICES,
    ) -> None:
        self._reader = reader
        self._device = reader.device
        weights = weights_of(reader)
        self._plan_phases(weights, max_phases, min_phase_elements, max_slices)
        # The update ratios, in groups of about GROUP_ELEMENTS sampled elements.
        self.ratio = RatioSampler(reader, sample, groups=None, seed=seed)
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
        self._next_slice = 0
        self._runs: dict[tuple[int, int], tuple[list[tuple[int, int, int | None]], torch.Tensor]]
        self._runs = {}
        # The samples waiting for their weight norms (the monitor tests it on every
        # step: an attribute, not the ``busy`` property, whose call costs more there).
        self.waiting: list[Round] = []
        # The weights the run started from (read_initial), for the first sample.
        self._initial: torch.Tensor | None = None
        self.started = False  # a sample has begun

    # ------------------------------------------------------------ plan

    def _plan_phases(
        self, weights: list[torch.Tensor], max_phases: int, minimum: int, max_slices: int
    ) -> None:
        """Cut the elements into ``slices`` of about equal size, ``per_phase`` to a phase."""
        total = sum(w.numel() for w in weights)
        self.phases = max(1, min(max_phases, math.ceil(total / minimum)))
        fine = min(max_slices, math.ceil(total / MIN_SLICE_ELEMENTS))
        self.per_phase = max(1, fine // self.phases)
        count = self.phases * self.per_phase
        target = math.ceil(total / count) if total else 1
        # Each slice: (param index, start, stop) pieces; stop None = the whole tensor.
        plan: list[list[tuple[int, int, int | None]]] = [[]]
        room = target
        for i, w in enumerate(weights):
            n = w.numel()
            if flat_view(w) is None:
                plan[-1].append((i, 0, None))
                room -= n
            else:
                start = 0
                while n - start > room and len(plan) < count:
                    if room > 0:
                        plan[-1].append((i, start, start + room))
                        start += room
                    plan.append([])
                    room = target
                plan[-1].append((i, start, n))
                room -= n - start
        self._plan = [p for p in plan if p]
        self.slices = len(self._plan)
        if self.slices < count:  # tensors that cannot be cut: fewer slices
            self.per_phase = max(1, self.slices // self.phases)
            self.phases = -(-self.slices // self.per_phase)
        layer_of = [i for piece in self._plan for i, _, _ in piece]
        self._slice_layer = torch.tensor(layer_of, dtype=torch.long, device=self._device)
        self._n_slices = len(layer_of)
        bounds, at = [], 0
        for piece in self._plan:
            bounds.append((at, at + len(piece)))
            at += len(piece)
        self._bounds = bounds
        sizes = [
            sum((b if b is not None else weights[i].numel()) - a for i, a, b in piece)
            for piece in self._plan
        ]
        self.largest_phase = max(
            (sum(sizes[k : k + self.per_phase]) for k in range(0, len(sizes), self.per_phase)),
            default=0,
        )

    # ------------------------------------------------------------ update ratios

    def sample_before(self, keep_views: bool = True, group: Span = None) -> None:
        """Gather ``group``'s update-ratio samples (None: all) before the update;
        see ``RatioSampler.sample_before``."""
        self.ratio.sample_before(group, keep_views)

    def prepare(self, parts: tuple[Part, ...]) -> None:
        """Make now, not on a training step, the views a plan's parts will use: its
        ratio groups' spans and the single-slice reads (each ~0.1 ms on a cold cache)."""
        for part in parts:
            if part.ratios is not None:
                self.ratio.layers_of(part.ratios)
        for first in range(self.slices):
            self._run(first, 1)

    def after(self, group: Span = None) -> None:
        """Gather ``group``'s ratio samples after the update; see ``RatioSampler.after``."""
        self.ratio.after(group)

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
        parts: tuple[Part, ...] = (),
    ) -> Round:
        """Queue a cadence step's sample; ``advance`` then reads its weight norms.

        Phases are read in rotation into one vector of slice norms that every
        waiting sample shares: a sample's norms are complete once a full rotation
        has been read since its step, so samples closer together than ``phases``
        steps share reads. ``ratios``: the sample carries update ratios (its
        ``ratio_values``, once taken). ``parts``: it is
        spread over those steps (agent/spreadplan.py; the monitor starts no other
        sample until it is shipped), and leaves ``waiting`` by ``take``, not by
        ``advance``; else it is measured whole on its step and its weight norms
        read a phase per step.
        """
        started = Round(step, time, columns, self.slices, n_acts, ratios, bool(parts))
        started.parts = parts
        if self._initial is not None:  # the first sample: the weights before any update
            started.norms, started.left, self._initial = self._initial, 0, None
        self.started = True
        self.waiting.append(started)
        return started

    def read_initial(self) -> None:
        """Read every slice now, before the first update: the first sample carries these
        norms, the weights the run started from, so growth from the init is seen (Adam at a
        learning rate 100x too high moved a BatchNorm CNN's weights x2.4 in its first
        update: minDiffusion, benchmarks/ddpm_trial.py). One full read, once."""
        self._read(self.slices)
        with torch.no_grad():
            self._initial = self._norms()

    def advance(self, reads: int = 0) -> list[Round]:
        """Read ``reads`` slices, at least a phase's while a sample measured whole
        waits; return the whole samples this completes (a spread one's norms are set)."""
        if not self.waiting:
            return []
        if reads < self.per_phase and any(not w.spread for w in self.waiting):
            reads = self.per_phase
        if not reads:
            return []
        self._read(reads)
        return self._complete()

    def take(self, sample: Round) -> Round:
        """Remove a spread ``sample`` from ``waiting``, its weight norms complete (the
        slices it still lacks read now: only where its parts were cut short)."""
        if sample.left > 0 or sample.norms is None:
            self._read(max(0, sample.left))
            with torch.no_grad():
                sample.norms = self._norms()
        self.waiting = [w for w in self.waiting if w is not sample]
        return sample

    def finish(self) -> list[Round]:
        """Complete every waiting sample now (closing): one full rotation at once."""
        if not self.waiting:
            return []
        for waiting in self.waiting:
            if waiting.spread and waiting.ratios and waiting.ratio_values is None:
                waiting.ratio_values = self.ratio.compute()  # the groups gathered so far
            waiting.spread, waiting.norms = False, None  # returned below, parts left or not
        self._read(self.slices)
        return self._complete()

    def _read(self, count: int) -> None:
        """Read the next ``count`` slices of the rotation (consecutive ones in one call)."""
        with torch.no_grad():
            left = count
            while left > 0:
                n = min(left, self.slices - self._next_slice)
                self._read_slices(self._next_slice, n)
                self._next_slice = (self._next_slice + n) % self.slices
                left -= n
        for waiting in self.waiting:
            waiting.left -= count

    def _complete(self) -> list[Round]:
        """Set the norms of the samples a full rotation has completed; remove and return
        those measured whole (a spread sample leaves by ``take``)."""
        done = [w for w in self.waiting if w.left <= 0 and w.norms is None]
        if done:
            with torch.no_grad():
                norms = self._norms()
            for sample in done:
                sample.norms = norms
        # Also a first sample, complete since it began (read_initial).
        whole = [w for w in self.waiting if not w.spread and w.norms is not None]
        if whole:
            self.waiting = [w for w in self.waiting if w.spread or w.norms is None]
        return whole

    def _norms(self) -> torch.Tensor:
        """Each layer's weight norm: the root of its slices' summed squares (no_grad)."""
        norms = torch.zeros(self._n_layers, dtype=torch.float32, device=self._device)
        norms.index_add_(0, self._slice_layer, self._partials.square())
        return norms.sqrt_()

    def _run(self, first: int, n: int) -> tuple[list[tuple[int, int, int | None]], torch.Tensor]:
        """Slices [first, first + n): their pieces and the partials they fill, made once
        per run (each costs microseconds on a cold cache); a run is a slice or a phase."""
        run = self._runs.get((first, n))
        if run is None:
            pieces = [piece for part in self._plan[first : first + n] for piece in part]
            into = self._partials[self._bounds[first][0] : self._bounds[first + n - 1][1]]
            run = self._runs[first, n] = (pieces, into)
        return run

    def _read_slices(self, first: int, n: int) -> None:
        """The norms of slices [first, first + n) into their partials (no_grad)."""
        params = self._reader.params
        pieces, into = self._run(first, n)
        norms: Sequence[torch.Tensor]
        if self._plain:
            # Each call on a cold cache costs microseconds: one view per slice.
            views: list[torch.Tensor] = []
            for i, start, stop in pieces:
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
                torch.stack(norms, out=into)
                return
        slices = []
        for i, start, stop in pieces:
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
        torch.stack(norms, out=into)
