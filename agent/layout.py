"""Where each column of a step lives before it is shipped, and how rows are merged.

A step's values come from two places. Device tensors (the loss, the AMP loss
scale, grad norms a loop passes as tensors, gradient norms) are written into
the device buffer without a sync; Python numbers (usually the learning rate)
are kept in a host-side list. Each wire column therefore has a device *slot*
and/or a host *slot*. :class:`Columns` assigns them on the training thread as
names first appear; :class:`Layout` is the immutable snapshot the shipper
thread uses to merge one batch's device rows and host rows into the packed
float32 values the wire carries.

Example::

    >>> import torch
    >>> from gradwatch.agent.layout import Columns, merge_rows
    >>> cols = Columns(layers=("w",), base=("loss", "lr/0"), device_capacity=4)
    >>> loss_slot = cols.device_slot("loss")
    >>> lr_slot = cols.host_slot("lr/0")
    >>> layout = cols.snapshot()
    >>> dev = torch.tensor([[2.0, 0.5, 0.0, 0.0, 0.0]])    # layer norm, then slots
    >>> host = [[0.1]]
    >>> import struct
    >>> struct.unpack("<3f", merge_rows(layout, dev, host))[1:]
    (0.10000000149011612, 2.0)
"""

from __future__ import annotations

import array
import ctypes
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gradwatch.wire import MISSING_BITS, Schema

# The MISSING bit pattern as the signed int32 that ``Tensor.fill_`` accepts.
MISSING_I32 = MISSING_BITS - (1 << 32) if MISSING_BITS >= 1 << 31 else MISSING_BITS


class Later(NamedTuple):
    """A 0-d CPU tensor logged by reference, read by the shipper, with its version then.

    The loss of a step's forward is an autograd result that nothing writes in
    place, so a CPU loop's loss is not copied on the training thread (a tensor
    copy there, on a cache the backward pass just emptied, cost ~10 us a step
    on the benchmark MLP): the shipper reads it when it merges the batch.
    Should the loop write it in place after all (its version counter moved),
    the value is not sent: MISSING, counted, and said once. A tuple: made on
    every step, and a frozen dataclass costs more to build.
    """

    tensor: torch.Tensor
    version: int


# Host values travel as Python numbers, CPU 0-d tensors or references to them;
# None means "not measured this step".
HostValue = float | int | torch.Tensor | Later | None
_F32 = struct.Struct("=I")
_F32F = struct.Struct("=f")
# One MISSING cell as it travels.
MISSING_LE = struct.pack("<I", MISSING_BITS)


def has_special(cells: torch.Tensor) -> bool:
    """Whether float32 cells, viewed as int32, hold a NaN or Inf (MISSING cells do not
    count): exponent bits all set is NaN or Inf, and MISSING is a NaN with its own payload."""
    special = (cells & _EXPONENT) == _EXPONENT
    return bool((special & (cells != MISSING_I32)).any())


_EXPONENT = 0x7F800000


def has_nonfinite(values: bytes) -> bool:
    """Whether little-endian float32 ``values`` hold a NaN or Inf (MISSING cells do not count).

    Sets the batch header's ``nonfinite`` hint (docs/wire.md), which buys the batch
    priority at the collector; the collector still decides from the values. On the
    shipper thread: ~20 us for a 10 x 1,000 batch, in four tensor ops on one copy.
    """
    if not values:
        return False
    cells = torch.frombuffer(bytearray(values), dtype=torch.int32)  # a copy: bytes are read-only
    if sys.byteorder != "little":
        cells = cells.view(torch.uint8).view(-1, 4).flip(1).contiguous().view(torch.int32).flatten()
    return has_special(cells)


def fill_missing(t: torch.Tensor) -> None:
    """Fill a float32 tensor with the wire's MISSING sentinel in one kernel."""
    t.view(torch.int32).fill_(MISSING_I32)


@dataclass(frozen=True, slots=True)
class Layout:
    """How one schema's columns map onto device and host slots (immutable).

    A device row is ``n_layers`` layer norms followed by ``device_capacity``
    column slots; a host row is a list with one entry per host slot.
    """

    schema: Schema
    n_layers: int
    device_width: int
    # (output column index, device row index) of each column with a device slot.
    dev_pairs: tuple[tuple[int, int], ...]
    # (output column index, host slot index) of each column with a host slot.
    host_pairs: tuple[tuple[int, int], ...]


class Columns:
    """The growing set of columns (training thread only).

    Column order is the order names first appear, after the ``base`` columns;
    it only ever grows, so a new name appends a column and bumps the schema id.
    A new *slot* for a known column (a learning rate that turns from a float
    into a tensor) changes the layout but not the schema.
    """

    def __init__(self, layers: Sequence[str], base: Sequence[str], device_capacity: int) -> None:
        self.layers = tuple(layers)
        # Each layer's role (contract C1, from gradwatch.agent.census), sent in the schema.
        self.layer_roles: tuple[str, ...] = ()
        self.names: list[str] = []
        self._dev: dict[str, int] = {}
        self._host: dict[str, int] = {}
        self.device_capacity = device_capacity
        self.schema_id = 0
        # True when a snapshot taken now would differ from the last one.
        self.dirty = True
        for name in base:
            self._add(name)
        self.schema_id = 1

    @property
    def device_width(self) -> int:
        return len(self.layers) + self.device_capacity

    @property
    def host_width(self) -> int:
        return len(self._host)

    def device_slot(self, name: str) -> int:
        """Index in the device row of ``name``'s cell, assigning one if new."""
        slot = self._dev.get(name)
        if slot is None:
            self._add(name)
            slot = self._dev[name] = len(self.layers) + len(self._dev)
            while len(self._dev) > self.device_capacity:
                self.device_capacity *= 2
            self.dirty = True
        return slot

    def host_slot(self, name: str) -> int:
        """Index in the host row of ``name``'s value, assigning one if new."""
        slot = self._host.get(name)
        if slot is None:
            self._add(name)
            slot = self._host[name] = len(self._host)
            self.dirty = True
        return slot

    def slots(self, name: str) -> tuple[int, int]:
        """``name``'s host and device slot, -1 for none; assigns nothing."""
        return self._host.get(name, -1), self._dev.get(name, -1)

    def _add(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)
            self.schema_id += 1
            self.dirty = True

    def snapshot(self) -> Layout:
        """Freeze the current mapping for the shipper; clears ``dirty``."""
        self.dirty = False
        index = {name: i for i, name in enumerate(self.names)}
        dev = tuple(sorted((index[n], s) for n, s in self._dev.items()))
        host = tuple(sorted((index[n], s) for n, s in self._host.items()))
        return Layout(
            schema=Schema(
                id=self.schema_id,
                columns=tuple(self.names),
                layers=self.layers,
                layer_roles=self.layer_roles,
            ),
            n_layers=len(self.layers),
            device_width=self.device_width,
            dev_pairs=dev,
            host_pairs=host,
        )


def merge_rows(
    layout: Layout,
    dev: torch.Tensor,
    host: Sequence[Sequence[HostValue]],
    stale: list[int] | None = None,
) -> bytes:
    """Pack ``len(host)`` rows as the wire's little-endian float32 values.

    ``dev`` is the host copy of the device rows (``n x device_width`` float32,
    CPU). Runs on the shipper thread, where reading tensors is allowed.
    Works on the raw 32-bit patterns in an ``array``, not with torch ops:
    a dozen small tensor ops cost ~350 us of this thread's time per batch, and
    that time holds the GIL the training thread needs. A :class:`Later` whose
    tensor was written in place since ``log()`` stays MISSING and is counted in
    ``stale[0]``.
    """
    n_rows, width = dev.shape[0], dev.shape[1]
    n_cols, n_layers = len(layout.schema.columns), layout.n_layers
    src = array.array("I", le_bytes(dev))
    if sys.byteorder != "little":
        src.byteswap()  # back to native order for indexing; swapped again below
    out_width = n_cols + n_layers
    out = array.array("I", [MISSING_BITS]) * (n_rows * out_width)
    for r in range(n_rows):
        base, at = r * out_width, r * width
        out[base + n_cols : base + out_width] = src[at : at + n_layers]
        for col, slot in layout.dev_pairs:
            out[base + col] = src[at + slot]
        if r < len(host):
            row = host[r]
            for col, slot in layout.host_pairs:
                if slot < len(row) and (value := row[slot]) is not None:
                    if type(value) is Later:
                        if value.tensor._version != value.version:
                            if stale is not None:
                                stale[0] += 1
                            continue
                        value = value.tensor
                    out[base + col] = _f32_bits(value)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def _f32_bits(v: HostValue) -> int:
    # A CPU 0-d tensor the loop logged is read here, off the training thread:
    # the point of keeping it as a tensor until now. The caller has already turned a
    # Later into its tensor and skipped None, which the HostValue type cannot say.
    x = float(v)  # type: ignore[arg-type]
    try:
        return _F32.unpack(_F32F.pack(x))[0]
    except OverflowError:  # beyond float32's range: what a float32 cast gives
        return _F32.unpack(_F32F.pack(math.copysign(math.inf, x)))[0]


def le_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU float32 tensor, little-endian.

    ``ctypes.string_at`` copies the storage in one memcpy and needs no numpy,
    which the agent does not depend on.
    """
    t = t.contiguous()
    if sys.byteorder != "little":
        swapped = array.array("f", t.flatten().tolist())
        swapped.byteswap()
        return swapped.tobytes()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


# Gradient norms read on a CPU but not stacked (the shipper does it, fill_norms) are kept
# as 0-d tensors until their batch is merged: 536 bytes each (tensor, storage and Python
# objects: RSS over 100,000 of them). Only for models of up to DEFERRED_MAX_LAYERS
# tensors, where the stack is a large share of the read: 5 batches in flight (pool_size 4
# and the open one) of 10 steps then hold at most 3.4 MB; larger models stack at once.
DEFERRED_NORM_BYTES = 536
DEFERRED_MAX_LAYERS = 128


def fill_norms(
    rows: torch.Tensor, norms: Sequence[tuple[torch.Tensor, ...] | None], n_layers: int
) -> None:
    """Write the gradient norms the training thread read but did not stack (CPU: they
    are final once read) into their rows' layer cells: two tensor operations a batch.

    A read of another length (none in practice: the reader and the layout change
    together, through a flush) leaves its row's cells MISSING rather than misaligned.
    """
    index: list[int] = []
    picked: list[torch.Tensor] = []
    for i, row in enumerate(norms):
        if row is not None and len(row) == n_layers:
            index.append(i)
            picked.extend(row)
    if not index:
        return
    flat = torch.stack(picked).view(len(index), n_layers)
    if len(index) == rows.shape[0]:
        rows[:, :n_layers].copy_(flat)
    else:
        rows[index, :n_layers] = flat
