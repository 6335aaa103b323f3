"""The per-rank medians behind ``StateStore.liveness`` are cached, and never stale.

``liveness()`` runs every second over every rank (16,384 in a 3D job, issue
17); each rank's median step time and phase times are now computed only when
its intervals or phases changed, and each ``Liveness`` is built by
``build_liveness``. The answers must be those computed afresh.
"""

from __future__ import annotations

import statistics

from gradwatch.collector.state import StateStore
from gradwatch.rules.step import Liveness, Step, build_liveness
from gradwatch.wire import Heartbeat
from gradwatch.wire import columns as col


def test_build_liveness_equals_the_dataclass_constructor() -> None:
    args = ("j", 3, 10.0, 7, 9.0, 9.5, 1.25, 8, 0.5, 0.75)
    built = build_liveness(*args)
    assert (
        type(built) is Liveness
        and built == Liveness(*args)
        and repr(built) == repr(Liveness(*args))
    )


def test_liveness_medians_follow_every_change() -> None:
    now = [100.0]
    store = StateStore(clock=lambda: now[0])
    times = [0.0, 1.0, 3.0, 4.0, 8.0]
    for i, t in enumerate(times):
        phases = {col.DATA_SECONDS_SCALAR: 0.1 * i, col.FORWARD_SECONDS_SCALAR: 0.2}
        store.observe_step(Step(job="j", step=i, time=t, rank=0, scalars=phases))
        (live,) = store.liveness()
        intervals = [b - a for a, b in zip(times[: i + 1], times[1 : i + 1], strict=False)]
        assert live.step_seconds == (statistics.median(intervals) if intervals else None)
        assert live.data_seconds == statistics.median([0.1 * k for k in range(i + 1)])
        assert live.busy_seconds == statistics.median([0.1 * k + 0.2 for k in range(i + 1)])
        assert store.liveness() == [live]  # asked again: the same answer
    # A restarted process (another incarnation) starts its step times anew.
    store.observe_heartbeat(Heartbeat("j", 0, 1, "first", 9.0, 4, 0))
    store.observe_heartbeat(Heartbeat("j", 0, 1, "second", 9.0, 4, 0))
    (live,) = store.liveness()
    assert live.step_seconds is None
