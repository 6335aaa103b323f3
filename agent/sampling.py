"""Cadence samples on the training thread: which step carries which part, and queueing.

:class:`Sampler` is the part of the monitor (a mixin of
:class:`~gradwatch.agent.recording.StepRecorder`) that decides, at each
``log()``, whether the next step carries cadence statistics and which part of
a spread sample (agent/spreadplan.py), arms the activation hooks its forward
needs, does the part's work after the update (the gathers, the weight-norm
slices) and queues a complete sample for the shipper: device vectors for a
sample measured whole (the dense start), host copies the shipper works out for
a spread one (agent/hostpart.py). The schedule is agent/cadence.py's; the
pre-hook's share (the gathers before the update) is ``StepRecorder._before_update``.
"""

from __future__ import annotations

import queue

import torch

from gradwatch.agent.failsafe import to_host_async
from gradwatch.agent.hostpart import DevicePart, HostPart, MissingPart
from gradwatch.agent.items import MAX_STATS_IN_FLIGHT, StatsItem
from gradwatch.agent.layout import fill_missing
from gradwatch.agent.rollback_exit import RollbackExit
from gradwatch.agent.spreadplan import Part, plan
from gradwatch.agent.weightstats import Round, WeightStats


class Sampler(RollbackExit):
    """Cadence samples: the part each step carries, its work, and queueing (training
    thread only); see the module docstring."""

    def _next_sample(self, ws: WeightStats) -> None:
        """Decide whether the next step carries cadence statistics, and which part of a
        spread sample; arm the activation hooks it measures for its forward pass.

        A sample is measured whole on its step where samples come close together
        (the dense start, agent/cadence.py), and spread a unit of work per step
        (agent/spreadplan.py) where the next is at least ``ws.phases`` steps away:
        the same statistics, while no step pays more than its share of them.
        """
        last = ws.waiting[-1] if ws.waiting else None
        if last is not None and last.spread and last.phase < len(last.parts):
            # The next step carries the next part; the schedule waits until it ships.
            self._stats_now, self._spread_phase = True, last.phase
        else:
            cadence, step = self._cadence, self._step + 1
            self._stats_now = (cadence.forced or step >= cadence.next_step) and cadence.due(step)
            gap = cadence.next_step - step
            if self._stats_now and gap >= ws.phases > 1:
                self._parts = self._spread_plan(ws, int(min(gap, 1 << 20)))
                self._spread_phase = 0
            else:
                self._spread_phase = None
        acts = self._acts
        if acts is not None and (self._stats_now or acts.armed):
            # Hooks live only for a cadence step's forward pass: armed now when
            # the next step is one, removed here at its log().
            acts.disarm()
            if self._stats_now:
                index = self._spread_phase
                if index is None:
                    acts.arm()
                else:
                    hooks_of = self._parts[index].hooks
                    if hooks_of is not None:
                        acts.arm(hooks_of, acts.groups, start=index == 0)
                    elif index == 0:
                        acts.reset()

    def _spread_plan(self, ws: WeightStats, steps: int) -> tuple[Part, ...]:
        """The parts of a sample spread over at most ``steps`` steps (cached by gap)."""
        acts = self._acts
        return plan(steps, ws.slices, ws.ratio.groups, acts.groups if acts is not None else 0)

    def _carried_part(self) -> Part | None:
        """The part of the spread sample the running step carries; None for a sample
        measured whole, or when its sample was dropped (a recovery, a takeover)."""
        index, ws = self._spread_phase, self._wstats
        if index is None or ws is None:
            return None
        if index and (not ws.waiting or not ws.waiting[-1].spread):
            return None
        return self._parts[index]

    def _cadence_work(self, now: float) -> None:
        """A cadence sample measures what only its steps can see (activations of their
        forwards, update ratios of their updates) and the weight norms, read a slice
        per step (agent/weightstats.py); a spread sample does a part of that per step
        (agent/spreadplan.py) and ships at its last, a whole one once its norms are.
        A whole sample's ratios and activation statistics are worked out on the device at
        its step; a spread one's leave as host copies for the shipper thread to work
        out (agent/hostpart.py)."""
        ws = self._wstats
        assert ws is not None
        stats, part = self._stats_now, self._carried_part()
        self._stats_now = False
        acts = self._acts
        if stats and (part is None or self._spread_phase == 0):  # a sample starts here
            columns: tuple[str, ...] = ()
            if acts is not None:
                columns = acts.columns
            n_acts = len(columns)
            if self.config.update_ratios:
                columns = (*columns, *self._ratio_columns)
            started = ws.begin(
                self._step,
                now,
                columns,
                n_acts,
                self.config.update_ratios,
                () if part is None else self._parts,
            )
            started.census = self._census.take(self._optimizer, self._reader.params)
            if part is None:  # measured whole: worked out before the next sample's hooks
                if acts is not None:
                    started.acts = acts.stats()
                if started.ratios:
                    started.ratio_values = ws.ratio.ratios(None)
        current = ws.waiting[-1] if stats and ws.waiting else None
        if part is not None and current is not None and current.ratios and part.ratios:
            ws.after(part.ratios)
        for sample in ws.advance(0 if part is None else part.weights):
            self._queue_stats(sample)
        if part is None or current is None:
            return
        current.phase += 1
        if part.copy:  # the hooks and gathers are done: taken before the next sample's
            # Host copies for the shipper to work out, unless it has not yet taken the last
            # sample's (a fast loop): then worked out here, on the device, as for a sample
            # measured whole; that bounds the copies held (MAX_STATS_IN_FLIGHT) and drops
            # nothing.
            self._stats_out = [item for item in self._stats_out if not item.shipped]
            here = len(self._stats_out) >= MAX_STATS_IN_FLIGHT
            if acts is not None and len(acts.columns) == current.n_acts:
                current.acts = acts.stats() if here else acts.export()
            if current.ratios:
                current.ratio_values = ws.ratio.compute() if here else ws.ratio.export()
        if part.ship:
            self._queue_stats(ws.take(current))

    def _queue_stats(self, done: Round) -> None:
        """Queue a complete sample's statistics without waiting for them: device vectors
        in one host copy with the weight norms, host copies (a spread sample's) for the
        shipper to work out (at most ``MAX_STATS_IN_FLIGHT`` of those: the copy step
        works a sample out on the device instead while that many are queued)."""
        values = done.norms
        assert values is not None
        if self._scales is not None and self._scales.numel() == values.numel():
            values = values * self._scales
        parts: list[torch.Tensor | HostPart] = []
        acts = self._acts
        if done.n_acts and done.acts is None and acts is not None:
            if len(acts.columns) == done.n_acts:  # a spread sample cut short (closing)
                done.acts = acts.stats()
        if done.n_acts:
            # None: switched off during the sample (a hook failed).
            parts.append(done.acts if done.acts is not None else MissingPart(done.n_acts))
        if done.ratios:
            ratios = done.ratio_values
            parts.append(ratios if ratios is not None else MissingPart(len(self._ratio_columns)))
        host: tuple[HostPart, ...] = ()
        if all(isinstance(p, torch.Tensor | MissingPart) for p in parts):  # measured whole
            tensors: list[torch.Tensor] = []
            for p in parts:
                if isinstance(p, torch.Tensor):
                    tensors.append(p)
                else:
                    tensors.append(torch.empty(p.width, device=values.device))
                    fill_missing(tensors[-1])
            if tensors:
                values = torch.cat((*tensors, values))
        else:  # spread: host copies (a device vector among them: cut short at close)
            host = tuple(DevicePart(p) if isinstance(p, torch.Tensor) else p for p in parts)
        values, ready = to_host_async(values)
        item = StatsItem(
            done.step,
            done.time,
            self._reader.names,
            values,
            ready,
            done.columns,
            done.census,  # taken at the sample's own step
            host,
        )
        try:
            self._work.put_nowait(item)
        except queue.Full:
            with self._counters.lock:
                self._counters.stats_dropped += 1
            return
        if host:
            self._stats_out.append(item)
