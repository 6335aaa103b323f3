"""The shipper thread: turns flushed buffers into wire messages and sends them.

Everything that may wait lives here, never on the training thread: waiting
for the device-to-host copy (``event.synchronize()``), reading host values,
encoding, and the ZeroMQ send. The socket is a PUSH with ``IMMEDIATE=1`` (no
queueing for a peer that is not connected), a small ``SNDHWM`` and
``LINGER=0``; every send is ``NOBLOCK`` and a full pipe drops the batch and
counts its steps. Memory is bounded by the host-buffer pool and the queue.

Schema resend policy: the schema frame rides on the first batch, on any batch
whose schema id differs from the last one sent, on the first batch after each
ZeroMQ handshake (a socket monitor reports ``EVENT_HANDSHAKE_SUCCEEDED``, so a
restarted collector relearns the layer names at once), and on the first batch
after ``schema_every_s`` seconds without one. The same monitor reports a
refused handshake (a CurveZMQ key the collector does not allow, or CURVE on
one side only): logged once, since ZeroMQ retries it at every reconnect.
With several endpoints (an HA pair of collectors, agent/destinations.py) each
has its own socket and its own schema state, and every message goes to each.

Example (what ``watch()`` does; nothing needs to listen)::

    >>> import queue
    >>> from gradwatch.agent.config import AgentConfig
    >>> from gradwatch.agent.items import Counters
    >>> from gradwatch.agent.shipper import Shipper
    >>> cfg = AgentConfig(job="doc", rank=0, world=1, endpoint="tcp://127.0.0.1:1")
    >>> shipper = Shipper(cfg, "abc123", queue.Queue(8), queue.Queue(8), Counters(),
    ...                   last_step=lambda: 0)
    >>> shipper.start()
    >>> shipper.stop(timeout=2.0)
    True
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import zmq

from gradwatch.agent.commands import CommandReceiver, Rollback
from gradwatch.agent.config import AgentConfig, CurveKeys, load_curve_keys, split_endpoints
from gradwatch.agent.destinations import Destination
from gradwatch.agent.holdback import RETRY_S, Holdback, Kept
from gradwatch.agent.hostpart import HostPart, MissingPart
from gradwatch.agent.items import (
    BufferPool,
    Counters,
    EventItem,
    FlushItem,
    Reincarnate,
    StatsItem,
)
from gradwatch.agent.layout import MISSING_LE, fill_norms, has_nonfinite, le_bytes, merge_rows
from gradwatch.agent.takeover_command import Takeover
from gradwatch.agent.workqueue import WorkQueue
from gradwatch.wire import (
    Batch,
    Event,
    Heartbeat,
    Schema,
    encode_batch,
    encode_event,
    encode_heartbeat,
)
from gradwatch.wire import columns as wc
from gradwatch.wire.census import Census

logger = logging.getLogger(__name__)

_STOP = object()
# With a command socket, the thread looks at it at least this often.
COMMAND_POLL_S = 0.1
FIRST_BEAT_RETRY_S = 0.05  # until the first heartbeat gets through
# How long a send may wait for room in a full pipe to a peer that was taking messages
# (agent/destinations.py): long enough for a starved I/O thread to get a core, short
# enough that a stuck collector costs the shipper little.
FULL_PIPE_WAIT_S = 0.05


class Shipper:
    """Owns the ZeroMQ context and socket and the daemon thread that uses them.

    The socket is created and connected here, on the caller's thread, so a
    malformed endpoint fails ``watch()`` at once; the thread start is the
    memory barrier ZeroMQ asks for when a socket changes threads.
    """

    def __init__(
        self,
        config: AgentConfig,
        incarnation: str,
        work: WorkQueue | queue.Queue[Any],
        pool: BufferPool,
        counters: Counters,
        last_step: Callable[[], int],
        on_failure: Callable[[str, BaseException], None] | None = None,
        on_command: Callable[[Rollback], None] | None = None,
        started: Callable[[], int] | None = None,
        on_takeover: Callable[[Takeover], None] | None = None,
    ) -> None:
        self._cfg = config
        self._inc = incarnation
        self._work = work
        self._pool = pool
        self._counters = counters
        self._last_step = last_step
        self._started = started  # the heartbeat's "started": see wire.Heartbeat
        self._on_failure = on_failure
        # A bad key setup switches monitoring off (the thread reports it through
        # on_failure); it never raises into training nor falls back to plain text.
        self._key_error: ValueError | None = None
        curve: CurveKeys | None = None
        try:
            curve = load_curve_keys(config)
        except ValueError as exc:
            self._key_error = exc
        self._ctx = zmq.Context(io_threads=1)
        self._dests: list[Destination] = []
        for endpoint in split_endpoints(config.endpoint):
            try:
                self._dests.append(Destination(self._ctx, endpoint, config.send_hwm, curve))
                if self._key_error is None:
                    self._dests[-1].connect()
            except zmq.ZMQError as exc:
                self._ctx.destroy(linger=0)
                raise ValueError(f"cannot connect to endpoint {endpoint!r}: {exc}") from exc
        self._commands: CommandReceiver | None = None
        if (
            on_command is not None
            and config.command_endpoint
            and config.command_key
            and self._key_error is None
        ):
            try:
                self._commands = CommandReceiver(
                    self._ctx,
                    config.command_endpoint,
                    config.job,
                    config.command_key,
                    on_command,
                    curve=curve,
                    report=self._report_note,
                    on_takeover=on_takeover,
                )
            except ValueError as exc:  # a rollback feature problem never stops monitoring
                logger.error("gradwatch: %s; rollback commands are off for this run", exc)
        self._stale_logged = False
        self._part_failed = False  # a cadence statistic could not be worked out (logged once)
        self._seq = 0  # batches of any schema sent by this incarnation
        self._dropped_before = 0  # steps dropped by earlier incarnations (_reincarnate)
        self._stats_schema: Schema | None = None
        self._deadline = math.inf
        # A batch with a NaN or Inf that no collector took, sent before any later one.
        self._held = Holdback(self._send_steps, counters)
        self._thread = threading.Thread(target=self._run, name="gradwatch-shipper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def command_counts(self) -> tuple[int, int]:
        """Commands accepted and refused (all reasons) so far; (0, 0) without a socket."""
        commands = self._commands
        if commands is None:
            return 0, 0
        return commands.accepted, sum(commands.refused.values())

    def on_its_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float) -> bool:
        """Ask the thread to send what is queued and exit; True if it did in time."""
        end = time.monotonic() + timeout
        self._deadline = end
        try:
            self._work.put(_STOP, timeout=max(0.0, timeout / 2))
        except queue.Full:
            pass  # the thread is busy draining; it also sees the deadline
        self._thread.join(max(0.0, end - time.monotonic()))
        return not self._thread.is_alive()

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            if self._key_error is not None:
                raise self._key_error
            self._loop()
        except Exception as exc:  # never let a bug here go unseen or reach training
            if self._on_failure is not None:
                what = (
                    "loading the CurveZMQ keys (fix the key settings; nothing was sent)"
                    if exc is self._key_error
                    else "shipping batches (the shipper thread)"
                )
                self._on_failure(what, exc)
        finally:
            self._discard_queued()
            self._shutdown()

    def _loop(self) -> None:
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_beat:
                sent = self._heartbeat()
                # Until the first heartbeat is through (the connection is still being
                # made), retry soon: the collector learns which ranks run before their
                # first steps arrive, and waits for each of them when assembling.
                first = not sent and self._counters.heartbeats_sent == 0
                next_beat = now + (
                    min(FIRST_BEAT_RETRY_S, self._cfg.heartbeat_every)
                    if first
                    else self._cfg.heartbeat_every
                )
            if now >= self._deadline:
                return
            wait = min(next_beat, self._deadline) - now
            if self._commands is not None:
                self._commands.poll()
                wait = min(wait, COMMAND_POLL_S)
            if self._held.kept is not None:
                wait = min(wait, RETRY_S)
                if self._held.due(now):
                    self._held.clear()  # the loop may have stopped logging after the NaN
            try:
                item = self._work.get(timeout=wait)
            except queue.Empty:
                continue
            if item is _STOP:
                self._held.clear()  # with the closing wait (_wait_s)
                return
            for dest in self._dests:
                dest.watch()  # handshakes (a schema to resend) and refused keys
            if isinstance(item, FlushItem):
                self._ship_batch(item)
            elif isinstance(item, StatsItem):
                self._ship_stats(item)
            elif isinstance(item, Reincarnate):
                self._reincarnate(item.incarnation)
            else:
                self._ship_event(item)

    def _reincarnate(self, incarnation: str) -> None:
        """Continue as a new incarnation (after a rollback): the collector then treats the
        rewound step numbers as a fresh start, not as a stall, and relearns the schema.
        ``dropped`` counts per incarnation (docs/wire.md), the old one's final count sent
        in a heartbeat: the collector adds up the incarnations of a job. A kept batch
        (agent/holdback.py) belongs to the old incarnation: sent now or counted dropped."""
        if not self._held.clear():
            self._held.give_up()
        self._heartbeat()
        self._dropped_before = self._counters.steps_dropped
        self._inc = incarnation
        self._seq = 0
        for dest in self._dests:
            dest.schema_sent.clear()
        self._heartbeat()

    def _discard_queued(self) -> None:
        """Count what is still queued at exit as dropped, so every step is accounted for."""
        self._held.give_up()
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, FlushItem):
                self._counters.steps_dropped_send += item.rows
                if item.buf is not None:
                    self._pool.put_nowait(item.buf)
            elif isinstance(item, EventItem):
                with self._counters.lock:
                    self._counters.events_dropped += 1
            elif isinstance(item, StatsItem):
                with self._counters.lock:
                    self._counters.stats_dropped += 1

    def _send(self, frames: list[bytes]) -> bool:
        """Send to every collector; True if at least one took it."""
        wait = self._wait_s()
        sent = False
        for dest in self._dests:
            sent = dest.send(frames, wait) or sent
        return sent

    def _wait_s(self) -> float:
        """How long a send may wait for room in a full pipe: closing, half the time left
        before the close deadline (the last steps are what shows how a run ended; the
        other half is the linger that lets the other peer of an HA pair, or this one,
        take what is queued); running, briefly (agent/destinations.py)."""
        if math.isfinite(self._deadline):
            return max(0.0, self._deadline - time.monotonic()) / 2
        return FULL_PIPE_WAIT_S

    def _ship_batch(self, item: FlushItem) -> None:
        stale = [0]
        try:
            values = merge_rows(item.layout, self._host_rows(item), item.host_rows, stale)
        finally:
            if item.buf is not None:
                self._pool.put_nowait(item.buf)
        if stale[0] and not self._stale_logged:
            self._stale_logged = True
            logger.warning(
                "gradwatch: %d logged loss value(s) were changed in place after "
                "log() and before the agent read them, so they were not sent; "
                "log a copy (loss.detach().clone()) if the loop reuses that "
                "tensor",
                stale[0],
            )
        counters = self._counters
        if not self._held.clear():
            # An earlier batch with a NaN or Inf still finds no collector, and nothing
            # may overtake it (agent/holdback.py): no collector would take this one either.
            counters.steps_dropped_send += item.rows
            return
        batch = Kept(item.layout.schema, item.steps, item.times, values)
        flag = has_nonfinite(values)
        if self._send_steps(batch, flag):
            return
        if flag:
            self._held.keep(batch)
        else:
            counters.steps_dropped_send += item.rows

    def _send_steps(self, batch: Kept, nonfinite: bool = True) -> bool:
        """Send a batch of steps, counted as sent when a collector took it."""
        if not self._send_batch(
            batch.schema, batch.steps, batch.times, batch.values, nonfinite=nonfinite
        ):
            return False
        self._counters.batches_sent += 1
        self._counters.steps_sent += len(batch.steps)
        return True

    def _ship_stats(self, item: StatsItem) -> None:
        try:
            self._send_stats(item)
        finally:
            item.shipped = True  # the training thread may queue another (MAX_STATS_IN_FLIGHT)

    def _send_stats(self, item: StatsItem) -> None:
        if item.ready is not None:
            item.ready.synchronize()  # this thread may wait; training never does
        values = item.values.cpu()
        if item.parts:
            # The activation and update-ratio cells, worked out here from host copies.
            values = torch.cat([*(self._part_values(part) for part in item.parts), values])
        schema = self._stats_schema
        columns = (wc.WEIGHT_NORMS, *item.columns)
        if schema is None or schema.layers != item.layers or schema.columns != columns:
            schema = self._stats_schema = Schema(wc.STATS_SCHEMA_ID, columns, item.layers)
        # The marker column carries no value; bytes joined, not tensor ops (GIL time).
        row = MISSING_LE + le_bytes(values)
        if self._send_batch(schema, [item.step], [item.time], row, census=item.census):
            self._counters.stats_sent += 1
        else:
            with self._counters.lock:
                self._counters.stats_dropped += 1

    def _part_values(self, part: HostPart) -> torch.Tensor:
        """A part's cells; MISSING (and one warning) when working them out fails."""
        try:
            return part.values()
        except Exception as exc:  # an optional statistic: the sample ships without it
            if not self._part_failed:
                self._part_failed = True
                logger.warning(
                    "gradwatch: working out cadence statistics (%s) failed: %s: %s; "
                    "they are sent as not measured. Please report it with your torch version",
                    type(part).__name__,
                    type(exc).__name__,
                    exc,
                )
            return MissingPart(part.width).values()

    def _send_batch(
        self,
        schema: Schema,
        steps: list[int],
        times: list[float],
        values: bytes,
        census: Census | None = None,
        nonfinite: bool = False,
    ) -> bool:
        """Send one batch to every collector, attaching ``schema`` for those that may not
        know it; True if at least one took it."""
        now = time.monotonic()
        cfg = self._cfg
        batch = Batch(
            job=cfg.job,
            rank=cfg.rank,
            world=cfg.world,
            schema_id=schema.id,
            seq=self._seq,
            incarnation=self._inc,
            dropped=self._counters.steps_dropped - self._dropped_before,
            steps=tuple(steps),
            times=tuple(times),
            values=values,
            schema=None,
            shards=cfg.shards,
            census=census,
            nonfinite=nonfinite,
        )
        encoded: dict[bool, list[bytes]] = {}  # with / without the schema, made once each
        wait = self._wait_s()
        sent = False
        for dest in self._dests:
            last = dest.schema_sent.get(schema.id)
            attach = last is None or now - last >= cfg.schema_every_s
            if attach not in encoded:
                encoded[attach] = encode_batch(replace(batch, schema=schema) if attach else batch)
            if dest.send(encoded[attach], wait):
                sent = True
                if attach:
                    dest.schema_sent[schema.id] = now
        if sent:
            self._seq += 1
        return sent

    def _host_rows(self, item: FlushItem) -> torch.Tensor:
        if item.ready is not None:
            item.ready.synchronize()  # this thread may wait; training never does
        if item.device_copy is not None:
            return item.device_copy.cpu()
        assert item.buf is not None
        rows = item.buf[: item.rows * item.width].view(item.rows, item.width)
        if item.norms is not None:
            fill_norms(rows, item.norms, item.layout.n_layers)
        return rows

    def _report_note(self, step: int, fields: dict[str, Any]) -> None:
        self._ship_event(EventItem("note", step, fields))  # e.g. a refused rollback

    def _ship_event(self, item: EventItem) -> None:
        if item.kind == "checkpoint" and self._commands is not None:
            self._commands.vouch(item.step, item.fields.get("path"))  # rollback targets
        cfg = self._cfg
        event = Event(
            job=cfg.job,
            rank=cfg.rank,
            incarnation=self._inc,
            time=item.time,
            kind=item.kind,
            step=item.step,
            fields=item.wire_fields(),
        )
        if self._send(encode_event(event)):
            self._counters.events_sent += 1
        else:
            with self._counters.lock:
                self._counters.events_dropped += 1

    def _heartbeat(self) -> bool:
        cfg = self._cfg
        hb = Heartbeat(
            job=cfg.job,
            rank=cfg.rank,
            world=cfg.world,
            incarnation=self._inc,
            time=time.time(),
            step=self._last_step(),
            dropped=self._counters.steps_dropped - self._dropped_before,
            started=self._started() if self._started is not None else None,
        )
        if self._send(encode_heartbeat(hb)):
            self._counters.heartbeats_sent += 1
            return True
        return False

    def _shutdown(self) -> None:
        """Close with a linger bounded by the close deadline, then terminate.

        ``LINGER=0`` while running means an abandoned socket never hangs
        ``term()``; at close the last batch deserves a short chance to leave.
        """
        linger_ms = 0
        if math.isfinite(self._deadline):
            linger_ms = max(0, int((self._deadline - time.monotonic()) * 1000))
        try:
            for dest in self._dests:
                dest.close(linger_ms)
            if self._commands is not None:
                self._commands.close()
            self._ctx.term()
        except zmq.ZMQError as exc:  # nothing left to protect; do not raise in a thread
            logger.debug("gradwatch: closing the ZeroMQ socket failed: %s", exc)
