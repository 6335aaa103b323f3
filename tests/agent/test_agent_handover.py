"""On a CPU a full half goes to the shipper itself, and a clean pooled buffer takes its place.

The copy into a pooled buffer and the refill of the next half were most of a flush step's
extra ~52 us on the 6x256 MLP (benchmarks/agent_overhead.py; ~20 us now); a CPU half is
host memory already. What
must hold: the shipper gets each batch's own rows, and a buffer that comes back from it
never shows the rows of the batch it carried (a cell a later step leaves unwritten reads
MISSING, "not measured", never an old value).
"""

from __future__ import annotations

import torch

from gradwatch.agent.buffer import StepBuffer
from gradwatch.agent.items import Counters, FlushItem
from gradwatch.agent.layout import MISSING_I32, Columns
from gradwatch.agent.workqueue import WorkQueue

FLUSH, POOL = 4, 3


def make(pool: int = POOL) -> tuple[StepBuffer, WorkQueue, Counters]:
    work = WorkQueue(pool + 2)
    counters = Counters()
    cols = Columns(layers=("w",), base=("loss",), device_capacity=2)
    return StepBuffer(cols, torch.device("cpu"), FLUSH, pool, work, counters), work, counters


def ship(buf: StepBuffer, work: WorkQueue) -> list[FlushItem]:
    """What agent/shipper.py does with each batch: read its rows, return its buffer to the
    pool; the rows as read are kept here for the test, in a copy."""
    items = []
    while len(work):
        item = work.get_nowait()
        assert isinstance(item, FlushItem) and item.buf is not None
        pooled, item.buf = item.buf, item.buf[: item.rows * item.width].clone()
        buf.pool.put_nowait(pooled)
        items.append(item)
    return items


def rows(item: FlushItem) -> torch.Tensor:
    assert item.buf is not None
    return item.buf.view(item.rows, item.width)


def test_a_full_half_is_handed_over_without_a_copy():
    buf, work, _ = make()
    first_half = buf._dev[0].data_ptr()
    for step in range(FLUSH):
        buf.current[0] = float(step)
        buf.commit(step, 0.0, [])
    item = work.get_nowait()
    assert isinstance(item, FlushItem) and item.buf is not None
    assert item.buf.data_ptr() == first_half  # the rows written, not a copy of them
    assert rows(item)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert buf.current.data_ptr() != first_half  # the loop writes elsewhere now


def test_buffers_back_from_the_shipper_never_show_an_old_batchs_rows():
    buf, work, counters = make()
    seen: list[FlushItem] = []
    for step in range(12 * FLUSH):  # every buffer serves as a half several times
        buf.current[0] = float(step)
        if step < FLUSH:
            buf.current[1] = 7.0  # a device column only the first batch writes
        buf.commit(step, 0.0, [])
        if step % (2 * FLUSH) == 2 * FLUSH - 1:
            seen += ship(buf, work)  # every second flush: two batches wait at times
    assert counters.steps_dropped_agent == 0
    assert [list(item.steps) for item in seen] == [
        list(range(s, s + FLUSH)) for s in range(0, 12 * FLUSH, FLUSH)
    ]
    for item in seen:
        got = rows(item)
        assert got[:, 0].tolist() == [float(s) for s in item.steps]
        column = got.view(torch.int32)[:, 1]
        if item.steps[0] == 0:
            assert got[:, 1].tolist() == [7.0] * FLUSH
        else:
            assert (column == MISSING_I32).all(), f"steps {item.steps} show an old batch's cell"
    assert buf.host_buffers_made == POOL  # the same buffers, taking turns


def test_a_half_whose_rows_were_dropped_is_refilled_before_it_is_written_again():
    # No buffer free at all (a pool of none, nothing waiting to evict): each full half's
    # rows are dropped and counted, and the same half is written again next time round;
    # a cell its new steps leave unwritten must read MISSING, not a dropped step's value.
    buf, work, counters = make(pool=0)
    for step in range(FLUSH):
        buf.current[1] = 7.0  # the first half's rows: written here only
        buf.commit(step, 0.0, [])
    for step in range(FLUSH, 2 * FLUSH):
        buf.commit(step, 0.0, [])
    assert counters.steps_dropped_agent == 2 * FLUSH and not len(work)
    assert int(buf.current.view(torch.int32)[1]) == MISSING_I32  # back in the first half
