"""What happens to a message once it is in: ingest, state, assembly, rules, actions, sinks.

:class:`Pipeline` is the collector's work without its sockets and threads: the
server's ingest thread hands it each received message (:meth:`Pipeline.handle`)
and calls :meth:`Pipeline.tick`, :meth:`Pipeline.expire` and
:meth:`Pipeline.expire_assembly` on its schedule; tests call them directly.
Nothing here raises into the caller: one bad message, or a bug met by one
record, is counted as an ``internal`` rejection and loses nothing else.

Steps and statistics of multi-rank jobs go through the assembler first and are
judged job-wide; transitions the rules return are annotated by the actions
(``last_good_checkpoint``), recorded in the state, acted on and handed to every
sink.

Example::

    pipeline = Pipeline(config, ingest, state, assembler, sinks, recorder, admission)
    pipeline.engine = build_engine(config, time.time)
    pipeline.handle(frames)
    pipeline.tick()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gradwatch.collector.actions import Actions
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.ingest import Frames, Ingest, Ingested
from gradwatch.collector.inhibition import Inhibition
from gradwatch.collector.limits import Admission
from gradwatch.collector.recorder import TraceRecorder
from gradwatch.collector.sinks import Sink
from gradwatch.collector.state import StateStore
from gradwatch.collector.wiring import RulesEngine
from gradwatch.rules import Step
from gradwatch.rules.agent_health import AgentNotice
from gradwatch.rules.assembly import Assembler, assembles
from gradwatch.rules.step import Eval, QuietRows, Stats, nonfinite_layers
from gradwatch.wire.columns import GRAD_NONFINITE_SCALAR
from gradwatch.wire.messages import DATA_CHANGE, DEGRADED, WEIGHTS_WRITTEN

log = logging.getLogger(__name__)

_BUG = "please report this as a gradwatch bug"


class Pipeline:
    """One collector's message handling; see the module docstring.

    ``engine`` and ``actions`` are set by the server when it starts (the rule
    file is loaded, and the command socket bound, only then); until the engine
    is set, :meth:`tick` and :meth:`firing` do nothing.
    """

    def __init__(
        self,
        config: CollectorConfig,
        ingest: Ingest,
        state: StateStore,
        assembler: Assembler,
        sinks: Sequence[Sink],
        recorder: TraceRecorder | None,
        admission: Admission,
    ) -> None:
        self.config = config
        self.ingest = ingest
        self.state = state
        self.assembler = assembler
        # The ingest thread assembles; a scrape reads the counters.
        self.assembler_lock = threading.Lock()
        self.sinks = sinks
        self.recorder = recorder
        self.admission = admission
        self.engine: RulesEngine | None = None
        # Which alerts direct sinks do not page (the rules' inhibits); set with the engine.
        self.inhibition = Inhibition(())
        self.engine_lock = threading.Lock()
        self.actions: Actions | None = None
        # Batches without layers of multi-rank jobs go through as columns
        # (issue 17); False: one Step per row, as before (tests compare the two).
        self.quiet_rows = True
        self._progress = threading.Condition()
        self._handled = 0

    # ---------------------------------------------------------------- progress

    @property
    def handled(self) -> int:
        """Messages handled (valid or not) so far."""
        with self._progress:
            return self._handled

    def wait_for(self, count: int, timeout: float) -> bool:
        """Block until ``count`` messages have been handled, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._handled < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(remaining)
            return True

    # ---------------------------------------------------------------- messages

    def handle(
        self, frames: Frames, refused: bool = False, header: dict[str, Any] | None = None
    ) -> None:
        """Handle one received message; ``refused`` ones only count as handled. Never raises.

        ``header``: the header frame's JSON object, when the caller parsed it already.
        """
        try:
            if refused:
                return  # counted and logged by the check that refused it
            recorder = self.recorder
            # The recorder writes every row's Step: it gets them one by one.
            quiet = self.quiet_rows and (recorder is None or not recorder.enabled)
            result = self.ingest.feed(frames, header, quiet)
            self._record(result)
            for heartbeat in result.heartbeats:
                self.state.observe_heartbeat(heartbeat)
                if heartbeat.world > 1:
                    with self.assembler_lock:
                        self.assembler.heard(heartbeat.job, heartbeat.rank)
            for event in result.events:
                self.state.observe_event(event)
                if self.actions is not None:
                    self.actions.observe_event(event)
                if event.kind == DATA_CHANGE:
                    with self.engine_lock:
                        self._engine().data_changed(event.job, event.step)
                elif event.kind == WEIGHTS_WRITTEN:  # agent/fence.py; rules/rewrites.py
                    with self.engine_lock:
                        self._engine().weights_written(event.job, event.rank, event.step)
                elif event.kind == DEGRADED:  # contract C3: the agent switched a part off
                    notice = AgentNotice.of_fields(
                        event.job, event.rank, max(event.step, 0), dict(event.fields)
                    )
                    if notice is not None:
                        self._evaluate("the agent's notice", notice, self._engine().observe_notice)
            for step in result.steps:
                self._observe(step)
            for rows in result.quiet:
                self._observe_quiet(rows)
            if result.steps:
                self.state.observe_lag(max(result.steps, key=lambda s: s.time))
            for stats in result.stats:
                self.state.observe_stats(stats)
                self._judge("the statistics", stats, self._engine().observe_stats)
            for ev in result.evals:
                self.state.observe_eval(ev)
                judged = self.state.eval_to_judge(ev)
                if judged is not None:
                    self._evaluate("the eval", judged, self._engine().observe_eval)
        except Exception as exc:
            self.ingest.reject("internal", f"failed to handle a message: %r; {_BUG}", exc)
        finally:
            with self._progress:
                self._handled += 1
                self._progress.notify_all()

    def early(self, frames: Frames, header: dict[str, Any] | None = None) -> str:
        """Page a flagged batch's first non-finite row now, before it is handled in turn.

        The server calls this for batches whose ``nonfinite`` hint bought them the
        priority lane (collector/priority.py); the batch is still handled in its
        place afterwards, which changes no state this left alone. A page needs a
        decoded non-finite loss or layer norm (never the hint alone) in a row
        that its judged record will page too: a row of a job judged as a whole
        that carries a loss scale (AMP) is left to the assembled step, since
        another rank's skipped step would make it a GradScaler skip, and so is a
        bad row not known to be born on its rank (``_born_here``). Returns the
        outcome counted by the lane: ``paged``, ``no_page`` (an incident already
        fires, or the rule judges the row otherwise: a GradScaler skip),
        ``finite``, ``amp``, ``shared`` (in a job judged as a whole, a NaN that may
        have come through the reduce) or ``unread`` (not readable before it is
        handled).
        Never raises.
        """
        try:
            if self.engine is None:
                return "unread"
            steps = self.ingest.peek_steps(frames, header)
            if not steps:
                return "unread"
            whole = assembles(steps[0])
            at = next((i for i, s in enumerate(steps) if _nonfinite_row(s, whole)), None)
            if at is None:
                return "finite"
            row = steps[at]
            if whole and row.loss_scale is not None:
                return "amp"
            if whole and not self._born_here(steps, at):
                return "shared"
            # Not part of RulesEngine: a test double without it sees no early pages.
            observe_early = getattr(self._engine(), "observe_early", None)
            if observe_early is None:
                return "unread"
            with self.engine_lock:
                transitions = observe_early(row, whole)
        except Exception as exc:
            self.ingest.reject(
                "internal", f"failed to judge a flagged batch early: %r; {_BUG}", exc
            )
            return "unread"
        self.dispatch(transitions)
        return "paged" if transitions else "no_page"

    def _born_here(self, steps: Sequence[Step], at: int) -> bool:
        """Whether row ``at`` of a batch from a job judged as a whole (its first bad row)
        shows a NaN born on its own rank. The reduce shares gradients across ranks, so a
        NaN gradient beside a finite loss says nothing of where it was born (every
        replica shows it): naming the rank whose report came first would blame by
        arrival order, and two collectors of an HA pair could page different ranks. A
        rank's own loss is its own, but only right after a clean step of that rank: the
        step after a shared NaN update has a NaN loss on every rank. So the row before
        must be known clean: in this batch, or the rank's latest handled step (a flush's
        first row). Otherwise the assembled verdict, which sees every rank, names it."""
        row = steps[at]
        if not _loss_nonfinite(row):
            return False
        if at > 0:
            return True  # the rows before it in this batch are clean (it is the first bad one)
        job = self.state.job(row.job)
        rank = None if job is None else job.ranks.get(row.rank)
        before = None if rank is None else rank.latest
        return (
            before is not None
            and before.step == row.step - 1
            and not _nonfinite_row(before, whole=True)
        )

    def _record(self, result: Ingested) -> None:
        recorder = self.recorder
        if recorder is None or not recorder.enabled:
            return
        for heartbeat in result.heartbeats:
            recorder.heartbeat(heartbeat)
        for event in result.events:
            recorder.event(event)
        for step in result.steps:
            recorder.step(step)
        for stats in result.stats:
            recorder.stats(stats)

    def _observe(self, step: Step) -> None:
        try:
            self.state.observe_step(step)  # per rank: liveness, timings, latest values
        except Exception as exc:
            self.ingest.reject(
                "internal",
                f"failed to record step %d of job %r: %r; {_BUG}",
                step.step,
                step.job,
                exc,
            )
            return
        self._judge("the step", step, self._engine().observe)

    def _observe_quiet(self, rows: QuietRows) -> None:
        """``_observe`` of each row of a batch without layers of a job judged as a whole.

        The rows go to the state and the assembler as columns (no ``Step`` per
        row); the state and the assembled steps are those of ``_observe`` per row.
        """
        doing = "record"
        try:
            self.state.observe_quiet(rows)
            doing = "assemble"
            with self.assembler_lock:
                wholes = self.assembler.add_quiet(rows)
        except Exception as exc:
            self.ingest.reject(
                "internal",
                f"failed to %s steps %d-%d of job %r: %r; {_BUG}",
                doing,
                rows.steps[0],
                rows.steps[-1],
                rows.job,
                exc,
            )
            return
        self._judge_whole(wholes)

    def _judge(
        self, what: str, record: Step | Stats, observe: Callable[[Any], Sequence[Any]]
    ) -> None:
        """Judge one rank's record: alone, or within its job's assembled step."""
        if not assembles(record):
            self._evaluate(what, record, observe)
            return
        try:
            with self.assembler_lock:
                wholes = self.assembler.add(record)
        except Exception as exc:
            self.ingest.reject(
                "internal",
                f"failed to assemble %s at step %d of job %r: %r; {_BUG}",
                what,
                record.step,
                record.job,
                exc,
            )
            return
        self._judge_whole(wholes)

    def _judge_whole(self, records: Iterable[Step | Stats]) -> None:
        """Judge the job-wide records the assembler completed (steps and stats)."""
        for record in records:
            if isinstance(record, Step):
                self.state.observe_assembled(record)
                self._evaluate("the assembled step", record, self._engine().observe)
            else:
                self._evaluate("the assembled statistics", record, self._engine().observe_stats)

    def _engine(self) -> RulesEngine:
        assert self.engine is not None  # set in Server.start(), before the ingest thread runs
        return self.engine

    def _evaluate(
        self,
        what: str,
        record: Step | Stats | Eval | AgentNotice,
        observe: Callable[[Any], Sequence[Any]],
    ) -> None:
        try:
            with self.engine_lock:
                transitions = observe(record)
        except Exception as exc:
            self.ingest.reject(
                "internal",
                f"failed to evaluate %s at step %d of job %r: %r; {_BUG}",
                what,
                record.step,
                record.job,
                exc,
            )
            return
        self.dispatch(transitions)

    # ---------------------------------------------------------------- schedule

    def expire_assembly(self) -> None:
        """Judge the steps whose assembly deadline passed without every rank."""
        try:
            with self.assembler_lock:
                wholes = self.assembler.expire()
        except Exception as exc:
            self.ingest.reject("internal", f"failed to assemble overdue steps: %r; {_BUG}", exc)
            return
        self._judge_whole(wholes)

    def tick(self) -> None:
        """Judge every known rank's liveness now and send the transitions to the sinks.

        Never raises; does nothing before the engine is set.
        """
        try:
            liveness = self.state.liveness()
            with self.engine_lock:
                if self.engine is None:
                    return
                transitions = self.engine.tick(liveness)
        except Exception as exc:
            self.ingest.reject("internal", f"failed to evaluate liveness: %r; {_BUG}", exc)
            return
        self.dispatch(transitions)

    def expire(self) -> None:
        """Forget the jobs the state let go (finished, or silent past their TTL) everywhere."""
        self.admission.retain(set(self.state.jobs()))
        for job in self.state.expire():
            log.info(
                "forgetting job %r: every agent closed %.0fs ago, or silent for %.0fs",
                job,
                self.config.finished_grace_seconds,
                self.config.job_ttl_seconds,
            )
            self.ingest.forget(job)
            self.admission.forget(job)
            with self.assembler_lock:
                self.assembler.forget(job)
            if self.recorder is not None:
                self.recorder.forget(job)
            with self.engine_lock:
                resolved = self._engine().forget(job) or ()
            self.dispatch(resolved)

    # ---------------------------------------------------------------- alerts

    def dispatch(self, transitions: Iterable[Any]) -> None:
        """Annotate, record, act on and deliver each alert transition (a muted one only to the
        sinks that get muted alerts: Alertmanager, Grafana annotations; collector/inhibition.py).
        """
        inhibition = self.inhibition
        for transition in inhibition.order(transitions):
            if self.actions is not None:
                transition = self.actions.annotate(transition)  # last_good_checkpoint
            alert = transition.alert
            if transition.current in ("firing", "resolved"):
                log.info(
                    "alert %s %s: job %r step %d: %s",
                    alert.rule,
                    transition.current,
                    alert.job,
                    alert.step,
                    alert.summary,
                )
            self.state.record_transition(transition)
            if self.actions is not None:
                self.actions.on_transition(transition)  # after recording; never raises
            muted = inhibition.muted(transition)  # collector/inhibition.py
            for sink in self.sinks:
                if muted and not getattr(sink, "gets_muted", False):
                    continue
                try:
                    sink.notify(transition)
                except Exception:
                    log.exception("sink %s failed to accept alert %s", sink.name, alert.rule)

    def firing(self) -> list[Any]:
        """The alerts firing now (none before the engine is set)."""
        if self.engine is None:
            return []
        with self.engine_lock:
            return list(self.engine.firing())


def _loss_nonfinite(step: Step) -> bool:
    """A row whose own loss is NaN/Inf: computed before any collective, so born on its rank."""
    return step.loss is not None and not math.isfinite(step.loss)


def _nonfinite_row(step: Step, whole: bool = False) -> bool:
    """A row whose own loss or layer norm is NaN/Inf (a total alone is not enough); in a job
    judged as a whole (``whole``) also one whose rank flagged its gradients non-finite
    (``grad_nonfinite``: a replica that sends no layers), where a bad row begins."""
    if _loss_nonfinite(step) or nonfinite_layers(step):
        return True
    return whole and step.scalars.get(GRAD_NONFINITE_SCALAR, 0.0) > 0.5
