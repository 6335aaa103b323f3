"""The collector process: sockets, threads and shutdown, around pure parts.

``Server(config)`` owns a ZeroMQ PULL socket and an ingest thread that hands
each message to the :class:`~gradwatch.collector.pipeline.Pipeline`
(``Ingest`` -> ``StateStore`` -> rules ``Engine`` -> actions and sinks: steps
and evals as they arrive; every rank's liveness from the state about once a
second of the injected clock, see :meth:`Server.tick`), the command socket
(:mod:`~gradwatch.collector.subscriptions`: rollbacks, and takeovers of a silent
reporter's layers, :mod:`~gradwatch.collector.takeover`), an HTTP server for
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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import zmq
from prometheus_client import REGISTRY, CollectorRegistry

from gradwatch.collector.actions import Actions, action_settings
from gradwatch.collector.actions_metrics import ActionsMetrics
from gradwatch.collector.admission_metrics import AdmissionMetrics
from gradwatch.collector.assembly_metrics import AssemblyMetrics
from gradwatch.collector.auth import (
    AuthCounters,
    CurveAuth,
    build_auth,
    check_profile,
    metrics_security,
)
from gradwatch.collector.config import CollectorConfig, CollectorError
from gradwatch.collector.exposition import GradwatchCollector
from gradwatch.collector.httpd import MetricsHTTPServer
from gradwatch.collector.ingest import Ingest
from gradwatch.collector.inhibition import Inhibition, InhibitionMetrics
from gradwatch.collector.limits import Admission, Bounds
from gradwatch.collector.outbox import OutboxSink
from gradwatch.collector.pipeline import Pipeline
from gradwatch.collector.priority import Intake, PriorityMetrics
from gradwatch.collector.process_metrics import serve_off_thread
from gradwatch.collector.recorder import TraceRecorder
from gradwatch.collector.sinks import Sink, mask_url
from gradwatch.collector.startup import check_open_files, warn_exposure
from gradwatch.collector.state import StateStore
from gradwatch.collector.subscriptions import CommandChannel, bind_socket
from gradwatch.collector.takeover import TakeoverMetrics, Takeovers, silent_threshold
from gradwatch.collector.wiring import (
    RulesEngine,
    StoreErrorMetrics,
    build_engine,
    build_sinks,
)
from gradwatch.rules.assembly import Assembler

log = logging.getLogger(__name__)

POLL_MS = 100  # how long the ingest thread blocks before checking for stop
EXPIRE_EVERY_S = 1.0  # how often silent jobs are looked for
LIVENESS_EVERY_S = 1.0  # how often (injected clock) the liveness rules are ticked
OVERSIZE_HEADROOM = 4  # ZeroMQ MAXMSGSIZE = this x max_message_bytes: see _bind
DRAIN_BUDGET = 1000  # messages handled between stop/expiry checks
TICK_S = 0.1  # run_until_signal's flag check period


def _nothing() -> None:
    return None


class Server:
    """One collector: see the module docstring. Not restartable once stopped."""

    def __init__(
        self,
        config: CollectorConfig,
        engine: RulesEngine | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        self.config = config
        self.registry = registry if registry is not None else REGISTRY
        self._restore_process: Callable[[], None] = _nothing  # serve_off_thread's undo
        self._clock = clock
        self.sinks: list[Sink] = list(sinks) if sinks is not None else build_sinks(config)
        self.admission = Admission(Bounds.of(config))
        self.ingest = Ingest(
            config.max_message_bytes,
            admit=lambda message: self.admission.admit(message, self.intake.sender),
        )
        self.ingest.may_grow = lambda job, rank: self.admission.may_grow(
            job, rank, self.intake.sender
        )
        self._admission_metrics = AdmissionMetrics(self.admission)
        self.recorder = TraceRecorder(config.record_dir) if config.record_dir is not None else None
        self.state = StateStore(config.job_ttl_seconds, clock, config.finished_grace_seconds)
        self.assembler = Assembler(config.assembly_deadline_seconds, clock)
        self.pipeline = Pipeline(
            config,
            self.ingest,
            self.state,
            self.assembler,
            self.sinks,
            self.recorder,
            self.admission,
        )
        self.pipeline.engine = engine
        # Socket -> pipeline in arrival order; flagged NaNs page on arrival (priority.py).
        self.intake: Intake = Intake(self.pipeline, self.admission)
        self._exposition = GradwatchCollector(
            self.state,
            self.ingest.stats,
            self.pipeline.firing,
            self.sinks,
            per_layer_metrics=config.per_layer_metrics,
            max_layer_series=config.max_layer_series,
            max_block_series=config.max_block_series,
            max_rank_series=config.max_rank_series,
            max_series_per_family=config.max_series_per_family,
        )
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._endpoint: str | None = None
        self._http: MetricsHTTPServer | None = None
        self._ingest_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._drain_deadline = 0.0
        self._next_liveness = -float("inf")
        self._registered = False
        self._released = False
        self._wrote_ready_file = False
        # Registered by start(): actions, store errors, takeovers, assembly.
        self._more_metrics: list[Any] = []
        self._commands: CommandChannel | None = None  # only with a command key
        self.takeovers = Takeovers(None, None, clock)  # set up by start(), with the rules
        self._exit_requested = False
        self.auth_counters = AuthCounters()  # exposed only while CURVE is on
        self._auth: CurveAuth | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Load rules, bind, serve. Raises ``RuleFileError`` or ``CollectorError``."""
        if self._ingest_thread is not None or self._stopping.is_set():
            raise CollectorError("a Server starts once; build a new one to start again")
        if self.pipeline.engine is None:
            self.pipeline.engine = build_engine(self.config, self._clock)
        rules = getattr(self.pipeline.engine, "rules", ())
        self.pipeline.inhibition = Inhibition(rules)  # one page per cause (collector/inhibition.py)
        check_profile(self.config, {r.name: r.actions for r in rules})
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
                host,
                port,
                self.registry,
                lambda: self.ready,
                max_connections=self.config.http_max_connections,
                read_timeout=self.config.http_read_timeout_seconds,
                **metrics_security(self.config),
            )
            self.registry.register(self._http.connections)
            self.registry.register(self._exposition)
            self._registered = True
            self.registry.register(self._admission_metrics)
            assert self.actions is not None
            self._more_metrics = [
                ActionsMetrics(self.actions),
                StoreErrorMetrics(self.sinks, lambda: self.actions, self.recorder),
                TakeoverMetrics(self.takeovers),
                AssemblyMetrics(self.assembler, self.pipeline.assembler_lock, jobs=self.state.jobs),
                PriorityMetrics(self.intake.lane, self.intake.inbox),
                InhibitionMetrics(self.pipeline.inhibition),
            ]
            for metrics in self._more_metrics:
                self.registry.register(metrics)
            # process_* off the scrape's thread (collector/process_metrics.py: a scrape
            # waited 1.0-1.4 s for it during a 16,384-rank flush burst).
            self._restore_process = serve_off_thread(self.registry)
            for sink in self.sinks:
                if self._auth is not None and isinstance(sink, OutboxSink):
                    sink.share_of = self.admission.sender_of  # per-key shares of the outbox
                sink.start()
        except BaseException:
            self._release()
            raise
        self._ingest_thread = threading.Thread(
            target=self._ingest_loop, name="gradwatch-ingest", daemon=True
        )
        self._ingest_thread.start()
        if self.config.ready_file is not None:
            try:
                self._write_ready_file(self.config.ready_file)
            except OSError as exc:
                self.stop()
                raise CollectorError(
                    f"cannot write the ready file {self.config.ready_file}: "
                    f"{exc.strerror or exc}; check that its directory exists"
                ) from exc
        log.info(
            "collector receiving on %s; metrics on %s; webhooks: %s",
            self._endpoint,
            self.metrics_url,
            ", ".join(mask_url(url) for url in self.config.webhooks) or "none",
        )

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

    @property
    def actions(self) -> Actions | None:
        """The rollback and restart actions (built by ``start()``)."""
        return self.pipeline.actions

    @property
    def assembler_lock(self) -> threading.Lock:
        """Held while the assembler is used: the ingest thread assembles, a scrape reads."""
        return self.pipeline.assembler_lock

    @property
    def command_endpoint(self) -> str | None:
        """Where agents subscribe to commands; None without a command key."""
        return self._commands.endpoint if self._commands is not None else None

    def wait_for_messages(self, count: int, timeout: float) -> bool:
        """Block until ``count`` messages (valid or not) have been handled since start."""
        return self.pipeline.wait_for(count, timeout)

    @property
    def messages_handled(self) -> int:
        return self.pipeline.handled

    def tick(self) -> None:
        """Judge every known rank's liveness now and send the transitions to the sinks;
        publish the takeovers that changed (collector/takeover.py).

        The ingest thread calls this about once a second of the injected
        clock; tests call it directly after moving a fake clock. Never raises.
        """
        self.pipeline.tick()
        self.takeovers.tick(self.state)

    # ---------------------------------------------------------------- ingest

    def _ingest_loop(self) -> None:
        assert self._socket is not None
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        commands = self._commands.socket if self._commands is not None else None
        if commands is not None:
            poller.register(commands, zmq.POLLIN)  # XPUB: agents (un)subscribing
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        try:
            while not self._stopping.is_set():
                waiting = bool(self.intake.inbox)  # received, not handled yet
                ready = dict(poller.poll(0 if waiting else POLL_MS))
                if sock in ready or waiting:
                    self.intake.drain(sock, lambda n: n < DRAIN_BUDGET)
                if commands is not None and commands in ready:
                    assert self._commands is not None
                    self._commands.read_subscriptions()
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + EXPIRE_EVERY_S
                    self.pipeline.expire()
                self.pipeline.expire_assembly()
                now = self._clock()
                # Also when the clock went back (a stepped one, or a test's).
                if now >= self._next_liveness or self._next_liveness > now + LIVENESS_EVERY_S:
                    self._next_liveness = now + LIVENESS_EVERY_S
                    self.tick()
            # Stopping: handle what has already arrived, within the deadline.
            self.intake.drain(sock, lambda n: time.monotonic() < self._drain_deadline)
        except Exception:
            log.exception("the ingest thread failed; the collector is no longer ready")
        finally:
            sock.close(linger=0)

    # ---------------------------------------------------------------- resources

    def _bind(self) -> None:
        self._context = zmq.Context()
        # Keys are read before any socket exists: a bad key file leaves nothing to close.
        self._auth = build_auth(self.config, self._context, self.auth_counters)
        self.intake.auth = self._auth
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
        self._endpoint = bind_socket(sock, self.config.listen, "--listen")

    def _start_actions(self) -> None:
        """Bind the command socket (only with a command key) and build the actions."""
        settings = action_settings(self.config)
        rules = getattr(self.pipeline.engine, "rules", ())
        send: Callable[[list[bytes]], None] | None = None
        if settings.key is not None:
            assert self._context is not None
            secure = self._auth.secure if self._auth is not None else None
            self._commands = CommandChannel.bind(self._context, self.config.command_listen, secure)
            send = self._commands.send
            log.info(
                "commands (rollback, takeover; HMAC-signed, not encrypted) on %s",
                self.command_endpoint,
            )
        self.pipeline.actions = Actions(
            settings,
            {r.name: r.actions for r in rules},
            send,
            self._clock,
            listening=self.listening,
        )
        rules_silent_s = silent_threshold(getattr(self.pipeline.engine, "rules", ()))
        self.takeovers.set_up(settings.key, send, rules_silent_s)

    def listening(self, job: str) -> bool:
        """Whether an agent of ``job`` is subscribed to rollback commands now."""
        return self._commands is not None and self._commands.listening(job)

    def wait_for_listener(self, job: str, timeout: float) -> bool:
        """Block until an agent of ``job`` subscribes to commands, at most ``timeout`` s."""
        return self._commands is not None and self._commands.wait_for_listener(job, timeout)

    def _write_ready_file(self, path: Path) -> None:
        # Written whole then renamed: a reader never sees half a file.
        body = {"listen": self.bound_endpoint, "metrics_url": self.metrics_url, "pid": os.getpid()}
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(body), encoding="utf-8")
        os.replace(partial, path)
        self._wrote_ready_file = True

    def _alive(self) -> bool:
        return (
            self._http is not None
            and self._http.alive()
            and self._ingest_thread is not None
            and self._ingest_thread.is_alive()
            and all(sink.alive() for sink in self.sinks)
        )

    def _release(self, term: bool = True) -> None:
        if self._released:
            return
        self._released = True
        if self._wrote_ready_file and self.config.ready_file is not None:
            self.config.ready_file.unlink(missing_ok=True)
        self._exposition.close()  # its snapshot refresher, if large jobs started one
        self._restore_process()
        self._restore_process = _nothing
        if self._registered:
            self.registry.unregister(self._exposition)
            self.registry.unregister(self._admission_metrics)
            self._registered = False
        for metrics in self._more_metrics:
            with contextlib.suppress(KeyError):  # start() may have failed before registering
                self.registry.unregister(metrics)
        self._more_metrics = []
        if self._http is not None:
            with contextlib.suppress(KeyError):
                self.registry.unregister(self._http.connections)
            self._http.close()
        if self._socket is not None and self._ingest_thread is None:
            self._socket.close(linger=0)  # never handed to the ingest thread
        if self._commands is not None:
            self._commands.close()
        if self.actions is not None:
            self.actions.close()
        if self._auth is not None:
            self._auth.close()
            with contextlib.suppress(KeyError):  # start() may have failed before registering
                self.registry.unregister(self.auth_counters)
        if self._context is not None and term:
            self._context.term()
        self._context = None
