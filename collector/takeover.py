"""Telling a job which ranks went silent, so a replica takes over a silent reporter's layers.

Under a declared layout (agent/topology.py) one data-parallel replica per
model shard sends per-layer gradient norms and the others send none; if that
reporter dies or loses its path to the collector, its shard's layers would be
missing from every assembled step for the rest of the run. About once a second
(:meth:`Takeovers.tick`, from ``Server.tick``) this module looks at each job's
ranks in the collector's state:

* a rank is *silent* when nothing (step, heartbeat, event) came from it for
  ``silent_seconds``: the ``silent_rank`` rule's threshold (``RankSilent``,
  60 s by default; :func:`silent_threshold`), so a takeover starts when that
  alert fires;
* a takeover *starts* when a silent rank was a reporter (its last step carried
  layers), some rank is still reporting (not all silent, not all closed: a
  finished job needs none) and some live rank sends no layers (one that can
  take over);
* while one is in force, the job's silent set is published again whenever it
  changes, and every ``repeat_s`` seconds (a rank that connects later, or
  missed a message, learns it; the agent refuses commands older than 60 s);
  when it is empty the takeover ends with one last command naming no rank;
* with none in force, every ``repeat_s`` seconds: if two live replicas send
  one model shard's layers (the collector restarted during a takeover and the
  reporter came back meanwhile), the job is told its silent ranks once
  (``correct``), so the extra replica stops.

The command is signed like a rollback (wire/commands.py): ``{v, job,
action: "takeover", silent: [[first, last], ...], issued_at, nonce}``. Each
agent computes ``reports_layers(layout, rank, silent)`` itself (the collector
does not know the layout). A takeover changes only what ranks send; it never
restarts, rolls back or pauses anything, so it needs no budget.

Read only from the ingest thread, like the state it reads.

Example::

    takeovers = Takeovers(key, channel.send, clock=time.time, silent_seconds=60.0)
    takeovers.tick(state)        # about once a second
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gradwatch.collector.state import StateStore
from gradwatch.wire.commands import MAX_SILENT_RUNS, TAKEOVER, encode_command, rank_runs

log = logging.getLogger(__name__)

COMMAND_VERSION = 1
DEFAULT_SILENT_S = 60.0  # rules.liveness.SilentRankDetector's default
# Repeated this often while in force: well under the agent's 60 s freshness limit.
REPEAT_S = 20.0
KINDS = ("start", "change", "repeat", "end", "correct")


def silent_threshold(rules: Iterable[Any]) -> float:
    """Seconds without a message after which a rank is silent: the ``silent_rank`` rule's.

    The smallest ``silent_seconds`` among the loaded rules using the
    ``silent_rank`` detector (its default when a rule does not set it), else
    :data:`DEFAULT_SILENT_S`.
    """
    found = [
        float(getattr(rule.make_detector(), "silent_seconds", DEFAULT_SILENT_S))
        for rule in rules
        if getattr(rule, "detector", None) == "silent_rank"
    ]
    return min(found) if found else DEFAULT_SILENT_S


@dataclass(slots=True)
class _InForce:
    silent: frozenset[int]
    sent_at: float


class Takeovers:
    """Per job, the silent ranks last published; see the module docstring."""

    def __init__(
        self,
        key: bytes | None,
        send: Callable[[list[bytes]], None] | None,
        clock: Callable[[], float] = time.time,
        silent_seconds: float = DEFAULT_SILENT_S,
        repeat_s: float = REPEAT_S,
    ) -> None:
        self._key, self._send, self._clock = key, send, clock
        self.silent_seconds, self.repeat_s = silent_seconds, repeat_s
        self._in_force: dict[str, _InForce] = {}
        # When each job was last checked for two replicas sending one shard's layers.
        self._checked: dict[str, float] = {}
        self._lock = threading.Lock()  # the counters: the ingest thread writes, a scrape reads
        self.sent = dict.fromkeys(KINDS, 0)
        self._warned_off = False

    def set_up(
        self,
        key: bytes | None,
        send: Callable[[list[bytes]], None] | None,
        silent_seconds: float,
    ) -> None:
        """Sign with ``key``, publish with ``send``, after ``silent_seconds`` (at server start)."""
        self._key, self._send, self.silent_seconds = key, send, silent_seconds

    def tick(self, state: StateStore) -> list[dict[str, Any]]:
        """Publish what changed since the last tick; return the commands sent. Never raises."""
        sent: list[dict[str, Any]] = []
        try:
            now = self._clock()
            jobs = set(state.jobs())
            with self._lock:
                for gone in [job for job in self._in_force if job not in jobs]:
                    del self._in_force[gone]  # forgotten by the state: finished or expired
                for gone in [job for job in self._checked if job not in jobs]:
                    del self._checked[gone]
            for name in sorted(jobs):
                command = self._judge(state, name, now)
                if command is not None:
                    sent.append(command)
        except Exception:
            log.exception("takeover check failed; please report this as a gradwatch bug")
        return sent

    def counts(self) -> dict[str, int]:
        """Commands sent so far, by kind (:data:`KINDS`)."""
        with self._lock:
            return dict(self.sent)

    def in_force(self) -> dict[str, frozenset[int]]:
        """Per job, the silent ranks of the takeover in force."""
        with self._lock:
            return {job: t.silent for job, t in self._in_force.items()}

    def _judge(self, state: StateStore, name: str, now: float) -> dict[str, Any] | None:
        job = state.job(name)
        if job is None:
            return None
        ranks = list(job.ranks.items())  # one copy: a test may tick off the ingest thread
        if len(ranks) < 2:
            return None
        cutoff = now - self.silent_seconds
        silent = frozenset(r for r, rank in ranks if rank.last_seen < cutoff)
        previous = self._in_force.get(name)
        if previous is None and now - self._checked.get(name, -math.inf) >= self.repeat_s:
            self._checked[name] = now
            if _reported_twice(ranks, silent):
                log.warning(
                    "job %r: two replicas of a model shard send layers with no takeover in "
                    "force (this collector restarted during one?); telling the job its "
                    "silent ranks (%s) again",
                    name,
                    _text(sorted(silent)) or "none",
                )
                return self._publish(name, silent, now, "correct")
        if not silent and previous is None:
            return None  # the usual case: one pass over the ranks
        live = [rank for r, rank in ranks if r not in silent and not rank.closed]
        if not live:
            if previous is not None:  # every rank silent or closed: a finished job
                with self._lock:
                    del self._in_force[name]
            return None
        if previous is None:
            lost = [r for r, rank in ranks if r in silent and _sends_layers(rank.latest)]
            spare = any(rank.latest is not None and not rank.latest.layers for rank in live)
            if not lost or not spare:
                return None
            kind = "start"
            log.warning(
                "job %r: reporting rank(s) %s silent for %.0fs or more; telling the job "
                "(takeover command) so another replica of each shard sends its layers",
                name,
                _text(lost),
                self.silent_seconds,
            )
        elif silent != previous.silent:
            kind = "change" if silent else "end"
            log.warning(
                "job %r: silent ranks now %s; %s",
                name,
                _text(sorted(silent)),
                "takeover updated" if silent else "every reporter is back, the takeover ends",
            )
        elif now - previous.sent_at >= self.repeat_s:
            kind = "repeat"
        else:
            return None
        return self._publish(name, silent, now, kind)

    def _publish(
        self, name: str, silent: frozenset[int], now: float, kind: str
    ) -> dict[str, Any] | None:
        with self._lock:
            if kind == "end":
                del self._in_force[name]
                self._checked[name] = now  # the replica stops at its next step: no correction
            elif kind != "correct":  # a one-off: nothing is in force after it
                self._in_force[name] = _InForce(silent, now)
        if self._key is None or self._send is None:
            if not self._warned_off:
                self._warned_off = True
                log.warning(
                    "job %r needs a takeover (a reporting rank went silent) but no command "
                    "key is configured, so no command is sent and its shard's layers stay "
                    "missing; set GRADWATCH_COMMAND_KEY (and the agents' command endpoint)",
                    name,
                )
            return None
        runs = rank_runs(silent)
        if len(runs) > MAX_SILENT_RUNS:
            log.warning(
                "job %r: %d runs of silent ranks; the takeover names the first %d",
                name,
                len(runs),
                MAX_SILENT_RUNS,
            )
            runs = runs[:MAX_SILENT_RUNS]
        command = {
            "v": COMMAND_VERSION,
            "job": name,
            "action": TAKEOVER,
            "silent": runs,
            "issued_at": now,
            "nonce": secrets.token_hex(16),
        }
        self._send(encode_command(command, self._key))
        with self._lock:
            self.sent[kind] += 1
        return command


def _reported_twice(ranks: Sequence[tuple[int, Any]], silent: frozenset[int]) -> bool:
    """Whether two live ranks send layers for one model shard while a live rank sends none.

    A shard is told apart as the assembler does: shard index ``rank % shards``
    and first layer (the stage). Without a rank that sends no layers there is
    no layout (every rank reports), so nothing to correct.
    """
    groups: set[tuple[int, str]] = set()
    twice = spare = False
    for r, rank in ranks:
        latest = rank.latest
        if r in silent or rank.closed or latest is None:
            continue
        if not latest.layers:
            spare = True
            continue
        group = (r % max(latest.shards, 1), latest.layers[0])
        twice = twice or group in groups
        groups.add(group)
    return twice and spare


def _sends_layers(latest: Any) -> bool:
    return latest is not None and bool(latest.layers)


def _text(ranks: Sequence[int], most: int = 8) -> str:
    more = f" and {len(ranks) - most} more" if len(ranks) > most else ""
    return ", ".join(map(str, ranks[:most])) + more


class TakeoverMetrics:
    """``gradwatch_takeover_commands_total{kind}`` and ``gradwatch_takeover_silent_ranks``."""

    def __init__(self, takeovers: Takeovers) -> None:
        self._takeovers = takeovers

    def collect(self) -> Iterable[Metric]:
        t = self._takeovers
        sent = t.counts()
        commands = CounterMetricFamily(
            "gradwatch_takeover_commands",
            "Takeover commands sent to jobs (a reporting rank went silent: start; "
            "the silent set changed; repeated while in force; the reporters are back: end; "
            "two replicas sent one shard's layers with none in force: correct).",
            labels=["kind"],
        )
        for kind in KINDS:
            commands.add_metric([kind], sent[kind])
        silent = GaugeMetricFamily(
            "gradwatch_takeover_silent_ranks",
            "Ranks named silent by the takeover in force, per job (absent: none in force).",
            labels=["training_job"],
        )
        for job, ranks in sorted(t.in_force().items()):
            silent.add_metric([job], len(ranks))
        return [commands, silent]
