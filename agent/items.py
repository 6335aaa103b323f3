"""What the training thread hands the shipper thread, and the counters both keep.

Small immutable records, one per kind of work: a flushed batch of step rows
(:class:`FlushItem`), an event (:class:`EventItem`), a cadence sample
(:class:`StatsItem`), a change of incarnation (:class:`Reincarnate`); and the
host-side :class:`Counters`, each field with one writing thread. They sit
apart from agent/shipper.py so the step buffer builds them without importing
the thread that sends them.

Example::

    >>> from gradwatch.agent.items import Counters
    >>> c = Counters(steps_dropped_agent=2, steps_dropped_send=3)
    >>> c.steps_dropped
    5
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradwatch.agent.hostpart import HostPart
from gradwatch.agent.layout import HostValue, Layout
from gradwatch.wire.census import Census


class BufferPool(Protocol):
    """Where the shipper returns host buffers: agent/buffer.py's Pool, or a ``queue.Queue``."""

    def put_nowait(self, item: torch.Tensor) -> None: ...


@dataclass
class Counters:
    """Host-side counters; each field has exactly one writing thread."""

    steps_logged: int = 0  # training thread
    steps_dropped_agent: int = 0  # training thread: no free buffer / queue full
    steps_dropped_send: int = 0  # shipper: ZeroMQ would block (no peer, slow peer)
    steps_held: int = 0  # shipper: a NaN/Inf batch kept to send again (agent/holdback.py)
    batches_sent: int = 0  # shipper
    steps_sent: int = 0  # shipper
    heartbeats_sent: int = 0  # shipper
    events_sent: int = 0  # shipper
    events_dropped: int = 0  # both, under ``lock``
    stats_sent: int = 0  # shipper: cadence-statistics batches
    stats_dropped: int = 0  # both, under ``lock``
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def steps_dropped(self) -> int:
        return self.steps_dropped_agent + self.steps_dropped_send


# Not frozen: a frozen dataclass sets each field through object.__setattr__, and this
# record is made on the training thread at every flush, on the cold cache a backward
# pass leaves: 10 fields took ~15 us there, plain slots ~4 us (2026-12-06). Nothing changes one.
@dataclass(slots=True)
class FlushItem:
    """One batch in flight: ``rows`` device rows in ``buf`` (or ``device_copy``)."""

    buf: torch.Tensor | None  # pooled flat host buffer, returned after use
    rows: int
    width: int
    ready: Any  # torch.cuda.Event, or None when already on host
    device_copy: torch.Tensor | None  # a device clone to read here (non-CUDA accelerators)
    layout: Layout
    steps: list[int]
    times: list[float]
    host_rows: list[list[HostValue]]
    # Per row, gradient norms read but not yet written into it (CPU), else None.
    norms: list[tuple[torch.Tensor, ...] | None] | None = None


@dataclass(frozen=True, slots=True)
class EventItem:
    kind: str
    step: int
    fields: Mapping[str, Any]
    # Tensor-valued fields, stacked: names, then the host (or device) copy.
    tensor_names: tuple[str, ...] = ()
    tensor_values: torch.Tensor | None = None
    ready: Any = None
    time: float = field(default_factory=time.time)

    def wire_fields(self) -> dict[str, Any]:
        """The fields as the event sends them (the shipper's thread: it may wait for the
        tensor values' copy); JSON has no NaN/Inf, so those travel as strings."""
        fields = dict(self.fields)
        if self.tensor_values is not None:
            if self.ready is not None:
                self.ready.synchronize()
            values = self.tensor_values.cpu().tolist()
            fields.update(zip(self.tensor_names, values, strict=True))
        return {k: _json_number(v) for k, v in fields.items()}


def _json_number(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = float(value)  # a CPU tensor kept for the shipper thread to read
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    return value


@dataclass(frozen=True, slots=True)
class Reincarnate:
    """Queued after a rollback: what follows is sent as ``incarnation``."""

    incarnation: str


# Spread cadence samples with host copies queued for the shipper at most (each holds
# copies of what it gathered, agent/hostpart.py; the memory budget counts them). While
# the shipper has not taken them (it looks every 20 ms; a fast loop's samples come
# sooner), the next sample is worked out on the device instead (agent/sampling.py).
MAX_STATS_IN_FLIGHT = 1


@dataclass(slots=True)
class StatsItem:
    """Cadence statistics of one step.

    ``values`` holds one value per name in ``columns`` (activation statistics,
    MISSING where not measured), then the weight norms aligned with ``layers``.
    """

    step: int
    time: float
    layers: tuple[str, ...]
    values: torch.Tensor  # float32; on the host once ``ready`` (if any) completes
    ready: Any = None
    columns: tuple[str, ...] = ()
    census: Census | None = None  # sent in the batch header (contract C2)
    # The cells before the weight norms (activations, update ratios), worked out on the
    # shipper thread from host copies (agent/hostpart.py), in column order.
    parts: tuple[HostPart, ...] = ()
    shipped: bool = False  # set by the shipper once sent or dropped (one store)
