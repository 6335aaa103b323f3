"""The batch with a NaN or Inf that no collector took, kept and sent before anything later.

A one-step catastrophe (a NaN loss that GradScaler then skips, one poisoned batch)
is in one batch and nowhere else: the steps after it are finite again. A batch is
dropped when no collector takes it: none is connected (it is restarting, or the
network is down) or its pipe stays full (it is not reading). Dropping *that*
batch loses the page. The shipper keeps it instead, the first one only (the onset),
and sends it before any later batch of steps. While it is idle it retries every
``RETRY_S``. Later batches of steps that cannot go out behind it yet are dropped
and counted, as they would have been anyway: no collector is taking anything. They
are never sent ahead of it, because a collector reads a step older than the last
one it saw as a restart of the job.

A kept batch's steps count as neither sent nor dropped while it waits. When the
agent closes, or the job becomes a new incarnation, a batch that never went out is
counted as dropped.

Example::

    >>> from gradwatch.agent.items import Counters
    >>> from gradwatch.wire import Schema
    >>> counters, took = Counters(), []
    >>> hold = Holdback(lambda kept: bool(took), counters)
    >>> hold.keep(Kept(Schema(1, ("loss",), ()), [7], [0.0], b"\\x00\\x00\\xc0\\x7f"))
    >>> hold.clear(), counters.steps_held       # no collector takes it yet
    (False, 1)
    >>> took.append(True); hold.clear(), counters.steps_held
    (True, 0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gradwatch.agent.items import Counters
from gradwatch.wire import Schema

logger = logging.getLogger(__name__)

# While a batch is kept and nothing else is to be sent, the shipper retries it this often
# (a send that finds no peer fails at once, so a retry costs microseconds).
RETRY_S = 0.1


@dataclass(frozen=True, slots=True)
class Kept:
    """A batch of steps as the shipper sends it, encoded again when it is retried: by
    then the sequence number and the schema's state at each collector may have changed."""

    schema: Schema
    steps: list[int]
    times: list[float]
    values: bytes  # little-endian float32 cells, NaN or Inf among them


class Holdback:
    """The kept batch, and when it was last tried; used by the shipper thread only."""

    def __init__(self, send: Callable[[Kept], bool], counters: Counters) -> None:
        # ``send``: sends a batch and counts it as sent; False when no collector took it.
        self._send = send
        self._counters = counters
        self.kept: Kept | None = None
        self._tried = 0.0

    def keep(self, batch: Kept) -> None:
        """Keep ``batch``, which no collector took. Only called with none kept: while one
        is, the shipper sends nothing after it (``clear()`` first), so it stays the onset."""
        self.kept = batch
        self._counters.steps_held = len(batch.steps)
        self._tried = time.monotonic()
        logger.warning(
            "gradwatch: no collector took the batch of steps %d-%d, which holds a NaN or "
            "Inf; it is kept and sent before any later step once a collector takes messages "
            "again (check that the collector at the configured endpoint is up and reading)",
            batch.steps[0],
            batch.steps[-1],
        )

    def clear(self) -> bool:
        """Send the kept batch, if any; True when none is kept any more."""
        kept = self.kept
        if kept is None:
            return True
        self._tried = time.monotonic()
        if not self._send(kept):
            return False
        self.kept = None
        self._counters.steps_held = 0  # ``send`` counted them as sent
        logger.info(
            "gradwatch: the kept batch of steps %d-%d went out", kept.steps[0], kept.steps[-1]
        )
        return True

    def due(self, now: float) -> bool:
        """Whether an idle shipper should retry the kept batch now."""
        return self.kept is not None and now - self._tried >= RETRY_S

    def give_up(self) -> None:
        """Count a kept batch that never went out as dropped (closing, a new incarnation)."""
        if self.kept is not None:
            self._counters.steps_dropped_send += len(self.kept.steps)
            self._counters.steps_held = 0
            self.kept = None
