"""Update ratios ``||dw|| / ||w||`` from a fixed sample of each parameter, a group per step.

At attach, each parameter gets a fixed strided sample of 1/64 of its elements,
at least 1,024 and at most ``SAMPLE`` (4,096) (stride coprime to its last
dimension, so a sample walks across rows and columns; a random but seeded
offset). Before the optimizer updates the parameters the samples are gathered
into one preallocated buffer (one ``cat``), after it again, and the ratio is
``||after - before|| / ||after||`` over the sample: an estimate of the exact
ratio whose error shrinks as ``1/sqrt(SAMPLE)`` for updates spread over the
tensor (tests/agent/test_agent_cost.py measures it). Extra memory: two buffers
of at most ``SAMPLE`` elements per tensor, whatever the model's size (3.1% of
any tensor of 64k elements or more). A tensor of 1,024 elements or fewer is
sampled whole, so its ratio is exact.

The parameters are cut into ``groups`` consecutive runs of about equal sample
size (``GROUP_ELEMENTS``), so a spread cadence sample can gather one group per
step (agent/spreadplan.py): no step pays the gathers of the whole model. A
group's ratio is still one step's update, before and after. The training
thread only gathers: ``export`` queues a host copy of both buffers and the
shipper thread works the ratios out (``RatioCopy.values``, agent/hostpart.py).

Nothing here reads a device value on the host on the training thread.

Example::

    >>> import torch
    >>> from gradwatch.agent.gradients import GradReader
    >>> from gradwatch.agent.updateratios import RatioSampler
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> rs = RatioSampler(GradReader.attach(model, opt), groups=2)
    >>> rs.sample_elements, rs.layers_of(0), rs.layers_of(1)  # tiny: sampled whole
    (10, (0, 1), (1, 2))
"""

from __future__ import annotations

import math
import random

import torch

from gradwatch.agent.gradients import GradReader, local
from gradwatch.agent.hostpart import HostCopy, host_copy
from gradwatch.agent.layout import MISSING_I32

# Elements sampled per parameter (see the module docstring): 1/SAMPLE_SHARE of it,
# at least MIN_SAMPLE (smaller tensors whole) and at most SAMPLE.
SAMPLE = 4096
MIN_SAMPLE = 1024
SAMPLE_SHARE = 64
# Layer groups (a spread sample gathers one or a few per step, agent/spreadplan.py):
# about this many sampled elements each, at most MAX_GROUPS. In the GPT benchmark's
# loop a unit of two such groups gathers in ~160 us before the update and ~125 us
# after it (benchmarks/agent_calls.py); an eighth of its samples, the unit before
# 2026-12-05, took ~190 us and ~260 us with the arithmetic.
GROUP_ELEMENTS = 2048
MAX_GROUPS = 32
# Ratios divide by max(||w||, this): an all-zero parameter does not give NaN.
_TINY = 1e-30
# A layer without a gradient in a sampled step that had one in one of its last 5 samples
# is skipped, not frozen (RatioSampler._lost_gradients). LayerDrop runs at p 0.1-0.2
# (wav2vec2's default 0.1, fairseq's recipes up to 0.2); LayersFrozen wants 2 samples of
# 0 in a row, i.e. 7 samples without a gradient: at p 0.2, 1.3e-5 of a block's samples,
# while a layer never used reads 0 from its 6th sample (step 6 of the dense start).
SKIPPED_SAMPLES = 5
NARROW = frozenset({torch.float32, torch.float16, torch.bfloat16})
# A group of layers (int), a run [a, b) of consecutive groups, or None: every layer.
Span = int | tuple[int, int] | None


class RatioSampler:
    """The fixed samples of one model's trainable parameters and their groups (training
    thread): ``sample_before(group)`` before the update, ``after(group)`` after it,
    ``export()`` once a sample's groups are gathered."""

    def __init__(
        self, reader: GradReader, sample: int = SAMPLE, groups: int | None = 1, seed: int = 0
    ) -> None:
        self._reader = reader
        self._device = reader.device
        weights = weights_of(reader)
        rng = random.Random(seed)
        # Per parameter: (offset, stride, count) of its sample, or None (no flat view).
        self._samples: list[tuple[int, int, int] | None] = []
        counts: list[int] = []
        for w in weights:
            spec = _sample_spec(w, sample, rng) if flat_view(w) is not None else None
            if spec is None and w.numel() > sample:
                counts.append(0)  # an unusual memory layout: no ratio (MISSING), no copy
            else:
                spec = spec or (0, 1, w.numel())
                counts.append(spec[2])
            self._samples.append(spec if counts[-1] else None)
        self._counts = counts
        self.sample_elements = sum(counts)
        # MISSING for tensors that have elements but no sample (unusual layouts).
        self._unsampled = [
            i for i, (w, c) in enumerate(zip(weights, counts, strict=True)) if not c and w.numel()
        ]
        dtypes = {w.dtype for w in weights}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        # Before and after the update, in one buffer: export() copies it in one call.
        self._pair = torch.empty(2, self.sample_elements, dtype=dtype, device=self._device)
        self._before, self._after = self._pair[0], self._pair[1]
        # The groups' layer runs; a run of consecutive groups (a span, one group, or
        # every layer: None) is cut once into the views its calls use (each view made
        # per call costs microseconds), when first used.
        self._plain = not (reader.sharded or reader.multi_device)
        if groups is None:  # sized by sample: see GROUP_ELEMENTS
            groups = min(MAX_GROUPS, len(counts), -(-self.sample_elements // GROUP_ELEMENTS))
        self._cuts = _cut(counts, max(1, groups))
        self._spans: dict[tuple[int, int], _Group] = {}
        for g in range(len(self._cuts)):  # each ~0.1 ms to make: not on a training step
            self._span(g)
        self._span(None)
        self._have_before: _Group | None = None  # the group sampled before the update
        # Layers of the group sampled before the update that had no gradient then but had
        # one in the last SKIPPED_SAMPLES samples, and of those gathered after it since the
        # last export(): the optimizer skips a parameter without a gradient, so a layer
        # skipped now and then (a block LayerDrop left out, an MoE expert no token
        # reached) reads as one that never moves: MISSING, not 0. A layer with none for
        # longer (never used in the forward, or cut off from the loss) keeps its 0.
        self._no_grad: list[int] = []
        self._skipped: list[int] = []
        # Per layer, how many samples of it in a row had no gradient. A layer never used
        # reads 0 from its 6th sample on (a LayerDrop block skipped on the first samples
        # of a run is no different from one skipped later).
        self._without = [0] * len(counts)
        # The layer runs gathered after their update since the last export().
        self._gathered: list[tuple[int, int]] = []
        # The strided views of the before-gather and the parameters' data pointers then:
        # read again by the after-gather of the same step (views cost ~3 us each to make),
        # then dropped: held only across the optimizer step, never a forward pass.
        self._views: list[torch.Tensor] | None = None
        self._pointers: list[int] = []

    @property
    def groups(self) -> int:
        return len(self._cuts)

    def layers_of(self, group: Span) -> tuple[int, int]:
        """The [first, stop) layer indices of ``group`` (None: every layer)."""
        g = self._span(group)
        return g.first, g.stop

    def _span(self, group: Span) -> _Group:
        """The layers of ``group``: one group (int), a run [a, b) of groups, or None (all)."""
        if group is None:
            key = (0, len(self._cuts))
        elif isinstance(group, int):
            key = (group, group + 1)
        else:
            key = group
        g = self._spans.get(key)
        if g is None:
            first, stop = self._cuts[key[0]][0], self._cuts[key[1] - 1][1]
            g = self._spans[key] = _Group(
                first,
                stop,
                self._counts,
                self._before,
                self._after,
                self._reader.params,
                self._samples[first:stop],
                self._plain,
            )
        return g

    def sample_before(self, group: Span = None, keep_views: bool = True) -> None:
        """Gather ``group``'s samples (a group, a run [a, b) of groups, or None: every
        layer's) before the optimizer updates them.

        ``keep_views``: keep the gather's views for the after-update gather. Only when
        that comes within the same step (the optimizer's pre-hook, then ``log()``): a
        hand-written update (no optimizer) samples at the end of one ``log()`` and
        after the next, and views held that long would keep storage the loop replaced
        (``p.data = p.data - lr * p.grad``) alive through a forward and backward pass.
        """
        g = self._span(group)
        with torch.no_grad():
            views = self._gather(g.before, g)
        self._views = views if keep_views else None
        if self._views is not None:
            self._pointers = [p.data_ptr() for p in g.params]
        # Only within one step: without an optimizer the update comes after the next
        # backward pass, whose gradients are not these.
        self._no_grad = self._lost_gradients(g) if keep_views else []
        self._have_before = g

    def _lost_gradients(self, g: _Group) -> list[int]:
        """The layers of ``g`` without a gradient now that had one in the last
        ``SKIPPED_SAMPLES`` samples of their group."""
        lost, without = [], self._without
        for i, p in enumerate(g.params, start=g.first):
            if p.grad is not None:
                without[i] = 0
            else:
                without[i] += 1
                if without[i] <= SKIPPED_SAMPLES:
                    lost.append(i)
        return lost

    def ratios(self, group: Span = None) -> torch.Tensor:
        """``after(group)`` then ``compute()``: every layer's ratio now, MISSING outside
        ``group`` or without a ``sample_before(group)`` since the last call."""
        self.after(group)
        return self.compute()

    def compute(self) -> torch.Tensor:
        """The ratios from what ``after`` gathered since the last ``compute``/``export``,
        worked out here on the device (no sync): a sample measured whole, whose
        buffers the next step's sample overwrites."""
        gathered, self._gathered = self._gathered, []
        return ratio_values(self._pair, self._counts, self._unmeasured(), gathered)

    def after(self, group: Span = None) -> None:
        """Gather ``group``'s samples after the update; nothing without a
        ``sample_before(group)`` since the last call (the optimizer step was skipped),
        and its layers stay MISSING."""
        g = self._span(group)
        if g.first != g.stop and self._gather_after(g):
            self._gathered.append((g.first, g.stop))

    def export(self) -> RatioCopy:
        """A host copy of the samples (queued, no sync) and which layers ``after``
        gathered since the last export; the ratios are worked out on the shipper
        thread (``RatioCopy.values``, agent/hostpart.py)."""
        gathered, self._gathered = self._gathered, []
        return RatioCopy(host_copy(self._pair), self._counts, self._unmeasured(), gathered)

    def _unmeasured(self) -> list[int]:
        """The layers with no ratio in what was gathered since the last call: no sample,
        or no gradient in the step whose update was gathered."""
        skipped, self._skipped = self._skipped, []
        return [*self._unsampled, *skipped] if skipped else self._unsampled

    def _gather_after(self, g: _Group) -> bool:
        """Gather ``g``'s samples after the update into its ``after`` buffer; False (nothing
        gathered) without a ``sample_before(g)`` since the last call."""
        if self._have_before is not g:
            return False
        self._have_before = None
        self._skipped += self._no_grad
        views, self._views = self._views, None
        with torch.no_grad():
            if views is not None and [p.data_ptr() for p in g.params] == self._pointers:
                if views:
                    torch.cat(views, out=g.after)  # the same elements, after the update
            else:
                # No views kept, or a parameter got new storage during the step (an
                # update written as p.data = ..., a cast): gather from the parameters now.
                self._gather(g.after, g)
        return True

    def drop(self) -> None:
        """Forget a pending before-sample and what ``after`` gathered (switching off)."""
        self._have_before = None
        self._gathered = []
        self._skipped = []
        self._views = None

    def _gather(self, into: torch.Tensor, g: _Group) -> list[torch.Tensor] | None:
        """Gather group ``g``'s samples into ``into`` (its part of a sample buffer, one
        ``cat``); called under ``no_grad``.

        Returns the views read when they are plain strided views of the parameters
        (the usual case), which a second gather of the same step may reuse."""
        if g.plain:
            # One strided view per parameter, made anew (the storage may have been
            # swapped) but in one call: on a cold cache each call costs microseconds.
            views = []
            for param, spec in zip(g.params, g.samples, strict=True):
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
        for p, spec in zip(g.params, g.samples, strict=True):
            w = local(p).detach()
            if spec is None:
                continue
            offset, stride, count = spec
            flat = flat_view(w)
            view = w if flat is None else flat[offset::stride][:count]
            if view.device != self._device:
                view = view.to(self._device, non_blocking=True)
            views.append(view)
        if views:
            torch.cat(views, out=into)
        return None


class RatioCopy:
    """One sample's update-ratio samples on their way to the host; ``values()`` (the
    shipper thread) works the ratios out there (``ratio_values``)."""

    def __init__(
        self,
        pair: HostCopy,
        counts: list[int],
        unsampled: list[int],
        gathered: list[tuple[int, int]],
    ) -> None:
        self._pair, self._counts = pair, counts
        self._unsampled, self._gathered = unsampled, gathered
        self.width = len(counts)

    def values(self) -> torch.Tensor:
        return ratio_values(self._pair.wait(), self._counts, self._unsampled, self._gathered)


def ratio_values(
    pair: torch.Tensor,
    counts: list[int],
    unsampled: list[int],
    gathered: list[tuple[int, int]],
) -> torch.Tensor:
    """Per layer ``||after - before|| / ||after||`` over its sample (``pair``: before,
    after; ``counts``: each layer's sample length), float32 on ``pair``'s device, no
    sync; MISSING for ``unsampled`` layers and those outside the ``gathered`` runs."""
    with torch.no_grad():
        # A layer at a time (at most SAMPLE elements each): on the shipper thread no
        # operation is large enough to open an OpenMP team (agent/actstats.py).
        after = list(pair[1].split(counts))
        parts = [*torch._foreach_sub(list(pair[0].split(counts)), after), *after]
        if pair.dtype in NARROW:
            norms = torch.stack(torch._foreach_norm(parts, 2, dtype=torch.float32))
        else:  # float64 (model.double()): normed in its own precision, then narrowed
            norms = torch.stack(torch._foreach_norm(parts, 2)).float()
        n = len(counts)
        out = norms[:n] / norms[n:].clamp_min(_TINY)
        measured = [False] * n
        for first, stop in gathered:
            measured[first:stop] = [True] * (stop - first)
        for i in unsampled:
            measured[i] = False
        if not all(measured):
            for i, seen in enumerate(measured):
                if not seen:
                    out[i : i + 1].view(torch.int32).fill_(MISSING_I32)
    return out


class _Group:
    """Layers [first, stop) and the views of the sample buffers their calls use."""

    def __init__(
        self,
        first: int,
        stop: int,
        counts: list[int],
        before: torch.Tensor,
        after: torch.Tensor,
        params: tuple[torch.nn.Parameter, ...],
        samples: list[tuple[int, int, int] | None],
        plain: bool,
    ) -> None:
        self.first, self.stop, self.plain = first, stop, plain
        self.params = params[first:stop]
        a = sum(counts[:first])
        b = a + sum(counts[first:stop])
        self.before, self.after = before[a:b], after[a:b]
        self.samples = samples  # each layer's (offset, stride, count), None: no sample


def weights_of(reader: GradReader) -> list[torch.Tensor]:
    """The reader's parameters as plain local tensors (a shard's own part)."""
    return [local(p).detach() for p in reader.params]


def flat_view(w: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``w``'s elements in memory order, or None when it has none."""
    if w.is_contiguous():
        return w.view(-1)
    if w.dim() == 4 and w.is_contiguous(memory_format=torch.channels_last):
        return w.permute(0, 2, 3, 1).reshape(-1)  # a view: that order is contiguous
    return None


def _cut(counts: list[int], groups: int) -> list[tuple[int, int]]:
    """``groups`` consecutive [first, stop) runs of layers of about equal sample size
    (a run may be empty when there are fewer layers than groups)."""
    total, n = sum(counts), len(counts)
    cuts, acc, g = [0], 0, 1
    for i, c in enumerate(counts):
        while g < groups and i > cuts[-1] and acc >= total * g / groups:
            cuts.append(i)
            g += 1
        acc += c
    while len(cuts) < groups:
        cuts.append(n)
    cuts.append(n)
    return list(zip(cuts, cuts[1:], strict=False))


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
