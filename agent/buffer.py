"""The device-side step buffer and the hand-off of flushed rows to the shipper.

Rows live in two halves of ``flush_every`` float32 rows on the model's
device, one row per step, the layer norms first and the device column slots
after them. When a half fills (or the layout changes, or at close) its rows
are copied to a pooled host buffer with one asynchronous copy and handed to
the shipper thread through a bounded queue. On a CPU a full half is already a
host buffer: it is handed over itself and a clean pooled buffer takes its
place (the shipper fills what it returns with MISSING), which spares the
training thread the copy and the refill: a flush step's extra cost over a plain
one fell from ~52 to ~20 us on the 6x256 MLP of benchmarks/agent_overhead.py
(docs/agent-cost.md). The training
thread never waits. When no host buffer is free or the queue is full (a
shipper that fell behind), the oldest waiting batch that can be read now and
holds no NaN or Inf is dropped (its steps counted) to make room, and the new
one waits instead: the newest rows show how the loop stands now and are what a
loop that stops next leaves behind, and a batch with a NaN is what pages. With
no such batch waiting, the new one is dropped and counted. Dropping the newest
always lost, on a loaded machine, a NaN flushed just before a loop paused in 2
of 8 runs of tests/security/test_security_flood.py; dropping the oldest always
lost a one-step NaN in a loop that went on (tests/faults/test_faults_collector_restart.py).

Why a half is never overwritten while its copy is still reading it:
the copy is queued on the current CUDA stream, and so is every later write
on that stream, so the copy reads the rows before anything can change them.
A loop may switch streams between steps, though, so before a half is reused
(``flush_every`` steps later) the then-current stream is made to wait on the
event recorded after the copy: a device-side dependency, no host wait. The
pinned host buffer is safe the same way on the other side: the shipper
returns it to the pool only after ``event.synchronize()`` and encoding.

Example::

    >>> import queue, torch
    >>> from gradwatch.agent.buffer import StepBuffer
    >>> from gradwatch.agent.layout import Columns
    >>> from gradwatch.agent.items import Counters
    >>> cols = Columns(layers=("w",), base=("loss",), device_capacity=2)
    >>> work = queue.Queue(4)
    >>> buf = StepBuffer(cols, torch.device("cpu"), 2, 2, work, Counters())
    >>> for step in range(2):
    ...     buf.commit(step, 0.0, [])
    >>> item = work.get_nowait()
    >>> item.steps, item.rows
    ([0, 1], 2)
"""

from __future__ import annotations

import math
import queue
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.agent.items import Counters, FlushItem
from gradwatch.agent.layout import MISSING_I32, Columns, HostValue, Later, fill_missing, has_special
from gradwatch.agent.workqueue import WorkQueue


class Pool:
    """The free host buffers: a bounded deque (append and popleft are atomic under the GIL).

    The part of ``queue.Queue`` the agent uses, without its lock and condition
    variable: taking a buffer is on the training thread at every flush, returning
    it on the shipper thread. ``refill``: a returned buffer is filled with MISSING
    before it can be taken again (on a CPU every free buffer may become a half).
    """

    def __init__(self, maxsize: int, refill: bool = False) -> None:
        self.maxsize = maxsize
        self.refill = refill
        self.queue: deque[torch.Tensor] = deque()

    def put_nowait(self, item: torch.Tensor) -> None:
        if len(self.queue) >= self.maxsize:
            raise queue.Full
        if self.refill:
            fill_missing(item)  # before it is in the deque, where the other thread takes it
        self.queue.append(item)

    def get_nowait(self) -> torch.Tensor:
        try:
            return self.queue.popleft()
        except IndexError:
            raise queue.Empty from None

    def qsize(self) -> int:
        return len(self.queue)


class StepBuffer:
    """Double-buffered device rows plus the host-side parts of the open segment.

    A *segment* is the run of rows of one half that share a layout: it is
    shipped as one batch. ``current`` is the row the next step writes into.
    """

    def __init__(
        self,
        columns: Columns,
        device: torch.device,
        flush_every: int,
        pool_size: int,
        work: WorkQueue | queue.Queue[Any],
        counters: Counters,
    ) -> None:
        self._columns = columns
        self._device = device
        self._cuda = device.type == "cuda"
        self._on_host = device.type == "cpu"
        self._rows_per_half = flush_every
        self._work = work
        self._counters = counters
        self.host_buffers_made = 0
        self._allocate(columns.device_width)
        self.layout = columns.snapshot()
        self.pool = Pool(pool_size, refill=self._on_host)
        for _ in range(pool_size):
            self.pool.put_nowait(self._host_buffer())

    def _allocate(self, width: int) -> None:
        self._width = width
        self._dev = torch.empty(
            2, self._rows_per_half, width, dtype=torch.float32, device=self._device
        )
        # Every cell starts as MISSING, so a value nobody wrote reads "not
        # measured", never 0. Halves are refilled in one kernel when reused.
        fill_missing(self._dev)
        # Views made once per buffer (and cells on first use): indexing on the hot path
        # costs a microsecond or two each, several per step; a flush is a handful of
        # tensor ops on a cold cache right after the backward pass, each dearer there
        # than its own work. Keyed by the flat buffer, which the entry keeps alive (so
        # its id is not reused); on a CPU the pooled buffers take turns as halves, so
        # this holds the pool's views too: pool_size + 2 entries, reset here.
        self._views: dict[int, _HalfViews] = {}
        self._slots = [self._views_of(self._dev[h].view(-1)) for h in range(2)]  # the halves
        # Whether a half holds only MISSING (a clean buffer put in its place, or made so
        # and not yet written): half 0 is written from now on.
        self._clean = [False, True]
        self._half = 0
        self._seg_start = 0
        # Events recorded after each copy out of a half, waited on before reuse.
        self._half_ready: list[list[Any]] = [[], []]
        self._steps: list[int] = []
        self._times: list[float] = []
        self._host: list[list[HostValue]] = []
        self._norms: list[tuple[torch.Tensor, ...] | None] = []
        self._select(0)

    def _host_buffer(self) -> torch.Tensor:
        self.host_buffers_made += 1
        # Pinned memory is what lets the device-to-host copy run asynchronously.
        buf = torch.empty(
            self._rows_per_half * self._width, dtype=torch.float32, pin_memory=self._cuda
        )
        if self._on_host:
            fill_missing(buf)  # it may become a half (_hand_over)
        return buf

    def _views_of(self, flat: torch.Tensor) -> _HalfViews:
        """The views of one half-sized flat buffer, made on its first use."""
        views = self._views.get(id(flat))
        if views is None:
            half = flat.view(self._rows_per_half, self._width)
            rows = [half[r] for r in range(self._rows_per_half)]
            n_layers = len(self._columns.layers)
            views = self._views[id(flat)] = _HalfViews(
                flat,
                half,
                half.view(torch.int32),
                rows,
                [row[:n_layers] for row in rows],
                [{} for _ in rows],
            )
        return views

    def _install(self, h: int, flat: torch.Tensor) -> None:
        """Make the clean buffer ``flat`` half ``h``."""
        self._slots[h] = self._views_of(flat)
        self._clean[h] = True

    def _select(self, row: int) -> None:
        """Make ``row`` of the current half the one the next step writes."""
        half = self._slots[self._half]
        self.current = half.rows[row]
        self.current_layers = half.layers[row]
        self._current_cells = half.cells[row]

    def cell(self, slot: int) -> torch.Tensor:
        """The current row's cell ``slot`` (a 0-d view, cached)."""
        view = self._current_cells.get(slot)
        if view is None:
            view = self._current_cells[slot] = self.current[slot]
        return view

    def commit(
        self,
        step: int,
        when: float,
        host_row: list[HostValue],
        norms: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """Close the current row; ship the half when it is full.

        ``norms``: the row's gradient norms when they were read but not written into
        it (a CPU buffer only: they are final, and the shipper stacks them).
        """
        self._steps.append(step)
        self._times.append(when)
        self._host.append(host_row)
        self._norms.append(norms)
        row = self._seg_start + len(self._steps)
        if row < self._rows_per_half:
            # _select(row), inline: this runs on every step
            half = self._slots[self._half]
            self.current = half.rows[row]
            self.current_layers = half.layers[row]
            self._current_cells = half.cells[row]
            return
        self.flush()
        self._switch_half()

    def relayout(self) -> None:
        """Start a new segment under the columns' new layout.

        Rows already committed go out under the old layout; the current row
        (which may already hold this step's gradient norms) moves on with
        the new one. If the device row must grow, the current row is copied
        into a fresh buffer: a device-side copy, queued like any other.
        """
        self.flush()
        if self._columns.device_width > self._width:
            old_row, old_width = self.current, self._width
            self._allocate(self._columns.device_width)
            self.current[:old_width].copy_(old_row)
        self.layout = self._columns.snapshot()

    def flush(self) -> None:
        """Hand the committed rows of the open segment to the shipper, or drop them."""
        n = len(self._steps)
        if not n:
            return
        item: FlushItem | None
        if self._on_host and n == self._rows_per_half:
            item = self._hand_over(n)
        else:
            start = self._seg_start
            half = self._slots[self._half].half
            item = self._stage(half if n == self._rows_per_half else half[start : start + n], n)
        if item is None or not self._enqueue(item):
            self._counters.steps_dropped_agent += n
        self._seg_start += n
        # New lists: the old ones now belong to the shipper.
        self._steps, self._times, self._host, self._norms = [], [], [], []

    def _hand_over(self, n: int) -> FlushItem | None:
        """A full half on a CPU: the half itself for the shipper, no copy; a clean buffer
        takes its place. None (the rows dropped) when no buffer is free."""
        fresh = self._free_buffer(clean=True)
        if fresh is None:
            return None
        if fresh.numel() != self._rows_per_half * self._width:
            fresh = self._host_buffer()  # made before the rows grew (a relayout)
        h = self._half
        item = self._item(n, self._slots[h].flat)
        self._install(h, fresh)
        return item

    def _free_buffer(self, clean: bool) -> torch.Tensor | None:
        """A free host buffer (the pool's, or the oldest waiting batch's with nothing to
        page, dropped); None when there is none. ``clean``: filled with MISSING (the pool's
        are on a CPU, refilled as they come back)."""
        try:
            return self.pool.get_nowait()
        except queue.Empty:
            pass
        old = self._take_oldest()
        if old is None or old.buf is None:
            return None
        if clean:
            fill_missing(old.buf)  # it held that batch's rows
        return old.buf

    def _item(
        self, n: int, buf: torch.Tensor | None, ready: Any = None, copy: torch.Tensor | None = None
    ) -> FlushItem:
        """The open segment's ``n`` rows, in ``buf`` (or the device ``copy``), as a batch."""
        return FlushItem(
            buf,
            n,
            self._width,
            ready,
            copy,
            self.layout,
            self._steps,
            self._times,
            self._host,
            self._norms,
        )

    def _stage(self, rows: torch.Tensor, n: int) -> FlushItem | None:
        if not (self._cuda or self._on_host):
            # Another accelerator: clone on the device (queued, no wait) and
            # let the shipper thread do the blocking read.
            return self._item(n, None, copy=rows.clone())
        buf = self._free_buffer(clean=False)  # the copy overwrites the rows it ships
        if buf is None:
            return None
        size = n * self._width
        if buf.numel() < size:
            buf = self._host_buffer()  # the rows grew (rare): replace the small one
        host = buf.view(n, self._width) if buf.numel() == size else buf[:size].view(n, self._width)
        ready = None
        if self._cuda:
            host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            self._half_ready[self._half].append(ready)
        else:
            host.copy_(rows)
        return self._item(n, buf, ready)

    def _enqueue(self, item: FlushItem) -> bool:
        try:
            self._work.put_nowait(item)
            return True
        except queue.Full:
            pass
        old = self._take_oldest()
        if old is not None:
            if old.buf is not None:
                self.pool.put_nowait(old.buf)
            try:
                self._work.put_nowait(item)
                return True
            except queue.Full:  # the room went to an event meanwhile
                pass
        if item.buf is not None:
            self.pool.put_nowait(item.buf)
        return False

    def _take_oldest(self) -> FlushItem | None:
        """The oldest waiting batch with nothing to page, taken back and counted as
        dropped (see the module docstring); None when there is none."""
        evict = getattr(self._work, "evict", None)  # a plain queue.Queue has none
        old: FlushItem | None = evict(_nothing_to_page) if evict is not None else None
        if old is None:
            return None
        self._counters.steps_dropped_agent += old.rows  # its copy has finished: reusable
        return old

    def _switch_half(self) -> None:
        self._half ^= 1
        self._seg_start = 0
        if self._half_ready[self._half]:
            stream = torch.cuda.current_stream(self._device)
            for ready in self._half_ready[self._half]:
                # Device-side wait (see the module docstring): the host does not block.
                stream.wait_event(ready)
            self._half_ready[self._half] = []
        if not self._clean[self._half]:
            self._slots[self._half].half_i32.fill_(MISSING_I32)  # fill_missing, on a view made once
        self._clean[self._half] = False
        self._select(0)


@dataclass(frozen=True, slots=True)
class _HalfViews:
    """A half-sized flat buffer and the views the hot path writes through."""

    flat: torch.Tensor
    half: torch.Tensor  # (flush_every, width)
    half_i32: torch.Tensor  # the same, as int32: MISSING is filled through it
    rows: list[torch.Tensor]
    layers: list[torch.Tensor]  # each row's layer-norm part
    cells: list[dict[int, torch.Tensor]]  # each row's 0-d cells, made on first use


def _nothing_to_page(item: object) -> bool:
    """Whether ``item`` is a batch whose every value can be read now, without waiting
    for the device, and none is NaN or Inf. On the training thread, and only at a flush
    that finds no free buffer, usually for the oldest batch alone: ~0.1 ms for 10 rows of
    12 layers, ~3 ms for 10 rows of 1,000 layers whose CPU norms the shipper has not yet
    stacked (one tensor each; a model that size takes far longer a step on a CPU)."""
    if not isinstance(item, FlushItem) or item.buf is None:
        return False
    try:
        if item.ready is not None and not item.ready.query():
            return False  # its copy is still running: unknown, so kept
        if has_special(item.buf[: item.rows * item.width].view(torch.int32)):
            return False
        for norms in item.norms or ():
            if norms and not bool(torch.stack(norms).isfinite().all()):
                return False
        return all(_finite(value) for row in item.host_rows for value in row)
    except Exception:  # a value it cannot judge (a logged tensor of an odd kind): kept
        return False


def _finite(value: HostValue) -> bool:
    if isinstance(value, Later):
        value = value.tensor
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu" and bool(value.isfinite().all())
    return not isinstance(value, float) or math.isfinite(value)
