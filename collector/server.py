"""The collector process: sockets, threads and shutdown, around pure parts.

``Server(config)`` owns a ZeroMQ PULL socket and an ingest thread that feeds
``Ingest`` -> ``StateStore`` -> rules ``Engine`` -> sinks (steps and evals as
they arrive; every rank's liveness from the state about once a second of the
injected clock, see :meth:`Server.tick`), an HTTP server for
``/metrics`` (rendered at scrape time), ``/healthz`` and ``/readyz``, and the
sinks' threads. ``start()`` and ``stop(timeout)`` are for embedding and tests;
``run_until_signal()`` is what the CLI calls: SIGTERM/SIGINT only set a flag,
and the main loop then drains what has arrived and stops within the deadline.

Example::

    from gradwatch.collector.config import CollectorConfig
    from gradwatch.collector.server import Server

    server = Server(CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"))
    server.start()
    print(server.bound_endpoint, server.metrics_port)
    server.stop()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import zmq
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from gradwatch.collector.actions import Actions, ActionsMetrics, action_settings
from gradwatch.collector.alertmanager import AlertmanagerSink
from gradwatch.collector.assembly_metrics import AssemblyMetrics
from gradwatch.collector.auth import (
    AuthCounters,
    CurveAuth,
    build_auth,
    check_profile,
    metrics_security,
)
from gradwatch.collector.config import CollectorConfig, CollectorError, ConfigError
from gradwatch.collector.exposition import GradwatchCollector
from gradwatch.collector.httpd import MetricsHTTPServer
from gradwatch.collector.ingest import Frames, Ingest, Ingested
from gradwatch.collector.limits import Admission, AdmissionMetrics, Bounds, peek
from gradwatch.collector.startup import check_open_files, warn_exposure
from gradwatch.collector.recorder import TraceRecorder
from gradwatch.collector.outbox import Outbox, OutboxSink
from gradwatch.collector.pagerduty import PagerDutyChannel
from gradwatch.collector.routing import Router
from gradwatch.collector.signing import SignatureError, decode_secret
from gradwatch.collector.sinks import Sink, mask_url, read_secret
from gradwatch.collector.slack import SlackChannel
from gradwatch.collector.state import StateStore
from gradwatch.collector.webhook import WebhookChannel
from gradwatch.rules import Engine, Step, load_default_rules, load_rules
from gradwatch.rules.agent_health import AgentNotice
from gradwatch.rules.assembly import Assembler, assembles
from gradwatch.rules.step import Eval, Liveness, Stats
from gradwatch.wire.messages import DATA_CHANGE, DEGRADED

log = logging.getLogger(__name__)

POLL_MS = 100            # how long the ingest thread blocks before checking for stop
EXPIRE_EVERY_S = 1.0     # how often silent jobs are looked for
LIVENESS_EVERY_S = 1.0   # how often (injected clock) the liveness rules are ticked
OVERSIZE_HEADROOM = 4   # ZeroMQ MAXMSGSIZE = this x max_message_bytes: see _bind
DRAIN_BUDGET = 1000      # messages handled between stop/expiry checks
TICK_S = 0.1             # run_until_signal's flag check period


class RulesEngine(Protocol):
    """What the server needs of ``gradwatch.rules.Engine`` (test doubles implement this)."""

    def observe(self, step: Step) -> Sequence[Any]: ...

    def observe_stats(self, stats: Stats) -> Sequence[Any]: ...

    def observe_eval(self, ev: Eval) -> Sequence[Any]: ...

    def tick(self, liveness: Sequence[Liveness]) -> Sequence[Any]: ...

    def firing(self) -> Sequence[Any]: ...

    def forget(self, job: str) -> Sequence[Any] | None: ...

    def data_changed(self, job: str, step: int) -> None: ...


def build_engine(config: CollectorConfig, clock: Callable[[], float]) -> Engine:
    """The engine for ``config.rules`` (or the default pack); raises ``RuleFileError``."""
    specs = load_rules(config.rules) if config.rules is not None else load_default_rules()
    return Engine(specs, clock=clock)


def build_sinks(config: CollectorConfig) -> list[Sink]:
    """Every configured sink; alert sinks each hold a connection to the durable outbox."""
    def outbox() -> Outbox:
        return Outbox.open(config.data_dir, max_pending=config.outbox_max_pending)

    def options(kind: str, name: str) -> dict[str, Any]:
        return {"router": Router(config.routes.get(kind), name=name),
                "max_age": config.outbox_max_age_seconds}

    # Every secret is read (and may fail) before any outbox is opened.
    secret = read_secret(config.webhook_secret, config.webhook_secret_file, "webhook_secret")
    try:
        key = decode_secret(secret) if secret is not None else None
    except SignatureError as exc:
        raise ConfigError(f"webhook_secret: {exc}") from exc
    slack = read_secret(config.slack_webhook_url, config.slack_webhook_url_file,
                        "slack_webhook_url")
    routing_key = read_secret(config.pagerduty_routing_key, config.pagerduty_routing_key_file,
                              "pagerduty_routing_key")
    timeout = config.webhook_timeout
    sinks: list[Sink] = [
        OutboxSink(f"webhook-{i}", WebhookChannel(url, secret=key, timeout=timeout), outbox(),
                   **options("webhook", f"webhook-{i}"))
        for i, url in enumerate(config.webhooks)]
    if slack is not None:
        sinks.append(OutboxSink("slack", SlackChannel(slack, timeout=timeout), outbox(),
                                **options("slack", "slack")))
    if routing_key is not None:
        channel = PagerDutyChannel(routing_key, url=config.pagerduty_url, timeout=timeout)
        sinks.append(OutboxSink("pagerduty", channel, outbox(),
                                **options("pagerduty", "pagerduty")))
    sinks += [AlertmanagerSink(url, name=f"alertmanager-{i}", outbox=outbox(), timeout=timeout,
                               resend_interval=config.alertmanager_resend_seconds,
                               **options("alertmanager", f"alertmanager-{i}"))
              for i, url in enumerate(config.alertmanager_urls)]
    if config.grafana_url is not None:
        # Imported only when configured: grafana-client pulls in its HTTP stack.
        from gradwatch.collector.grafana import build_grafana_sinks

        sinks.extend(build_grafana_sinks(config))
    return sinks


class Server:
    """One collector: see the module docstring. Not restartable once stopped."""

    def __init__(self, config: CollectorConfig, engine: RulesEngine | None = None,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time,
                 sinks: Sequence[Sink] | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else REGISTRY
        self._clock = clock
        self._engine = engine
        self._engine_lock = threading.Lock()
        self.sinks: list[Sink] = list(sinks) if sinks is not None else build_sinks(config)
        self.admission = Admission(Bounds.of(config))
        self._sender = ""  # the CurveZMQ key of the message being handled ("" without CURVE)
        self.ingest = Ingest(config.max_message_bytes,
                             admit=lambda message: self.admission.admit(message, self._sender))
        self.ingest.may_grow = lambda job, rank: self.admission.may_grow(job, rank, self._sender)
        self._admission_metrics = AdmissionMetrics(self.admission)
        self.recorder = TraceRecorder(config.record_dir) if config.record_dir is not None else None
        self.state = StateStore(config.job_ttl_seconds, clock, config.finished_grace_seconds)
        self.assembler = Assembler(config.assembly_deadline_seconds, clock)
        # The ingest thread assembles; a scrape reads the counters.
        self.assembler_lock = threading.Lock()
        self._exposition = GradwatchCollector(
            self.state, self.ingest.stats, self._firing, self.sinks,
            per_layer_metrics=config.per_layer_metrics,
            max_layer_series=config.max_layer_series,
            max_block_series=config.max_block_series, max_rank_series=config.max_rank_series,
            max_series_per_family=config.max_series_per_family)
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._endpoint: str | None = None
        self._http: MetricsHTTPServer | None = None
        self._ingest_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._drain_deadline = 0.0
        self._next_liveness = -float("inf")
        self._progress = threading.Condition()
        self._handled = 0
        self._registered = False
        self._released = False
        self._wrote_ready_file = False
        self.actions: Actions | None = None
        self._actions_metrics: ActionsMetrics | None = None
        self._store_metrics: StoreErrorMetrics | None = None
        self._assembly_metrics: AssemblyMetrics | None = None
        self._commands: zmq.Socket[Any] | None = None  # XPUB; used under _commands_lock
        self._commands_lock = threading.Condition()
        self._listening: set[str] = set()  # jobs with an agent subscribed to commands
        self.command_endpoint: str | None = None
        self._exit_requested = False
        self.auth_counters = AuthCounters()  # exposed only while CURVE is on
        self._auth: CurveAuth | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Load rules, bind, serve. Raises ``RuleFileError`` or ``CollectorError``."""
        if self._ingest_thread is not None or self._stopping.is_set():
            raise CollectorError("a Server starts once; build a new one to start again")
        if self._engine is None:
            self._engine = build_engine(self.config, self._clock)
        check_profile(self.config, {r.name: r.actions for r in getattr(self._engine, "rules", ())})
        check_open_files(self.config)
        warn_exposure(self.config)
        try:
            self._bind()
            self._start_actions()
            if self._auth is not None:
                self._auth.start_monitoring()
                self.registry.register(self.auth_counters)
            host, port = self.config.metrics_host_port
            self._http = MetricsHTTPServer(
                host, port, self.registry, lambda: self.ready,
                max_connections=self.config.http_max_connections,
                read_timeout=self.config.http_read_timeout_seconds,
                **metrics_security(self.config))
            self.registry.register(self._http.connections)
            self.registry.register(self._exposition)
            self._registered = True
            self.registry.register(self._admission_metrics)
            assert self.actions is not None
            self._actions_metrics = ActionsMetrics(self.actions)
            self.registry.register(self._actions_metrics)
            self._store_metrics = StoreErrorMetrics(self)
            self.registry.register(self._store_metrics)
            self._assembly_metrics = AssemblyMetrics(self.assembler, self.assembler_lock)
            self.registry.register(self._assembly_metrics)
            for sink in self.sinks:
                if self._auth is not None and isinstance(sink, OutboxSink):
                    sink.share_of = self.admission.sender_of  # per-key shares of the outbox
                sink.start()
        except BaseException:
            self._release()
            raise
        self._ingest_thread = threading.Thread(
            target=self._ingest_loop, name="gradwatch-ingest", daemon=True)
        self._ingest_thread.start()
        if self.config.ready_file is not None:
            try:
                self._write_ready_file(self.config.ready_file)
            except OSError as exc:
                self.stop()
                raise CollectorError(
                    f"cannot write the ready file {self.config.ready_file}: "
                    f"{exc.strerror or exc}; check that its directory exists") from exc
        log.info("collector receiving on %s; metrics on %s; webhooks: %s",
                 self._endpoint, self.metrics_url,
                 ", ".join(mask_url(url) for url in self.config.webhooks) or "none")

    def stop(self, timeout: float | None = None) -> bool:
        """Drain what arrived, flush sinks, close everything; True if all in time."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # The drain stops early enough for the message in hand (bounded by
        # max_rows_per_batch) to finish before the deadline.
        self._drain_deadline = deadline - min(1.0, timeout / 4)
        self._stopping.set()
        clean = True
        if self._ingest_thread is not None:
            self._ingest_thread.join(max(0.0, deadline - time.monotonic()))
            clean = not self._ingest_thread.is_alive()
            if not clean:
                log.warning("ingest thread still busy after %.1fs; exiting without it", timeout)
        for sink in self.sinks:
            sink.close(max(0.0, deadline - time.monotonic()))
            clean = clean and not sink.alive()
        if self.recorder is not None and clean:
            self.recorder.close()  # the ingest thread, its only writer, has stopped
        self._release(term=clean)
        return clean

    def run_until_signal(self) -> int:
        """Start, run until SIGTERM or SIGINT, stop within ``shutdown_timeout``.

        Must run on the main thread. Returns 0 after a clean stop, 1 when a
        thread died or the stop overran its deadline.
        """
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        code = 0
        try:
            self.start()
            while not self._exit_requested:
                if not self._alive():
                    log.error("a collector thread died; stopping (see the errors above)")
                    code = 1
                    break
                time.sleep(TICK_S)
        finally:
            log.info("collector stopping")
            clean = self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code if clean else 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the main loop does the work, outside the handler.
        self._exit_requested = True

    # ---------------------------------------------------------------- properties

    @property
    def bound_endpoint(self) -> str:
        """The endpoint actually bound (a ``*`` port resolved)."""
        if self._endpoint is None:
            raise CollectorError("the server is not started")
        return self._endpoint

    @property
    def metrics_port(self) -> int:
        if self._http is None:
            raise CollectorError("the server is not started")
        return self._http.port

    @property
    def metrics_url(self) -> str:
        """Where ``/metrics`` can be scraped from this machine."""
        host = self.config.metrics_host_port[0]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.metrics_port}/metrics"

    @property
    def ready(self) -> bool:
        """Socket bound and every thread alive: what ``/readyz`` reports."""
        return self._endpoint is not None and not self._stopping.is_set() and self._alive()

    def wait_for_messages(self, count: int, timeout: float) -> bool:
        """Block until ``count`` messages (valid or not) have been handled since start."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._handled < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(remaining)
            return True

    @property
    def messages_handled(self) -> int:
        with self._progress:
            return self._handled

    # ---------------------------------------------------------------- ingest

    def _ingest_loop(self) -> None:
        assert self._socket is not None
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._commands is not None:
            poller.register(self._commands, zmq.POLLIN)  # XPUB: agents (un)subscribing
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(POLL_MS))
                if sock in ready:
                    self._drain(sock, lambda n: n < DRAIN_BUDGET)
                if self._commands is not None and self._commands in ready:
                    self._read_subscriptions()
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + EXPIRE_EVERY_S
                    self._expire()
                self._expire_assembly()
                now = self._clock()
                # Also when the clock went back (a stepped one, or a test's).
                if now >= self._next_liveness or self._next_liveness > now + LIVENESS_EVERY_S:
                    self._next_liveness = now + LIVENESS_EVERY_S
                    self.tick()
            # Stopping: handle what has already arrived, within the deadline.
            self._drain(sock, lambda n: time.monotonic() < self._drain_deadline)
        except Exception:
            log.exception("the ingest thread failed; the collector is no longer ready")
        finally:
            sock.close(linger=0)

    def _drain(self, sock: zmq.Socket[Any], more: Callable[[int], bool]) -> None:
        handled = 0
        while more(handled):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handled += 1
            if self._auth is not None:
                if not self._auth.permits(parts):
                    self._handle((), refused=True)  # counted by the allow-list check
                    continue
                self._sender = _sender_of(parts[0])
            # Who pays for this message's ingest time (collector/limits.py): a sender over
            # its share is refused here, after one header parse, before any decoding.
            job, rows = peek(parts[0].bytes)
            unit = self.admission.unit(job, self._sender)
            if not self.admission.allow(unit, rows):
                self._handle((), refused=True)
                continue
            began = time.perf_counter()
            self._handle([part.buffer for part in parts])
            self.admission.charge(unit, time.perf_counter() - began, rows)

    def _handle(self, frames: Frames, refused: bool = False) -> None:
        # Never raises: one bad message must not stop the ingest thread.
        try:
            if refused:
                return  # counted and logged by the CURVE allow-list check
            result = self.ingest.feed(frames)
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
                    with self._engine_lock:
                        self._engine_of().data_changed(event.job, event.step)
                elif event.kind == DEGRADED:  # contract C3: the agent switched a part off
                    notice = AgentNotice.of_fields(event.job, event.rank, max(event.step, 0),
                                                   dict(event.fields))
                    if notice is not None:
                        self._evaluate("the agent's notice", notice,
                                       self._engine_of().observe_notice)
            for step in result.steps:
                self._observe(step)
            if result.steps:
                self.state.observe_lag(max(result.steps, key=lambda s: s.time))
            for stats in result.stats:
                self.state.observe_stats(stats)
                self._judge("the statistics", stats, self._engine_of().observe_stats)
            for ev in result.evals:
                self.state.observe_eval(ev)
                judged = self.state.eval_to_judge(ev)
                if judged is not None:
                    self._evaluate("the eval", judged, self._engine_of().observe_eval)
        except Exception as exc:
            self.ingest.reject("internal", "failed to handle a message: %r; please report "
                               "this as a gradwatch bug", exc)
        finally:
            with self._progress:
                self._handled += 1
                self._progress.notify_all()

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
            self.ingest.reject("internal", "failed to record step %d of job %r: %r; please "
                               "report this as a gradwatch bug", step.step, step.job, exc)
            return
        self._judge("the step", step, self._engine_of().observe)

    def _judge(self, what: str, record: Step | Stats,
               observe: Callable[[Any], Sequence[Any]]) -> None:
        """Judge one rank's record: alone, or within its job's assembled step."""
        if not assembles(record):
            self._evaluate(what, record, observe)
            return
        try:
            with self.assembler_lock:
                wholes = self.assembler.add(record)
        except Exception as exc:
            self.ingest.reject("internal", "failed to assemble %s at step %d of job %r: %r; "
                               "please report this as a gradwatch bug", what, record.step,
                               record.job, exc)
            return
        self._judge_whole(wholes)

    def _judge_whole(self, records: Iterable[Step | Stats]) -> None:
        """Judge the job-wide records the assembler completed (steps and stats)."""
        for record in records:
            if isinstance(record, Step):
                self.state.observe_assembled(record)
                self._evaluate("the assembled step", record, self._engine_of().observe)
            else:
                self._evaluate("the assembled statistics", record,
                               self._engine_of().observe_stats)

    def _expire_assembly(self) -> None:
        try:
            with self.assembler_lock:
                wholes = self.assembler.expire()
        except Exception as exc:
            self.ingest.reject("internal", "failed to assemble overdue steps: %r; please "
                               "report this as a gradwatch bug", exc)
            return
        self._judge_whole(wholes)

    def _engine_of(self) -> RulesEngine:
        assert self._engine is not None  # set in start(), before the ingest thread runs
        return self._engine

    def _evaluate(self, what: str, record: Step | Stats | Eval | AgentNotice,
                  observe: Callable[[Any], Sequence[Any]]) -> None:
        try:
            with self._engine_lock:
                transitions = observe(record)
        except Exception as exc:
            self.ingest.reject("internal", "failed to evaluate %s at step %d of job %r: %r; "
                               "please report this as a gradwatch bug", what, record.step,
                               record.job, exc)
            return
        self._dispatch(transitions)

    def tick(self) -> None:
        """Judge every known rank's liveness now and send the transitions to the sinks.

        The ingest thread calls this about once a second of the injected
        clock; tests call it directly after moving a fake clock. Never raises.
        """
        try:
            liveness = self.state.liveness()
            with self._engine_lock:
                if self._engine is None:
                    return
                transitions = self._engine.tick(liveness)
        except Exception as exc:
            self.ingest.reject("internal", "failed to evaluate liveness: %r; please report "
                               "this as a gradwatch bug", exc)
            return
        self._dispatch(transitions)

    def _dispatch(self, transitions: Iterable[Any]) -> None:
        for transition in transitions:
            if self.actions is not None:
                transition = self.actions.annotate(transition)  # last_good_checkpoint
            alert = transition.alert
            if transition.current in ("firing", "resolved"):
                log.info("alert %s %s: job %r step %d: %s", alert.rule, transition.current,
                         alert.job, alert.step, alert.summary)
            self.state.record_transition(transition)
            if self.actions is not None:
                self.actions.on_transition(transition)  # after recording; never raises
            for sink in self.sinks:
                try:
                    sink.notify(transition)
                except Exception:
                    log.exception("sink %s failed to accept alert %s", sink.name, alert.rule)

    def _expire(self) -> None:
        self.admission.retain(set(self.state.jobs()))
        for job in self.state.expire():
            log.info("forgetting job %r: every agent closed %.0fs ago, or silent for %.0fs",
                     job, self.config.finished_grace_seconds, self.config.job_ttl_seconds)
            self.ingest.forget(job)
            self.admission.forget(job)
            with self.assembler_lock:
                self.assembler.forget(job)
            if self.recorder is not None:
                self.recorder.forget(job)
            with self._engine_lock:
                assert self._engine is not None
                resolved = self._engine.forget(job) or ()
            self._dispatch(resolved)

    def _firing(self) -> list[Any]:
        if self._engine is None:
            return []
        with self._engine_lock:
            return list(self._engine.firing())

    # ---------------------------------------------------------------- resources

    def _bind(self) -> None:
        self._context = zmq.Context()
        # Keys are read before any socket exists: a bad key file leaves nothing to close.
        self._auth = build_auth(self.config, self._context, self.auth_counters)
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        # libzmq drops the peer on a frame over MAXMSGSIZE before Ingest can count it (and
        # loses what that peer queued after it): leave headroom, so frames up to 4x the
        # limit reach Ingest and are counted as "oversized"; beyond that libzmq still bounds memory.
        sock.setsockopt(zmq.MAXMSGSIZE, OVERSIZE_HEADROOM * self.config.max_message_bytes)
        self._socket = sock
        if self._auth is not None:
            self._auth.secure(sock)
        self._endpoint = _bind_socket(sock, self.config.listen, "--listen")

    def _start_actions(self) -> None:
        """Bind the command PUB socket (only with a command key) and build the actions."""
        settings = action_settings(self.config)
        rules = getattr(self._engine, "rules", ())
        send: Callable[[list[bytes]], None] | None = None
        if settings.key is not None:
            assert self._context is not None
            # XPUB, not PUB: it reports subscriptions, so a rollback for a job with
            # no agent listening is refused and logged instead of silently dropped.
            sock = self._context.socket(zmq.XPUB)
            sock.setsockopt(zmq.LINGER, 0)
            if self._auth is not None:
                self._auth.secure(sock)  # encrypted, and only allow-listed agents subscribe
            self._commands = sock
            self.command_endpoint = _bind_socket(sock, self.config.command_listen,
                                                 "command_listen")
            send = self._send_command
            log.info("rollback commands (HMAC-signed, not encrypted) on %s", self.command_endpoint)
        self.actions = Actions(settings, {r.name: r.actions for r in rules}, send, self._clock,
                               listening=self.listening)

    def _send_command(self, frames: list[bytes]) -> None:
        # Dispatch runs on the ingest thread and on tick() callers: one user at a time.
        with self._commands_lock:
            if self._commands is not None:
                self._commands.send_multipart(frames, flags=zmq.NOBLOCK)  # drops, never blocks

    def _read_subscriptions(self) -> None:
        with self._commands_lock:
            while self._commands is not None:
                try:
                    message = self._commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if message[:1] == b"\x01":
                    self._listening.add(message[1:].decode("utf-8", "replace"))
                elif message[:1] == b"\x00":
                    self._listening.discard(message[1:].decode("utf-8", "replace"))
            self._commands_lock.notify_all()

    def listening(self, job: str) -> bool:
        """Whether an agent of ``job`` is subscribed to rollback commands now."""
        with self._commands_lock:
            return job in self._listening

    def wait_for_listener(self, job: str, timeout: float) -> bool:
        """Block until an agent of ``job`` subscribes to commands, at most ``timeout`` s."""
        with self._commands_lock:
            return self._commands_lock.wait_for(lambda: job in self._listening, timeout)

    def _write_ready_file(self, path: Path) -> None:
        # Written whole then renamed: a reader never sees half a file.
        body = {"listen": self.bound_endpoint, "metrics_url": self.metrics_url,
                "pid": os.getpid()}
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(body), encoding="utf-8")
        os.replace(partial, path)
        self._wrote_ready_file = True

    def _alive(self) -> bool:
        return self._http is not None and self._http.alive() and \
            self._ingest_thread is not None and self._ingest_thread.is_alive() and \
            all(sink.alive() for sink in self.sinks)

    def _release(self, term: bool = True) -> None:
        if self._released:
            return
        self._released = True
        if self._wrote_ready_file and self.config.ready_file is not None:
            self.config.ready_file.unlink(missing_ok=True)
        if self._registered:
            self.registry.unregister(self._exposition)
            self.registry.unregister(self._admission_metrics)
            self._registered = False
        if self._actions_metrics is not None:
            self.registry.unregister(self._actions_metrics)
            self._actions_metrics = None
        if self._store_metrics is not None:
            self.registry.unregister(self._store_metrics)
            self._store_metrics = None
        if self._assembly_metrics is not None:
            self.registry.unregister(self._assembly_metrics)
            self._assembly_metrics = None
        if self._http is not None:
            with contextlib.suppress(KeyError):
                self.registry.unregister(self._http.connections)
            self._http.close()
        if self._socket is not None and self._ingest_thread is None:
            self._socket.close(linger=0)  # never handed to the ingest thread
        with self._commands_lock:
            if self._commands is not None:
                self._commands.close(linger=0)
                self._commands = None
        if self.actions is not None:
            self.actions.close()
        if self._auth is not None:
            self._auth.close()
            with contextlib.suppress(KeyError):  # start() may have failed before registering
                self.registry.unregister(self.auth_counters)
        if self._context is not None and term:
            self._context.term()
        self._context = None


class StoreErrorMetrics:
    """``gradwatch_store_errors_total{store}``: failed writes to the on-disk stores.

    ``outbox`` (alerts; they continue in memory), ``actions`` (checkpoints and
    restart budget) and ``trace`` (``--record``; recording switches off). Read
    from the stores at scrape time; each store logs its first failure once.
    """

    def __init__(self, server: Server) -> None:
        self._server = server

    def collect(self) -> Iterable[Metric]:
        server = self._server
        counts = {
            "outbox": sum(getattr(getattr(sink, "outbox", None), "errors", 0)
                          for sink in server.sinks),
            "actions": server.actions.store_errors if server.actions is not None else 0,
            "trace": server.recorder.errors if server.recorder is not None else 0,
        }
        family = CounterMetricFamily(
            "gradwatch_store_errors", "Failed writes to the collector's files (disk full, "
            "read-only); the log says what to fix.", labels=["store"])
        for store, count in sorted(counts.items()):
            family.add_metric([store], count)
        return [family]


def _sender_of(frame: zmq.Frame) -> str:
    """The ZAP User-Id (the agent's CurveZMQ public key) of a received frame."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


def _bind_socket(sock: zmq.Socket[Any], endpoint: str, option: str) -> str:
    """Bind ``sock`` to ``endpoint``; the endpoint actually bound (a ``*`` port resolved)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise CollectorError(
            f"cannot listen on {endpoint}: {exc}; another collector may be using it: stop it "
            f"or choose another {option}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
