"""A starved shipper: the agent drops the oldest waiting batch with nothing to page.

When the shipper thread falls behind (the GIL held by other busy threads, a
slow collector), every host buffer is taken by batches waiting for it. The
newest rows are what show how the loop stands now and what a loop that stops
next leaves behind: a NaN flushed last and dropped as the newest never pages.
A batch that holds a NaN is what pages, so it is never the one dropped for room.
"""

from __future__ import annotations

import torch

from gradwatch.agent.buffer import StepBuffer
from gradwatch.agent.items import Counters, EventItem, FlushItem
from gradwatch.agent.layout import Columns, Later
from gradwatch.agent.workqueue import WorkQueue

FLUSH, POOL = 5, 4


def buffer(events: int = 2) -> tuple[StepBuffer, WorkQueue, Counters]:
    work = WorkQueue(POOL + events)
    counters = Counters()
    cols = Columns(layers=("w",), base=("loss",), device_capacity=2)
    return StepBuffer(cols, torch.device("cpu"), FLUSH, POOL, work, counters), work, counters


def run(buf: StepBuffer, steps: range, nan: set[int] | None = None) -> None:
    for step in steps:
        # The layer column carries the step, to check the rows; NaN at the steps in ``nan``.
        buf.current[0] = float("nan") if nan and step in nan else float(step)
        buf.commit(step, 0.0, [])


def waiting(work: WorkQueue) -> list[FlushItem]:
    items = []
    while len(work):
        items.append(work.get_nowait())
    return items


def test_the_newest_batches_wait_and_the_oldest_are_dropped_and_counted():
    buf, work, counters = buffer()
    run(buf, range(50))  # ten flushes, nobody shipping
    items = waiting(work)
    assert [item.steps for item in items] == [list(range(s, s + FLUSH)) for s in (30, 35, 40, 45)]
    assert counters.steps_dropped_agent == 30
    assert buf.host_buffers_made == POOL  # the dropped batches' buffers were reused
    for item in items:  # each buffer holds its own rows, not an evicted batch's
        assert item.buf is not None
        rows = item.buf[: item.rows * item.width].view(item.rows, item.width)
        assert rows[:, 0].tolist() == [float(s) for s in item.steps]


def test_an_event_in_front_keeps_its_place_and_the_oldest_batch_behind_it_is_dropped():
    buf, work, counters = buffer()
    work.put_nowait(EventItem("note", 0, {}))
    run(buf, range(6 * FLUSH))  # six flushes behind the note, nobody shipping
    items = waiting(work)
    assert isinstance(items[0], EventItem)
    assert [item.steps[0] for item in items[1:]] == [10, 15, 20, 25]
    assert counters.steps_dropped_agent == 2 * FLUSH
    assert buf.host_buffers_made == POOL


def test_with_no_batch_waiting_the_new_one_is_dropped_and_counted():
    buf, work, counters = buffer(events=0)
    for step in range(POOL):
        work.put_nowait(EventItem("note", step, {}))  # the queue is full of notes
    run(buf, range(2 * FLUSH))
    assert [item.step for item in waiting(work)] == list(range(POOL))
    assert counters.steps_dropped_agent == 2 * FLUSH
    assert len(buf.pool.queue) == POOL  # every buffer came back


def test_a_waiting_batch_with_a_nan_is_kept_and_the_finite_ones_make_room():
    buf, work, counters = buffer()
    run(buf, range(50), nan={7})  # the second batch holds a NaN; eight more follow it
    items = waiting(work)
    assert [item.steps[0] for item in items] == [5, 35, 40, 45]
    assert counters.steps_dropped_agent == 30


def test_a_new_batch_finds_only_batches_with_a_nan_waiting_and_is_dropped():
    buf, work, counters = buffer()
    run(buf, range(50), nan=set(range(20)))  # the first four batches all hold a NaN
    assert [item.steps[0] for item in waiting(work)] == [0, 5, 10, 15]
    assert counters.steps_dropped_agent == 30


def test_a_batch_it_cannot_judge_is_kept_and_nothing_raises():
    class Odd(torch.Tensor):
        """A logged tensor that cannot be tested for NaN (as a quantized one cannot)."""

        def isfinite(self) -> torch.Tensor:
            raise NotImplementedError("isfinite")

    # The batch holding it is kept, as one with a NaN would be.
    odd = torch.tensor(1.0).as_subclass(Odd)
    buf, work, counters = buffer()
    for step in range(3 * FLUSH):  # three batches; the first holds the odd value
        buf.current[0] = float(step)
        buf.commit(step, 0.0, [Later(odd if step == 0 else torch.tensor(1.0), 0)])
    run(buf, range(3 * FLUSH, 6 * FLUSH))
    assert [item.steps[0] for item in waiting(work)] == [0, 15, 20, 25]
    assert counters.steps_dropped_agent == 2 * FLUSH
