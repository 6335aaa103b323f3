"""Who may talk to the collector: CURVE on its sockets, per-job allow-list, profiles.

With ``curve_secret_key_file`` and ``curve_allow_file`` set, the ingest PULL
and the command XPUB sockets are CurveZMQ servers (encrypted, and only clients
whose public key is in the allow-list complete the handshake; a ZAP handler,
pyzmq's ``ThreadAuthenticator``, asks :class:`CurveAuth`). Each accepted
message carries the sender's key as its ZAP User-Id, and :meth:`CurveAuth.permits`
drops any message whose job the key may not report. Every refusal is counted in
``gradwatch_auth_refused_total{reason}`` and logged once per key and reason:

* ``unknown_key``: a CURVE client whose key is not (or no longer) allowed;
* ``no_key``: a client that did not use CURVE (plain ZeroMQ: a mechanism
  mismatch, or it hung up during the handshake, as a port scanner also does);
* ``bad_handshake``: a failed CURVE handshake (a wrong server key, garbage);
* ``job_not_allowed``: an allowed key sent a job outside its patterns;
* ``malformed``: a message whose job could not be read (dropped, never ingested).

The allow-list file is re-read when it changes (checked at most once a second),
so keys are added and revoked without a restart.

Example::

    import zmq
    from pathlib import Path
    from gradwatch.collector.auth import AuthCounters, CurveAuth

    context = zmq.Context()
    auth = CurveAuth(context, Path("keys/collector.key_secret"), Path("allow.yaml"),
                     AuthCounters())
    auth.start()
    sock = context.socket(zmq.PULL)
    auth.secure(sock)      # before bind
    sock.bind("tcp://127.0.0.1:5555")
    auth.start_monitoring()  # count plain clients and failed handshakes
    ...
    sock.close(linger=0)
    auth.close()
    context.term()
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import zmq
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from gradwatch.collector.config import CollectorConfig, ConfigError
from gradwatch.collector.httpd import tls_context
from gradwatch.collector.keys import AllowList, load_allow_list, load_key_file
from gradwatch.collector.sinks import read_secret
from gradwatch.wire.messages import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

REASONS = ("unknown_key", "no_key", "bad_handshake", "job_not_allowed", "malformed")
ZAP_DOMAIN = "gradwatch"
RELOAD_EVERY_S = 1.0
MAX_LOGGED = 1024  # distinct (reason, key) pairs logged; later ones are only counted
MONITOR_POLL_MS = 100
PREAMBLE_BYTES = 4  # the wire header's b"GW", version, kind (docs/wire.md)
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class AuthCounters(Collector):
    """Refusals by reason, thread-safe; also a prometheus-client custom collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self._logged: set[tuple[str, str]] = set()

    def refuse(self, reason: str, who: str, message: str, *args: object) -> None:
        """Count one refusal; log it the first time for this (reason, who)."""
        with self._lock:
            self._counts[reason] += 1
            # Bounded: an attacker cycling random keys must not grow memory or the log.
            first = (reason, who) not in self._logged and len(self._logged) < MAX_LOGGED
            if first:
                self._logged.add((reason, who))
        if first:
            log.warning(
                message + " (further refusals of this kind are only counted in "
                "gradwatch_auth_refused_total)",
                *args,
            )

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "gradwatch_auth_refused",
            "Connections and messages the collector refused, by reason (see SECURITY.md).",
            labels=["reason"],
        )
        for reason, count in sorted(self.counts().items()):
            family.add_metric([reason], count)
        yield family


class CurveAuth:
    """The server key, the ZAP handler and the allow-list of one collector context."""

    def __init__(
        self,
        context: zmq.Context[Any],
        secret_key_file: Path,
        allow_file: Path,
        counters: AuthCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.public_key, secret = load_key_file(secret_key_file, need_secret=True)
        assert secret is not None
        self._secret = secret
        self._allow_file = allow_file
        self._allow = load_allow_list(allow_file)
        self._allow_mtime = _mtime(allow_file)
        self._next_check = clock() + RELOAD_EVERY_S
        self._clock = clock
        self._lock = threading.Lock()
        self._allowed_jobs: dict[tuple[str, str], bool] = {}
        self.counters = counters
        self._authenticator = ThreadAuthenticator(context, log=log.getChild("zap"))
        self._monitors: list[zmq.Socket[Any]] = []
        self._stop = threading.Event()
        self._monitor_thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the ZAP handler; call before any secured socket binds."""
        self._authenticator.start()
        self._authenticator.configure_curve_callback(ZAP_DOMAIN, self)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server that asks this handler; call before ``bind``."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        # Plain-ZeroMQ clients fail before ZAP is asked: only a monitor sees them.
        self._monitors.append(sock.get_monitor_socket(_FAILED))

    def start_monitoring(self) -> None:
        """Count failed handshakes from a daemon thread (after every ``secure``)."""
        self._monitor_thread = threading.Thread(
            target=self._watch_handshakes, name="gradwatch-auth-monitor", daemon=True
        )
        self._monitor_thread.start()

    def close(self) -> None:
        """Stop the ZAP handler and the monitor thread; the secured sockets stay the caller's."""
        self._stop.set()
        if self._monitor_thread is not None:
            self._monitor_thread.join(1.0)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._monitors.clear()
        self._authenticator.stop()

    # ------------------------------------------------------------ ZAP thread

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: is this Z85 client key allowed at all?"""
        text = key.decode("ascii", "replace")
        if self.allow_list().jobs_of(text) is not None:
            return True
        self.counters.refuse(
            "unknown_key",
            text,
            "refused a CURVE client with unknown key "
            "%s: add it with `gradwatch keys allow` if it is yours",
            text,
        )
        return False

    # ------------------------------------------------------------ ingest thread

    def permits(self, frames: Sequence[zmq.Frame]) -> bool:
        """Whether the message's sender (its ZAP User-Id) may report the message's job."""
        try:
            key = str(frames[0].get("User-Id"))
        except (zmq.ZMQError, IndexError):
            key = ""
        allow = self.allow_list()
        patterns = allow.jobs_of(key)
        if patterns is None:
            self.counters.refuse(
                "unknown_key",
                key,
                "dropped a message from key %r, which is no longer in %s",
                key,
                self._allow_file,
            )
            return False
        job = job_of(frames[0].bytes)
        if job is None:
            self.counters.refuse(
                "malformed",
                key,
                "dropped a message from %s whose job cannot be read",
                allow.name_of(key),
            )
            return False
        with self._lock:
            ok = self._allowed_jobs.get((key, job))
            if ok is None:
                ok = any(fnmatchcase(job, pattern) for pattern in patterns)
                if len(self._allowed_jobs) < 65_536:  # bounded: jobs come and go
                    self._allowed_jobs[(key, job)] = ok
        if not ok:
            self.counters.refuse(
                "job_not_allowed",
                f"{key}/{job}",
                "dropped messages of job %r from %s: its key may report only %s (see %s)",
                job,
                allow.name_of(key),
                ", ".join(patterns),
                self._allow_file,
            )
        return ok

    def allow_list(self) -> AllowList:
        """The current allow-list, re-read when its file changed (kept if the new one is bad)."""
        with self._lock:
            now = self._clock()
            if now < self._next_check:
                return self._allow
            self._next_check = now + RELOAD_EVERY_S
            mtime = _mtime(self._allow_file)
            if mtime == self._allow_mtime:
                return self._allow
            self._allow_mtime = mtime
            try:
                self._allow = load_allow_list(self._allow_file)
                self._allowed_jobs.clear()
                log.info(
                    "reloaded the CURVE allow-list %s (%d keys)",
                    self._allow_file,
                    len(self._allow.clients),
                )
            except ConfigError as exc:
                log.error("%s; still using the previous allow-list", exc)
            return self._allow

    # ------------------------------------------------------------ monitor thread

    def _watch_handshakes(self) -> None:
        poller = zmq.Poller()
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for monitor, _ in poller.poll(MONITOR_POLL_MS):
                    self._count_failure(recv_monitor_message(monitor, zmq.NOBLOCK))
        except zmq.ZMQError as exc:  # the context is going away
            log.debug("auth monitor stopped: %s", exc)

    def _count_failure(self, event: Mapping[str, Any]) -> None:
        if not event["event"] & _FAILED:
            return  # e.g. MONITOR_STOPPED as a secured socket closes
        endpoint = event.get("endpoint", b"")
        where = endpoint.decode("utf-8", "replace") if isinstance(endpoint, bytes) else endpoint
        # A plain client and our CURVE greeting race: either we see the mechanism
        # mismatch, or the client sees it first and hangs up mid-handshake (NO_DETAIL).
        if (
            event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            or event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            self.counters.refuse(
                "no_key",
                where,
                "refused a plain (unencrypted) ZeroMQ client "
                "on %s: agents need GRADWATCH_CURVE_SERVER_KEY and a key pair "
                "in the allow-list",
                where,
            )
        else:
            self.counters.refuse(
                "bad_handshake",
                where,
                "a CURVE handshake on %s failed "
                "(ZeroMQ event %s, code %#x): a wrong server key, or not a "
                "gradwatch agent",
                where,
                event["event"],
                event["value"],
            )


def job_of(header: bytes) -> str | None:
    """The job a message's header frame names, or None; one JSON parse, no full decode."""
    if len(header) > MAX_HEADER_BYTES:
        return None  # the wire decoder refuses it too
    try:
        body = json.loads(header[PREAMBLE_BYTES:])
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return None
    job = body.get("job") if isinstance(body, dict) else None
    return job if isinstance(job, str) else None


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def build_auth(
    config: CollectorConfig, context: zmq.Context[Any], counters: AuthCounters
) -> CurveAuth | None:
    """The started handler for ``config``'s CURVE keys, or None when they are not set."""
    if config.curve_secret_key_file is None or config.curve_allow_file is None:
        return None
    auth = CurveAuth(context, config.curve_secret_key_file, config.curve_allow_file, counters)
    auth.start()
    log.info(
        "CurveZMQ on: server public key %s, %d allowed agent keys in %s",
        auth.public_key.decode("ascii"),
        len(auth.allow_list().clients),
        config.curve_allow_file,
    )
    return auth


# ---------------------------------------------------------------- profiles


def production_problems(
    config: CollectorConfig, rule_actions: Mapping[str, Sequence[str]]
) -> list[str]:
    """Why ``config`` may not run under ``profile: production`` (empty: it may)."""
    problems = []
    if config.curve_secret_key_file is None or config.curve_allow_file is None:
        problems.append(
            "set curve_secret_key_file and curve_allow_file: production ingests "
            "only from CURVE-authenticated agents (`gradwatch keys generate`)"
        )
    rollback = sorted(name for name, acts in rule_actions.items() if "rollback" in acts)
    if rollback and config.command_key is None and config.command_key_file is None:
        problems.append(
            f"rules {', '.join(rollback)} ask for rollback: set command_key_file "
            "(or remove the rollback action)"
        )
    if not loopback(config.metrics_host_port[0]):
        if config.metrics_basic_auth_user is None:
            problems.append(
                "metrics_addr is not a loopback address: set "
                "metrics_basic_auth_user and metrics_basic_auth_password_file"
            )
        if config.metrics_tls_cert_file is None:
            problems.append(
                "metrics_addr is not a loopback address: set metrics_tls_cert_file "
                "and metrics_tls_key_file (basic auth over plain HTTP leaks)"
            )
    if config.webhooks and config.webhook_secret is None and config.webhook_secret_file is None:
        problems.append(
            "webhooks are set but unsigned: set webhook_secret_file so receivers "
            "can tell gradwatch's alerts from forged ones"
        )
    return problems


def check_profile(config: CollectorConfig, rule_actions: Mapping[str, Sequence[str]]) -> None:
    """Raise ``ConfigError`` listing every production rule ``config`` breaks (dev: nothing)."""
    if config.profile != "production":
        return
    problems = production_problems(config, rule_actions)
    if problems:
        raise ConfigError(
            "profile 'production' refuses to start:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nFix these (see SECURITY.md) or run with profile: dev."
        )


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (a host name other than localhost is not)."""
    if host == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def metrics_security(config: CollectorConfig) -> dict[str, Any]:
    """``MetricsHTTPServer`` keyword arguments (``tls``, ``basic_auth``) for ``config``."""
    tls = None
    if config.metrics_tls_cert_file is not None and config.metrics_tls_key_file is not None:
        tls = tls_context(config.metrics_tls_cert_file, config.metrics_tls_key_file)
    basic_auth = None
    if config.metrics_basic_auth_user is not None:
        password = read_secret(
            config.metrics_basic_auth_password,
            config.metrics_basic_auth_password_file,
            "metrics_basic_auth_password",
        )
        if password is None:
            raise ConfigError("metrics_basic_auth_password is empty; set a password")
        basic_auth = (config.metrics_basic_auth_user, password)
    return {"tls": tls, "basic_auth": basic_auth}
