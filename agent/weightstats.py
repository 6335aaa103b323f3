"""Cadence weight statistics at a bounded cost per step and in memory.

Two statistics ride on a cadence sample, and both used to cost a whole model
at once on one step: the weight norms (one read of every parameter) and the
update ratios ``||dw|| / ||w||`` (a transient copy of every trainable
parameter: ~14 GB for a 7B bf16 model, on every rank under DDP).

* **Update ratios from a fixed sample.** At attach, each parameter gets a
  fixed strided sample of 1/64 of its elements, at least 1,024 and at most
  ``SAMPLE`` (4,096) (stride coprime to its
  last dimension, so a sample walks across rows and columns; a random but
  seeded offset). The optimizer step pre-hook of a cadence step gathers the
  samples into one preallocated buffer (one ``cat``), ``log()`` gathers them
  again after the update, and the ratio is ``||after - before|| / ||after||``
  over the sample: an estimate of the exact ratio whose error shrinks as
  ``1/sqrt(SAMPLE)`` for updates spread over the tensor (tests/agent/
  test_agent_cost.py measures it). Extra memory: two buffers of at most
  ``SAMPLE`` elements per tensor, whatever the model's size (3.1% of any tensor
  of 64k elements or more). A tensor of 1,024 elements or fewer is sampled
  whole, so its ratio is exact.
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
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradwatch.agent.gradients import GradReader, local
from gradwatch.agent.layout import MISSING_I32, fill_missing

# Elements sampled per parameter for its update ratio (see the module docstring):
# 1/SAMPLE_SHARE of it, at least MIN_SAMPLE (smaller tensors whole) and at most SAMPLE.
SAMPLE = 4096
MIN_SAMPLE = 1024
SAMPLE_SHARE = 64
# A round reads the weights over at most this many steps.
MAX_PHASES = 8
# Below this many elements per phase the per-step Python cost outweighs the read saved.
MIN_PHASE_ELEMENTS = 1 << 17
# Update ratios divide by max(||w||, this): an all-zero parameter does not give NaN.
_TINY = 1e-30
_NARROW = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass
class Round:
    """One cadence sample waiting for its weight norms: what was measured at its step."""

    step: int
    time: float
    columns: tuple[str, ...]
    parts: list[torch.Tensor]
    left: int  # phases still to read before its norms are complete
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
        weights = self._weights()
        rng = random.Random(seed)
        # Per parameter: (offset, stride, count) of its sample, or None (no flat view).
        self._samples: list[tuple[int, int, int] | None] = []
        counts: list[int] = []
        for w in weights:
            spec = _sample_spec(w, sample, rng) if _flat(w) is not None else None
            if spec is None and w.numel() > sample:
                counts.append(0)  # an unusual memory layout: no ratio (MISSING), no copy
            else:
                spec = spec or (0, 1, w.numel())
                counts.append(spec[2])
            self._samples.append(spec if counts[-1] else None)
        self._counts = counts
        self.sample_elements = sum(counts)
        self._unsampled = torch.tensor(
            [
                i
                for i, (w, c) in enumerate(zip(weights, counts, strict=True))
                if c == 0 and w.numel()
            ],
            dtype=torch.long,
            device=self._device,
        )
        dtypes = {w.dtype for w in weights}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self._before = torch.empty(self.sample_elements, dtype=dtype, device=self._device)
        self._after = torch.empty_like(self._before)
        # Each layer's part of both buffers, cut once: one fused norm reads them all.
        self._parts = [*self._before.split(counts), *self._after.split(counts)]
        self._any_unsampled = bool(self._unsampled.numel())
        self._have_before = False
        # The strided views of the pre-hook's gather and the parameters' data pointers then:
        # read again by the after-gather of the same step (views cost ~3 us each to make),
        # then dropped: held only across the optimizer step, never a forward pass.
        self._views: list[torch.Tensor] | None = None
        self._pointers: list[int] = []
        self._plan_phases(weights, max_phases, min_phase_elements)
        # float32/16 weights on the reader's device, not sharded: a phase's slices are
        # one strided view each and one fused norm (dtype or device changes make a
        # new WeightStats, agent/recovery.py).
        self._plain = not (reader.sharded or reader.multi_device) and all(
            w.dtype in _NARROW and w.device == self._device for w in weights
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
            if _flat(w) is None:
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

    def sample_before(self, keep_views: bool = True) -> None:
        """Gather each parameter's sample before the optimizer updates it (pre-hook).

        ``keep_views``: keep the gather's views for the after-update gather. Only when
        that comes within the same step (the optimizer's pre-hook, then ``log()``): a
        hand-written update (no optimizer) samples at the end of one ``log()`` and
        after the next, and views held that long would keep storage the loop replaced
        (``p.data = p.data - lr * p.grad``) alive through a forward and backward pass.
        """
        with torch.no_grad():
            views = self._gather(self._before)
        self._views = views if keep_views else None
        if self._views is not None:
            self._pointers = [p.data_ptr() for p in self._reader.params]
        self._have_before = True

    def ratios(self) -> torch.Tensor:
        """Per-layer update ratio over the samples (after the update); MISSING without a
        ``sample_before`` since the last call (the optimizer step was skipped)."""
        n = len(self._counts)
        out = torch.empty(n, dtype=torch.float32, device=self._device)
        if not self._have_before:
            fill_missing(out)
            return out
        self._have_before = False
        views, self._views = self._views, None
        with torch.no_grad():
            if views is not None and [p.data_ptr() for p in self._reader.params] == self._pointers:
                torch.cat(views, out=self._after)  # the same elements, after the update
            else:
                # No views kept, or a parameter got new storage during the step (an
                # update written as p.data = ..., a cast): gather from the parameters now.
                self._gather(self._after)
            self._before.sub_(self._after)
            # float64 weights (model.double()) cannot be normed into float32 directly:
            # norm in their own dtype, then narrow the per-layer results.
            dtype = torch.float32 if self._before.dtype in _NARROW else None
            # ||moved|| of every layer, then ||after||: one fused read of both buffers.
            both = torch.stack(torch._foreach_norm(self._parts, 2, dtype=dtype))
            torch.div(both[:n], both[n:].clamp_min_(_TINY), out=out)
            if self._any_unsampled:
                out.view(torch.int32).index_fill_(0, self._unsampled, MISSING_I32)
        return out

    def drop(self) -> None:
        """Forget a pending before-sample and the waiting samples (switching off)."""
        self._have_before = False
        self._views = None
        self.waiting = []

    def _gather(self, into: torch.Tensor) -> list[torch.Tensor] | None:
        """Gather every sample into ``into`` (one ``cat``); called under ``no_grad``.

        Returns the views read when they are plain strided views of the parameters
        (the usual case), which a second gather of the same step may reuse."""
        reader = self._reader
        if not (reader.sharded or reader.multi_device):
            # One strided view per parameter, made anew (the storage may have been
            # swapped) but in one call: on a cold cache each call costs microseconds.
            views = []
            for param, spec in zip(reader.params, self._samples, strict=True):
                if spec is None:
                    continue
                if not param.is_contiguous():
                    break  # channels_last and the like: the general path below
                offset, stride, count = spec
                views.append(param.as_strided((count,), (stride,), param.storage_offset() + offset))
            else:
                if views:
                    torch.cat(views, out=into)
                return views
        views = []
        for w, spec in zip(self._weights(), self._samples, strict=True):
            if spec is None:
                continue
            offset, stride, count = spec
            flat = _flat(w)
            view = w if flat is None else flat[offset::stride][:count]
            if view.device != self._device:
                view = view.to(self._device, non_blocking=True)
            views.append(view)
        if views:
            torch.cat(views, out=into)
        return None

    # ------------------------------------------------------------ weight norms

    @property
    def busy(self) -> bool:
        """Samples are waiting for their weight norms: read a phase at each step."""
        return bool(self.waiting)

    def begin(
        self, step: int, time: float, columns: tuple[str, ...], parts: list[torch.Tensor]
    ) -> list[Round]:
        """Queue a cadence step's sample and read one phase; return the samples complete now.

        Phases are read in rotation into one vector of slice norms that every
        waiting sample shares: a sample is complete once a full rotation has
        been read since its step. Samples closer together than ``phases`` steps
        (the dense early cadence) thus share reads, and no step reads more than
        one phase.
        """
        self.waiting.append(Round(step, time, columns, parts, self.phases))
        return self.advance()

    def advance(self) -> list[Round]:
        """Read the next phase if a sample waits; return the samples it completes."""
        if not self.waiting:
            return []
        with torch.no_grad():
            self._read_phase(self._next_phase)
        self._next_phase = (self._next_phase + 1) % self.phases
        for waiting in self.waiting:
            waiting.left -= 1
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
            norms = torch.zeros(len(self._counts), dtype=torch.float32, device=self._device)
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
            flat = None if stop is None else _flat(w)
            # The plan cuts only tensors that have a flat view (_plan_phases).
            slices.append(w if flat is None else flat[start:stop])
        if any(t.dtype not in _NARROW or t.device != self._device for t in slices):
            # float64, or model parallel: normed in their own precision and place,
            # then cast and moved: still no sync.
            norms = [
                torch.linalg.vector_norm(t).to(self._device, torch.float32, non_blocking=True)
                for t in slices
            ]
        else:
            norms = torch._foreach_norm(slices, 2, dtype=torch.float32)
        torch.stack(norms, out=self._partial_views[phase])

    def _weights(self) -> list[torch.Tensor]:
        return [local(p).detach() for p in self._reader.params]


def _flat(w: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``w``'s elements in memory order, or None when it has none."""
    if w.is_contiguous():
        return w.view(-1)
    if w.dim() == 4 and w.is_contiguous(memory_format=torch.channels_last):
        return w.permute(0, 2, 3, 1).reshape(-1)  # a view: that order is contiguous
    return None


def _sample_spec(w: torch.Tensor, sample: int, rng: random.Random) -> tuple[int, int, int]:
    """(offset, stride, count) of a strided sample: a 1/SAMPLE_SHARE share of ``w``,
    at least MIN_SAMPLE elements (fewer: the whole tensor) and at most ``sample``."""
    n = w.numel()
    sample = min(sample, max(MIN_SAMPLE, n // SAMPLE_SHARE))
    if n <= sample:
        return 0, 1, n
    stride = n // sample
    row = w.shape[-1] if w.dim() > 1 else 1
    while math.gcd(stride, row) > 1:
        stride += 1  # coprime to the row length: the sample visits every column
    offset = rng.randrange(stride)
    count = min(sample, (n - 1 - offset) // stride + 1)
    return offset, stride, count
