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
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradwatch.wire import MISSING_BITS, Schema

# The MISSING bit pattern as the signed int32 that ``Tensor.fill_`` accepts.
MISSING_I32 = MISSING_BITS - (1 << 32) if MISSING_BITS >= 1 << 31 else MISSING_BITS

# Host values travel as Python numbers or CPU 0-d tensors; None means "not
# measured this step".
HostValue = float | int | torch.Tensor | None


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
    # Output column index <- device row index, for columns with a device slot.
    dev_cols: torch.Tensor
    dev_src: torch.Tensor
    # Output column index <- host slot index, for columns with a host slot.
    host_cols: torch.Tensor
    host_src: tuple[int, ...]


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

    def _add(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)
            self.schema_id += 1
            self.dirty = True

    def snapshot(self) -> Layout:
        """Freeze the current mapping for the shipper; clears ``dirty``."""
        self.dirty = False
        index = {name: i for i, name in enumerate(self.names)}
        dev = sorted((index[n], s) for n, s in self._dev.items())
        host = sorted((index[n], s) for n, s in self._host.items())
        return Layout(
            schema=Schema(id=self.schema_id, columns=tuple(self.names), layers=self.layers,
                          layer_roles=self.layer_roles),
            n_layers=len(self.layers), device_width=self.device_width,
            dev_cols=torch.tensor([c for c, _ in dev], dtype=torch.long),
            dev_src=torch.tensor([s for _, s in dev], dtype=torch.long),
            host_cols=torch.tensor([c for c, _ in host], dtype=torch.long),
            host_src=tuple(s for _, s in host))


def merge_rows(layout: Layout, dev: torch.Tensor, host: Sequence[Sequence[HostValue]]) -> bytes:
    """Pack ``len(host)`` rows as the wire's little-endian float32 values.

    ``dev`` is the host copy of the device rows (``n x device_width`` float32,
    CPU). Runs on the shipper thread, where reading tensors is allowed.
    """
    n_rows = dev.shape[0]
    n_cols = len(layout.schema.columns)
    out = torch.empty(n_rows, n_cols + layout.n_layers, dtype=torch.float32)
    fill_missing(out[:, :n_cols])
    out[:, n_cols:] = dev[:, : layout.n_layers]
    if layout.dev_cols.numel():
        out[:, layout.dev_cols] = dev[:, layout.dev_src]
    if layout.host_src:
        values, present = _host_matrix(layout.host_src, host)
        current = out[:, layout.host_cols]
        out[:, layout.host_cols] = torch.where(present, values, current)
    return _le_bytes(out)


def _host_matrix(src: tuple[int, ...], rows: Sequence[Sequence[HostValue]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    values = [[_as_float(row[s]) if s < len(row) else math.nan for s in src] for row in rows]
    present = [[s < len(row) and row[s] is not None for s in src] for row in rows]
    return (torch.tensor(values, dtype=torch.float64).to(torch.float32),
            torch.tensor(present, dtype=torch.bool))


def _as_float(v: HostValue) -> float:
    if v is None:
        return math.nan
    # A CPU 0-d tensor the loop logged; reading it here, off the training
    # thread, is the point of keeping it as a tensor until now.
    return float(v)


def _le_bytes(t: torch.Tensor) -> bytes:
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
