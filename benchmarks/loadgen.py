"""Sender processes for ``collector_load.py``: simulated agents on loopback.

One ``sender_main`` process owns one PUSH socket per simulated rank, set up as
the agent's shipper sets its own (``SNDHWM`` 16, ``IMMEDIATE`` 1, ``LINGER``
0, every send ``NOBLOCK``; a send that would block drops the batch and counts
its steps, as ``agent/shipper.py`` does). Ranks step in lockstep (one job) at
``step_rate`` steps/s and flush every ``flush_every`` steps: a batch of
``flush_every`` rows, built with ``gradwatch.wire.encode`` exactly as an agent
builds it (schema attached to the first batch, after a failed send and every
``schema_every_s``; ``shards`` declared in every batch, so the collector
assembles each step across ranks: ``world`` = FSDP, each rank one shard; 1 =
DDP, any rank holds the whole gradient), plus a heartbeat per rank every
``heartbeat_every`` s at a per-rank phase.

Under a 3D layout (``places``: per rank, its pipeline stage and whether it is
its model shard's reporter, agent/topology.reports_layers) a reporter sends its
stage's layers (named apart per stage) and every other rank a batch with no
layers, only its loss, lr, skipped and the ``s/grad_nonfinite`` flag, as an
agent with ``watch(layout=...)`` does.

*Probes* are NaNs in the job's own stream, planned by the parent before the
start: for each ``(step, rank)`` in ``probes``, that rank's row of that step
has a NaN loss and NaN first layers, as a rank whose forward pass blew up
would log; its batch carries the header's ``nonfinite`` hint, as the agent's
shipper sets it (``flag_probes=False``: as an agent without the hint sends it).
When the batch carrying it has been handed to its socket, the sender reports
the agent-side time of that step (its ``times`` entry) and the time of the send.

*Cost.* Two processes push a whole job's flush on the collector's own cores,
which no real job does (each rank ships from its own host). So each flush's
values are made for all ranks in one numpy call and each header is patched from
the rank's :class:`HeaderTemplate` (the agent's encoder's bytes, tested), and
the time to push one flush is reported per flush (``burst_send_s``).

Protocol with the parent (multiprocessing queues):
  parent -> cmd:  ("go", t0) | ("exit",)
  sender -> res:  ("ready", sid, n_connected) | ("probe", step, rank, t_agent, t_send, ok) |
                  ("done", sid, stats_dict) | ("error", sid, text)

Example (what ``collector_load.py`` does per sender process)::

    p = ctx.Process(target=sender_main, args=(0, "tcp://127.0.0.1:5555", "load", 8, 8,
                    [0, 2, 4, 6], 100, 1.0, 10, 60.0, 2.0, [(23, 4)], cmd, res))
"""

from __future__ import annotations

import heapq
import json
import os
import queue
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from gradwatch.wire import Batch, Heartbeat, Schema, encode, encode_batch, encode_schema

COLUMNS = ("loss", "lr/0", "skipped")
QUIET_COLUMNS = (*COLUMNS, "s/grad_nonfinite")  # a replica that sends no layers
SEND_HWM = 16  # AgentConfig.send_hwm
SCHEMA_EVERY_S = 30.0  # AgentConfig.schema_every_s
WARMUP_TIMEOUT_S = 30.0
CONNECT_CHUNK = 256
WARMUP_PER_RANK_S = 0.015  # 8,192 sockets per sender took ~40 s to connect on 2 busy cores
POISONED_LAYERS = 3  # a probe's NaN layers: the first ones, where a blow-up shows first


_JSON = {"separators": (",", ":"), "allow_nan": False}


class HeaderTemplate:
    """One rank's batch header, built once; per flush only seq, dropped, steps, times change.

    The senders simulate thousands of hosts on the collector's own cores, so what
    they spend per batch is an artifact of the simulation, not a cost of the
    collector. The fixed parts of the header are formatted once as the agent's
    encoder formats them (``wire.encode_batch``: the same keys, order and JSON
    separators); ``steps_times`` is shared by every rank of a flush (lockstep).
    tests/collector/test_loadgen_template.py checks the bytes against the encoder.
    """

    def __init__(
        self, job: str, rank: int, world: int, schema_id: int, inc: str, shards: int | None
    ) -> None:
        probe = Batch(job, rank, world, schema_id, 0, inc, 0, (0,), (0.0,), b"", None, shards)
        preamble = encode_batch(probe)[0][:4]  # magic, version, kind: as the encoder writes them
        fixed = {"job": job, "rank": rank, "world": world, "schema": schema_id}
        self._head = preamble + json.dumps(fixed, **_JSON)[:-1].encode() + b',"seq":'
        self._inc = b"," + json.dumps({"inc": inc}, **_JSON)[1:-1].encode() + b',"dropped":'
        tail = b"" if shards is None else b',"shards":' + str(shards).encode()
        self._tail = (tail + b"}", tail + b',"nonfinite":1}')

    @staticmethod
    def steps_times(steps: Sequence[int], times: Sequence[float]) -> bytes:
        """The steps and times of a flush, encoded once for every rank."""
        return (
            b',"steps":'
            + json.dumps(list(steps), **_JSON).encode()
            + b',"times":'
            + json.dumps(list(times), **_JSON).encode()
        )

    def header(self, seq: int, dropped: int, steps_times: bytes, nonfinite: bool) -> bytes:
        """The header frame ``encode_batch`` makes for this rank's batch."""
        return b"".join(
            (
                self._head,
                str(seq).encode(),
                self._inc,
                str(dropped).encode(),
                steps_times,
                self._tail[nonfinite],
            )
        )


def layer_names(layers: int, stage: int = 0) -> tuple[str, ...]:
    """A stage's layer names; stages hold consecutive blocks, so names never repeat."""
    first = stage * layers
    return tuple(
        f"blocks.{i // 4}.{('attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2')[i % 4]}.weight"
        for i in range(first, first + layers)
    )


def poison(row: np.ndarray, quiet: bool = False) -> None:
    """Make one row (columns then layers) what a rank whose step went NaN logs."""
    row[0] = np.nan  # loss
    if quiet:
        row[len(COLUMNS)] = 1.0  # s/grad_nonfinite
    else:
        row[len(COLUMNS) : len(COLUMNS) + POISONED_LAYERS] = np.nan  # first layers went bad


def sender_main(
    sid: int,
    endpoint: str,
    job: str,
    world: int,
    shards: int,
    ranks: list[int],
    layers: int,
    step_rate: float,
    flush_every: int,
    duration: float,
    heartbeat_every: float,
    probes: list[tuple[int, int]],
    cmd: Any,
    res: Any,
    places: list[tuple[int, bool]] | None = None,
    flag_probes: bool = True,
) -> None:
    try:
        _Sender(
            sid,
            endpoint,
            job,
            world,
            shards,
            ranks,
            layers,
            step_rate,
            flush_every,
            duration,
            heartbeat_every,
            probes,
            cmd,
            res,
            places,
            flag_probes,
        ).run()
    except BaseException:
        res.put(("error", sid, traceback.format_exc()))


class _Sender:
    def __init__(
        self,
        sid: int,
        endpoint: str,
        job: str,
        world: int,
        shards: int,
        ranks: list[int],
        layers: int,
        step_rate: float,
        flush_every: int,
        duration: float,
        heartbeat_every: float,
        probes: list[tuple[int, int]],
        cmd: Any,
        res: Any,
        places: list[tuple[int, bool]] | None = None,
        flag_probes: bool = True,
    ) -> None:
        self.flag_probes = flag_probes  # False: an agent without the nonfinite hint
        self.sid, self.endpoint, self.job, self.world, self.shards = (
            sid,
            endpoint,
            job,
            world,
            shards,
        )
        self.ranks, self.layers = ranks, layers
        self.step_rate, self.flush_every, self.duration = step_rate, flush_every, duration
        self.heartbeat_every = heartbeat_every
        local = {rank: i for i, rank in enumerate(ranks)}
        # (local rank index, step) -> the probe's rank; only this sender's ranks.
        self.probes = {(local[rank], step): rank for step, rank in probes if rank in local}
        self.cmd, self.res = cmd, res
        # Per rank: (stage, reports layers); one Schema object per stage, shared, as ingest does.
        self.places = places or [(0, True)] * len(ranks)
        stages = {stage for stage, _ in self.places}
        by_stage = {s: Schema(id=0, columns=COLUMNS, layers=layer_names(layers, s)) for s in stages}
        quiet = Schema(id=0, columns=QUIET_COLUMNS, layers=())
        self.schemas = [by_stage[s] if reports else quiet for s, reports in self.places]
        self.incs = [f"{os.getpid():x}-{r}" for r in ranks]
        self.templates = [
            HeaderTemplate(job, r, world, 0, inc, shards)
            for r, inc in zip(ranks, self.incs, strict=True)
        ]
        self.schema_frames = {id(s): encode_schema(s) for s in self.schemas}
        self.quiet = [i for i, (_, reports) in enumerate(self.places) if not reports]
        self.seq = [0] * len(ranks)
        self.schema_sent = [-1e18] * len(ranks)  # monotonic time the schema last travelled
        self.dropped = [0] * len(ranks)  # cumulative steps not shipped, per rank
        rng = np.random.default_rng(1000 + sid)
        # Healthy, stationary gradients: a per-layer level in [0.5, 2] times 5% noise
        # (reporters only: the others send no layers).
        reporters = [i for i, (_, reports) in enumerate(self.places) if reports]
        self.base = dict(
            zip(
                reporters,
                rng.uniform(0.5, 2.0, size=(len(reporters), layers)).astype("<f4"),
                strict=True,
            )
        )
        self.noise = (1.0 + 0.05 * rng.standard_normal((flush_every * 8, layers))).astype("<f4")
        self.rng = rng
        self.stats = {
            "batches_sent": 0,
            "steps_sent": 0,
            "values_sent": 0,
            "batches_eagain": 0,
            "steps_eagain": 0,
            "bytes_sent": 0,
            "heartbeats_sent": 0,
            "heartbeats_eagain": 0,
            "probes_sent": 0,
            "probes_eagain": 0,
            "max_flush_lag_s": 0.0,
            "max_burst_send_s": 0.0,
            "burst_send_s": [],  # per flush: seconds to push every rank's batch
            "last_step": -1,
        }

    # ------------------------------------------------------------ setup

    def _connect(self) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, len(self.ranks) + 64)
        self.socks = []
        for _ in self.ranks:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, SEND_HWM)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.LINGER, 0)
            self.socks.append(s)

    def _warm_up(self) -> int:
        """Connect, CONNECT_CHUNK sockets at a time, each until a heartbeat goes (IMMEDIATE=1).

        Thousands of connects at once overflow the listener's accept backlog, and
        the refused ones back off for seconds; a job's ranks start over minutes anyway.
        """
        deadline = time.monotonic() + max(WARMUP_TIMEOUT_S, WARMUP_PER_RANK_S * len(self.ranks))
        connected = 0
        for start in range(0, len(self.ranks), CONNECT_CHUNK):
            chunk = range(start, min(start + CONNECT_CHUNK, len(self.ranks)))
            pending = set(chunk)
            for i in chunk:
                self.socks[i].connect(self.endpoint)
            while pending and time.monotonic() < deadline:
                for i in list(pending):
                    if self._heartbeat(i, step=-1, count=False):
                        pending.discard(i)
                if pending:
                    time.sleep(0.02)
            connected += len(chunk) - len(pending)
        return connected

    # ------------------------------------------------------------ sends

    def _send(self, i: int, frames: list[bytes]) -> bool:
        try:
            self.socks[i].send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.schema_sent[i] = -1e18  # as the shipper: the next batch carries the schema
            return False

    def _heartbeat(self, i: int, step: int, count: bool = True) -> bool:
        hb = Heartbeat(
            job=self.job,
            rank=self.ranks[i],
            world=self.world,
            incarnation=self.incs[i],
            time=time.time(),
            step=step,
            dropped=self.dropped[i],
        )
        ok = self._send(i, encode(hb))
        if count:
            self.stats["heartbeats_sent" if ok else "heartbeats_eagain"] += 1
        return ok

    def _flush(self, first_step: int, t0: float) -> None:
        """Every rank's batch of one flush: values made for all ranks at once, headers
        patched from each rank's template (as the agent's encoder would write them)."""
        fe = self.flush_every
        steps = tuple(range(first_step, first_step + fe))
        times = tuple(t0 + s / self.step_rate for s in steps)
        shared = HeaderTemplate.steps_times(steps, times)
        loss = 2.0 * np.exp(-np.array(steps) / 5000.0)
        quiet = np.empty((len(self.quiet), fe, len(QUIET_COLUMNS)), dtype="<f4")
        quiet[:, :, 0] = loss + 0.01 * self.rng.random((len(self.quiet), fe))
        quiet[:, :, 1], quiet[:, :, 2], quiet[:, :, 3] = 1e-4, 0.0, 0.0  # lr, skipped, flag
        rows = dict(zip(self.quiet, quiet, strict=True))
        for i in range(len(self.ranks)):
            vals = rows.get(i)
            if vals is None:  # a reporter: its stage's layer norms
                vals = np.empty((fe, self.schemas[i].width), dtype="<f4")
                vals[:, 0] = loss + 0.01 * self.rng.random(fe)
                vals[:, 1], vals[:, 2] = 1e-4, 0.0
                off = int(self.rng.integers(0, self.noise.shape[0] - fe + 1))
                np.multiply(self.base[i], self.noise[off : off + fe], out=vals[:, len(COLUMNS) :])
            self._send_batch(i, steps, times, shared, vals)

    def _send_batch(
        self, i: int, steps: tuple[int, ...], times: tuple[float, ...], shared: bytes, vals: Any
    ) -> None:
        probed = [(row, step) for row, step in enumerate(steps) if (i, step) in self.probes]
        for row, _ in probed:
            poison(vals[row], quiet=i not in self.base)
        schema = self.schemas[i]
        now = time.monotonic()
        attach = now - self.schema_sent[i] >= SCHEMA_EVERY_S
        # The agent's shipper hints a batch holding a NaN/Inf (agent/layout.has_nonfinite);
        # these values have no MISSING cells, so "not all finite" is the same test.
        flag = bool(probed) and self.flag_probes and not np.isfinite(vals).all()
        header = self.templates[i].header(self.seq[i], self.dropped[i], shared, flag)
        values = vals.tobytes()
        frames = [header, self.schema_frames[id(schema)], values] if attach else [header, values]
        ok = self._send(i, frames)
        t_send = time.time()
        fe = len(steps)
        if ok:
            self.seq[i] += 1
            if attach:
                self.schema_sent[i] = now
            self.stats["batches_sent"] += 1
            self.stats["steps_sent"] += fe
            self.stats["values_sent"] += fe * len(schema.layers)
            self.stats["bytes_sent"] += sum(len(f) for f in frames)
        else:
            self.dropped[i] += fe
            self.stats["batches_eagain"] += 1
            self.stats["steps_eagain"] += fe
        for row, step in probed:
            self.stats["probes_sent" if ok else "probes_eagain"] += 1
            self.res.put(("probe", step, self.ranks[i], times[row], t_send, ok))

    # ------------------------------------------------------------ main loop

    def run(self) -> None:
        self._connect()
        try:
            connected = self._warm_up()
            self.res.put(("ready", self.sid, connected))
            msg = self.cmd.get()
            if msg[0] != "go":
                return
            t0 = float(msg[1])
            stop = self._loop(t0)
            self.res.put(("done", self.sid, self.stats))
            if stop:
                return
            # Keep the sockets open (what is queued in them still reaches the
            # collector) until the parent has measured the drain.
            while self.cmd.get()[0] != "exit":
                pass
        finally:
            for s in self.socks:
                s.close(linger=0)
            self.ctx.term()

    def _loop(self, t0: float) -> bool:
        """Run the schedule until ``duration`` is over; True if told to exit early."""
        fe, rate = self.flush_every, self.step_rate
        end = t0 + self.duration
        flush_k = 0

        def flush_time(k: int) -> float:  # the flush happens when its last step is logged
            return t0 + ((k + 1) * fe - 1) / rate

        n = len(self.ranks)
        beats = [(t0 + self.heartbeat_every * (j + 0.5) / n, j) for j in range(n)]
        heapq.heapify(beats)
        while True:
            now = time.time()
            if flush_time(flush_k) <= min(now, end):
                lag = now - flush_time(flush_k)
                self.stats["max_flush_lag_s"] = max(self.stats["max_flush_lag_s"], lag)
                started = time.monotonic()
                self._flush(flush_k * fe, t0)
                took = time.monotonic() - started
                self.stats["burst_send_s"].append(took)
                self.stats["max_burst_send_s"] = max(self.stats["max_burst_send_s"], took)
                self.stats["last_step"] = (flush_k + 1) * fe - 1
                flush_k += 1
                continue
            if now >= end:
                return False
            while beats and beats[0][0] <= now:
                due, j = heapq.heappop(beats)
                self._heartbeat(j, step=max(-1, int((now - t0) * rate)))
                heapq.heappush(beats, (due + self.heartbeat_every, j))
            nxt = min(flush_time(flush_k), end, beats[0][0] if beats else end)
            wait = max(0.0, min(nxt - time.time(), 0.05))
            try:
                msg = self.cmd.get(timeout=wait) if wait > 0 else self.cmd.get_nowait()
            except queue.Empty:
                continue
            if msg[0] == "exit":
                return True
