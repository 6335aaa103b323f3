"""Record every job the collector sees as a trace that ``gradwatch replay`` reads.

``TraceRecorder(directory)`` writes one JSON Lines file per job,
``<directory>/<job>.jsonl`` (docs/trace.md), header first, records in the
order the collector handled them. A job name is made safe for a file name
(anything but letters, digits, ``.``, ``_``, ``-`` becomes ``_``, plus a short
hash when that changed it); if the file already exists (a restarted
collector) the recorder writes ``<job>.1.jsonl``, ``<job>.2.jsonl``... rather
than append a second header. Records that come before a job's first step
(heartbeats, mostly) are held until it arrives, so the header can name the
layers that every step line aligns with.

Recording must never hurt the collector: the first write error (a full disk,
a directory turned read-only) is logged once, counted in ``errors``, and
recording switches off until the collector restarts; nothing raises to the
caller. Called from the ingest thread only.

Example::

    recorder = TraceRecorder(Path("traces"))
    recorder.step(step)
    recorder.close()
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO

from gradwatch.collector.ingest import eval_of
from gradwatch.rules.assembly import assembles
from gradwatch.rules.replay import trace_eval, trace_stats, trace_step
from gradwatch.rules.step import FLOAT32_MAX, Eval, Stats, Step
from gradwatch.wire import Event, Heartbeat
from gradwatch.wire.trace import TraceEvent, TraceHeader, TraceHeartbeat, TraceRecord, encode_record

log = logging.getLogger(__name__)

MAX_OPEN_FILES = 64
MAX_PENDING = 256  # records held per job until its first step names the layers
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def trace_file_name(job: str) -> str:
    """A file-system-safe stem for ``job``: readable, and distinct for distinct jobs."""
    safe = _UNSAFE.sub("_", job).lstrip(".") or "job"
    if safe != job:
        safe = f"{safe[:100]}-{hashlib.sha256(job.encode('utf-8')).hexdigest()[:8]}"
    return safe


class TraceRecorder:
    """Writes traces; see the module docstring. ``enabled`` turns False after a write error."""

    def __init__(self, directory: Path, max_open: int = MAX_OPEN_FILES) -> None:
        self.directory = Path(directory)
        self.enabled = True
        self.errors = 0  # write failures: at most one, since the first switches recording off
        self._max_open = max_open
        self._paths: dict[str, Path] = {}
        self._headers: dict[str, tuple[str, ...]] = {}
        self._open: OrderedDict[str, IO[str]] = OrderedDict()
        # Agents heartbeat before their first step: hold what comes first, so the header
        # can carry the first step's layer names instead of every step line carrying its own.
        self._pending: dict[str, list[Callable[[tuple[str, ...]], TraceRecord]]] = {}

    # ------------------------------------------------------------ records

    def step(self, step: Step) -> None:
        """Record one step (the first step of a job fixes its header's layers)."""
        self._write(
            step.job,
            lambda header: trace_step(step, header),
            step.layers,
            None if step.dtype_max == FLOAT32_MAX else step.dtype_max,
            first_step=True,
            topology=(step.world, step.shards) if assembles(step) else None,
            roles=step.layer_roles,
        )

    def stats(self, stats: Stats) -> None:
        """Record one cadence sample."""
        self._write(stats.job, lambda header: trace_stats(stats, header))

    def eval(self, ev: Eval) -> None:
        """Record one evaluation."""
        self._write(ev.job, lambda header: trace_eval(ev))

    def event(self, event: Event) -> None:
        """Record a wire event: ``eval`` events become eval lines, the rest event lines."""
        self._write(event.job, lambda header: _event_record(event))

    def heartbeat(self, hb: Heartbeat) -> None:
        """Record a heartbeat (replay rebuilds liveness from them)."""
        self._write(
            hb.job,
            lambda header: TraceHeartbeat(
                rank=hb.rank, time=hb.time, step=hb.step, started=hb.started
            ),
        )

    def forget(self, job: str) -> None:
        """Close a finished job's file; a later record of it starts a new file."""
        self._flush_pending(job)
        handle = self._open.pop(job, None)
        self._paths.pop(job, None)
        self._headers.pop(job, None)
        if handle is not None:
            self._close(handle)

    def close(self) -> None:
        """Write what is held, then flush and close every file."""
        for job in list(self._pending):
            self._flush_pending(job)
        while self._open:
            _, handle = self._open.popitem(last=False)
            self._close(handle)

    # ------------------------------------------------------------ internals

    def _write(
        self,
        job: str,
        build: Callable[[tuple[str, ...]], TraceRecord],
        layers: tuple[str, ...] = (),
        dtype_max: float | None = None,
        first_step: bool = False,
        topology: tuple[int, int] | None = None,
        roles: tuple[str, ...] = (),
    ) -> None:
        if not self.enabled:
            return
        if job not in self._headers and not first_step:
            pending = self._pending.setdefault(job, [])
            pending.append(build)
            if len(pending) >= MAX_PENDING:
                self._flush_pending(job)
            return
        try:
            handle = self._handle(job, layers, dtype_max, topology, roles)
            for held in self._pending.pop(job, ()):
                handle.write(encode_record(held(self._headers[job])) + "\n")
            handle.write(encode_record(build(self._headers[job])) + "\n")
        except Exception as exc:  # OSError mostly; recording must never take the collector down
            self._disable(job, exc)

    def _flush_pending(self, job: str) -> None:
        """Start ``job``'s file without a step to name its layers (none came)."""
        held = self._pending.pop(job, [])
        if not held or not self.enabled:
            return
        self._pending[job] = held[:-1]
        self._write(job, held[-1], first_step=True)  # writes the rest first, in order

    def _handle(
        self,
        job: str,
        layers: tuple[str, ...],
        dtype_max: float | None,
        topology: tuple[int, int] | None = None,
        roles: tuple[str, ...] = (),
    ) -> IO[str]:
        handle = self._open.get(job)
        if handle is not None:
            self._open.move_to_end(job)
            return handle
        path = self._paths.get(job)
        if path is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self._new_path(job)
            handle = path.open("x", encoding="utf-8", buffering=1)
            self._paths[job] = path
            self._headers[job] = tuple(layers)
            world, shards = topology if topology is not None else (None, None)
            handle.write(
                encode_record(
                    TraceHeader(
                        job=job,
                        layers=tuple(layers),
                        dtype_max=dtype_max,
                        world=world,
                        shards=shards,
                        layer_roles=roles,
                    )
                )
                + "\n"
            )
        else:
            handle = path.open("a", encoding="utf-8", buffering=1)  # reopened after LRU eviction
        self._open[job] = handle
        while len(self._open) > self._max_open:
            _, oldest = self._open.popitem(last=False)
            self._close(oldest)
        return handle

    def _new_path(self, job: str) -> Path:
        stem = trace_file_name(job)
        path = self.directory / f"{stem}.jsonl"
        n = 0
        while path.exists():
            n += 1
            path = self.directory / f"{stem}.{n}.jsonl"
        return path

    def _disable(self, job: str, exc: BaseException) -> None:
        self.enabled = False
        self.errors += 1
        where = self._paths.get(job, self.directory)
        log.error(
            "trace recording switched off: cannot write %s for job %r: %s; the collector "
            "keeps running without recording. Free disk space or fix the permissions of "
            "--record's directory, then restart the collector to record again",
            where,
            job,
            exc,
        )
        self.close()
        for path in self._paths.values():
            _drop_torn_line(path)

    def _close(self, handle: IO[str]) -> None:
        try:
            handle.close()
        except OSError as exc:
            # After a write error, the same failure again: it was already reported.
            log.log(
                logging.WARNING if self.enabled else logging.DEBUG,
                "closing a trace file failed: %s",
                exc,
            )


def _drop_torn_line(path: Path, chunk: int = 1 << 16) -> None:
    """Cut the line a full disk left half-written, so the trace still reads to its end."""
    try:
        with path.open("r+b") as handle:
            end = handle.seek(0, os.SEEK_END)
            keep, pos = 0, end
            while pos > 0:
                start = max(0, pos - chunk)
                handle.seek(start)
                newline = handle.read(pos - start).rfind(b"\n")
                if newline >= 0:
                    keep = start + newline + 1
                    break
                pos = start
            if keep < end:
                handle.truncate(keep)  # shrinking needs no space
    except OSError as exc:
        log.debug("cannot trim the last line of %s: %s", path, exc)


def _event_record(event: Event) -> TraceRecord:
    if event.kind == "eval":
        # Decoded as the engine sees it: a "nan" loss stays NaN in the trace, not None.
        return trace_eval(eval_of(event))
    fields = dict(event.fields)
    safe = {k: v for k, v in fields.items() if not (isinstance(v, float) and not math.isfinite(v))}
    return TraceEvent(
        step=event.step, kind=event.kind, rank=event.rank, time=event.time, fields=safe
    )
