"""Taking over a silent reporter's per-layer norms, at a step boundary.

Under a layout (agent/topology.py) one data-parallel replica per model shard
sends per-layer gradient norms; the others send their loss, flags, phases and
heartbeats only. When the collector hears nothing from a shard's reporter for
its silent-rank threshold, it publishes a signed ``takeover`` command naming
the job's silent ranks (collector/takeover.py, wire/commands.py), and again
when that set changes (an empty set when the reporter is back), repeated
while it is not empty. Here:

* the shipper thread (agent/commands.py checks the signature, freshness,
  replay and order) calls :meth:`LayerSwitch._on_takeover`, which recomputes
  ``reports_layers(layout, rank, silent)`` and stores the answer (one
  attribute store);
* the training thread, in ``Monitor.log()`` right after the step is
  committed, compares that answer with what it sends (one attribute read per
  step) and, when they differ, switches :class:`LayerMode`: the rows logged so
  far go out under their own schema, and the next step is written under the
  other mode's columns and device rows. Nothing waits for the device.

A takeover changes only what this rank *sends*: it never restarts, rolls
back, pauses or alters training. The first switch to a mode this rank did not
start in builds that mode once (a device row buffer of one flush, sharing the
host buffers); later switches reuse it. A rank that takes over sends layer
norms and, when ``stats_every`` is set, weight norms and update ratios; it
does not attach activation hooks mid-run (docs/distributed.md, "Takeover").

Example (what the shipper thread hands over)::

    mon._on_takeover(Takeover(silent=frozenset({0}), issued_at=time.time()))
    mon.log(loss=loss)   # from the next step, this rank sends its shard's layers
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gradwatch.agent.activations import ActHooks
from gradwatch.agent.buffer import StepBuffer
from gradwatch.agent.layout import Columns
from gradwatch.agent.recording import StepRecorder
from gradwatch.agent.recovery import Notice
from gradwatch.agent.takeover_command import Takeover
from gradwatch.agent.topology import reports_layers, share_scales
from gradwatch.agent.weightstats import WeightStats
from gradwatch.wire import columns as wc

logger = logging.getLogger(__name__)

# Schema ids of the mode built after watch() start here, so they never meet the
# first mode's (ids grow by one per new column) nor STATS_SCHEMA_ID (1 << 30).
SECOND_MODE_SCHEMA_ID = 1 << 29


@dataclass(slots=True)
class LayerMode:
    """What differs between a rank that sends per-layer norms and one that does not.

    ``columns`` and ``buffer``: the schema and device rows; ``scratch``: where a
    rank without layers reads its norms (for its ``grad_nonfinite`` flag);
    ``scales``: the layers' share factors (topology.share_scales). ``wstats`` and
    ``acts`` hold the cadence statistics while the other mode runs.
    """

    reports: bool
    columns: Columns
    buffer: StepBuffer
    scratch: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    nonfinite_slot: int = -1
    wstats: WeightStats | None = None
    acts: ActHooks | None = None


class LayerSwitch(StepRecorder):
    """Builds the layer modes and switches between them; see the module docstring."""

    _mode: LayerMode
    _other_mode: LayerMode | None
    _base_columns: tuple[str, ...]
    # Written by the shipper thread, read by the training thread once per log().
    _want_layers: bool
    _no_takeover: bool  # a switch failed: takeovers are off for this rank

    def _layer_mode(self, reports: bool, pool_size: int) -> LayerMode:
        """Columns, device rows and read targets for sending layers (``reports``) or not."""
        names = self._reader.names
        columns = Columns(names if reports else (), self._base_columns, self.config.device_columns)
        columns.layer_roles = self._census.roles(self._reader.params) if reports else ()
        if getattr(self, "_mode", None) is not None:
            columns.schema_id += SECOND_MODE_SCHEMA_ID
        scratch = scales = None
        slot = -1
        if not reports:  # a replica whose model shard has a reporter (agent/topology.py)
            scratch = torch.empty(len(names), device=self._device)
            slot = columns.device_slot(wc.scalar(wc.GRAD_NONFINITE_SCALAR))
        else:
            scales = _layer_scales(
                self._root, self._reader.params, self.config.layout, self._device
            )
        buffer = StepBuffer(
            columns,
            self._device,
            self.config.flush_every,
            pool_size,
            self._work,
            self._counters,
        )
        return LayerMode(reports, columns, buffer, scratch, scales, slot)

    def _use_mode(self, mode: LayerMode) -> None:
        self._mode = mode
        self._columns, self._buffer = mode.columns, mode.buffer
        self._scratch, self._scales = mode.scratch, mode.scales
        self._nonfinite_slot = mode.nonfinite_slot
        self._plan = None  # its slots are the other mode's columns'

    def _on_takeover(self, takeover: Takeover) -> None:
        """Shipper thread: decide whether this rank sends layers now; the loop applies it."""
        config = self.config
        if self._no_takeover:
            return
        want = reports_layers(config.layout, config.rank, takeover.silent)
        if want is not self._want_layers:
            logger.warning(
                "gradwatch: rank %d %s per-layer gradient norms after its next step: %s "
                "(a takeover changes only what this rank sends; training is not touched)",
                config.rank,
                "starts sending" if want else "stops sending",
                f"the collector reports ranks {_ranks_text(takeover.silent)} silent"
                if takeover.silent
                else "the collector reports every rank back",
            )
        self._want_layers = want

    def _switch_layers(self) -> None:
        """Training thread, after a commit: send layers from the next step on, or stop.

        A failure (no memory for the other mode's rows) switches takeovers off
        for this rank, says so (``AgentDegraded``), and monitoring goes on as it was.
        """
        try:
            self._switch()
        except Exception as exc:
            self._no_takeover = True
            self._want_layers = self._mode.reports
            self._degrade(
                Notice(
                    "takeover (sending a silent reporter's per-layer norms)",
                    f"switching failed: {type(exc).__name__}: {exc}; this rank keeps "
                    "sending what it sent, another replica may still take over",
                )
            )

    def _switch(self) -> None:
        current = self._mode
        self._buffer.flush()  # steps logged so far go out under their own schema
        if self._wstats is not None:
            for done in self._wstats.finish():  # device reads, queued: no wait
                self._queue_stats(done)
        if self._acts is not None:
            self._acts.disarm()
        current.scratch = self._scratch  # _read_grads may have made a new one
        current.wstats, current.acts = self._wstats, self._acts
        other = self._other_mode
        if other is None:
            other = self._layer_mode(not current.reports, pool_size=0)
            other.buffer.pool = self._buffer.pool  # the shipper returns host buffers there
        self._other_mode = current
        self._use_mode(other)
        self._wstats, self._acts = other.wstats, other.acts
        if other.reports and self._wstats is None and self.config.stats_every:
            self._wstats = self._weight_stats()


def _layer_scales(
    model: torch.nn.Module,
    params: tuple[torch.nn.Parameter, ...],
    layout: Any,
    device: torch.device,
) -> torch.Tensor | None:
    """Per watched layer, the factor its norms are sent with (agent/topology.share_scales:
    a copy held whole by every rank of a shard group counts once), or None (all 1)."""
    scales = share_scales(model, layout)
    if scales is None:
        return None
    factor = {id(p): s for (_, p), s in zip(model.named_parameters(), scales, strict=True)}
    return torch.tensor(
        [factor.get(id(p), 1.0) for p in params], dtype=torch.float32, device=device
    )


def _ranks_text(ranks: frozenset[int], most: int = 8) -> str:
    shown = sorted(ranks)[:most]
    more = f" and {len(ranks) - most} more" if len(ranks) > most else ""
    return ", ".join(map(str, shown)) + more
