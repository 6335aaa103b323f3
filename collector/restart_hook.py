"""``gradwatch restart-hook``: run one allow-listed command when a signed alert arrives.

A small stdlib HTTP server for jobs that are restarted from outside (a
scheduler's requeue, a ``kubectl`` call) rather than by the agent. Point one
of the collector's signed webhooks at it. Each POST is checked in order:

1. the Standard Webhooks signature and timestamp (``collector.signing``;
   tolerance 5 min) -> **401** when missing, wrong or stale;
2. the ``webhook-id`` was not seen in the tolerance window -> **409** on a replay;
3. the body is a firing gradwatch alert whose ``rule`` or ``category`` is
   allow-listed -> **422** otherwise;
4. the per-job budget and cooldown (as for rollbacks) and one command at a
   time -> **409** when exhausted or busy;

and then **202**: the configured argv list runs (never through a shell) with
the alert's fields in ``GRADWATCH_ALERT_*`` environment variables — nothing
from the request is ever put into the command line — bounded by ``timeout_s``.
Binds 127.0.0.1 by default.

Example::

    from gradwatch.collector.restart_hook import HookConfig, RestartHook

    hook = RestartHook(HookConfig(secret="whsec_...", command=["scontrol", "requeue", "123"],
                                  allow_categories=["numerical"]))
    hook.start()            # hook.port is the bound port
    hook.stop()
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from gradwatch.collector.actions import Budget
from gradwatch.collector.checkpoints import connect
from gradwatch.collector.config import ConfigError
from gradwatch.collector.settings_common import (
    env_prefix,
    settings_help,
    split_host_port,
    split_list,
)
from gradwatch.collector.signing import SignatureError, decode_secret, verify

log = logging.getLogger(__name__)

HOOK_FILE = "restart_hook.sqlite3"
ENV_PREFIX = "GRADWATCH_ALERT_"


class HookConfig(BaseSettings):
    """The hook's settings (YAML file, ``GRADWATCH_HOOK_*`` environment, flags)."""

    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_HOOK_", extra="forbid", frozen=True, case_sensitive=False
    )

    listen: str = Field(default="127.0.0.1:9402", description="HOST:PORT to bind.")
    secret: SecretStr | None = Field(
        default=None, description="The webhook's Standard Webhooks secret (whsec_...)."
    )
    secret_file: Path | None = Field(default=None, description="File holding the secret.")
    command: list[str] = Field(
        default_factory=list, description="argv of the one command to run (no shell)."
    )
    # NoDecode: the environment's one string is split by _split_lists (JSON list or commas).
    allow_rules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Rules that may run it (e.g. NonFiniteGradients)."
    )
    allow_categories: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Alert categories that may run it (e.g. numerical)."
    )
    timeout_s: float = Field(default=600.0, gt=0, description="Kill the command after this.")
    tolerance_s: float = Field(default=300.0, gt=0, description="Signature timestamp tolerance.")
    budget: int = Field(default=3, ge=0, description="Runs per job per budget_window_s.")
    budget_window_s: float = Field(
        default=6 * 3600.0, gt=0, description="Window of the budget, in seconds."
    )
    cooldown_s: float = Field(default=600.0, ge=0, description="Least time between two runs.")
    data_dir: Path | None = Field(
        default=None, description="Keep the budget in <dir>/restart_hook.sqlite3 (else memory)."
    )
    max_body_bytes: int = Field(
        default=1024 * 1024, ge=1024, description="Larger requests are refused with 413."
    )

    @field_validator("allow_rules", "allow_categories", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        return split_list(value, "names")

    @model_validator(mode="after")
    def _check(self) -> HookConfig:
        if not self.command:
            raise ValueError(
                "command: give the argv list to run, e.g. ['scontrol', 'requeue', "
                "'1234'] (after `--` on the command line)"
            )
        if not (self.allow_rules or self.allow_categories):
            raise ValueError(
                "allow_rules / allow_categories: allow-list at least one rule or "
                "category; the hook never runs for every alert"
            )
        if self.secret is None and self.secret_file is None:
            raise ValueError(
                "secret: set GRADWATCH_HOOK_SECRET or secret_file to the "
                "collector webhook's whsec_ secret; unsigned requests never run"
            )
        split_host_port(self.listen)
        return self

    def key(self) -> bytes:
        """The secret's key bytes (reads ``secret_file``); raises ``ConfigError``."""
        try:
            if self.secret is not None:
                return decode_secret(self.secret.get_secret_value())
            assert self.secret_file is not None
            return decode_secret(self.secret_file.read_text(encoding="utf-8"))
        except (OSError, SignatureError) as exc:
            raise ConfigError(f"restart hook secret: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Run:
    """One finished command: its alert, exit status (None: timed out) and duration."""

    alert_id: str
    returncode: int | None
    seconds: float


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: dict[str, Any]


class RestartHook:
    """The HTTP server, its checks and the command runner; see the module docstring."""

    def __init__(self, config: HookConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._key = config.key()
        self._clock = clock
        self._db = connect(None if config.data_dir is None else config.data_dir / HOOK_FILE)
        self.budget = Budget(self._db, config.budget, config.budget_window_s, config.cooldown_s)
        self._seen: dict[str, float] = {}
        self._lock = threading.Condition()
        self._running: threading.Thread | None = None
        self.runs: list[Run] = []
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        host, port = split_host_port(self.config.listen)
        hook = self

        class Handler(_Handler):
            owner = hook

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        # A short poll interval keeps stop() quick; the socket is idle between alerts.
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(0.1,), name="gradwatch-hook", daemon=True
        )
        self._thread.start()
        log.info(
            "restart hook listening on %s:%d; command %s", host, self.port, self.config.command[0]
        )

    @property
    def port(self) -> int:
        assert self._http is not None, "start() first"
        return int(self._http.server_address[1])

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and wait (bounded) for a running command to finish."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.wait_idle(timeout)
        self._db.close()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no command runs, at most ``timeout`` s; True if idle."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def handle(self, headers: Mapping[str, str], body: bytes) -> Answer:
        """Check one request and maybe start the command; thread-safe."""
        now = self._clock()
        try:
            msg_id = verify(self._key, headers, body, now=now, tolerance=self.config.tolerance_s)
        except SignatureError as exc:
            return Answer(401, {"error": f"signature check failed: {exc}"})
        with self._lock:
            for old in [m for m, t in self._seen.items() if now - t > 2 * self.config.tolerance_s]:
                del self._seen[old]  # its timestamp can no longer pass verify()
            if msg_id in self._seen:
                return Answer(
                    409,
                    {"error": f"webhook-id {msg_id!r} was already received; replays are refused"},
                )
            self._seen[msg_id] = now
        alert, problem = self._alert(body)
        if problem is not None:
            return Answer(422, {"error": problem})
        return self._maybe_run(alert, now)

    def _alert(self, body: bytes) -> tuple[dict[str, Any], str | None]:
        try:
            alert = json.loads(body)
        except ValueError:
            return {}, "the body is not JSON; expected a gradwatch alert"
        if not isinstance(alert, dict) or not all(
            isinstance(alert.get(k), str) for k in ("id", "rule", "category", "job", "state")
        ):
            return {}, "the body is not a gradwatch alert (needs id, rule, category, job, state)"
        if alert["state"] != "firing":
            return alert, f"only firing alerts run the command; this one is {alert['state']!r}"
        cfg = self.config
        if alert["rule"] not in cfg.allow_rules and alert["category"] not in cfg.allow_categories:
            return alert, (
                f"rule {alert['rule']!r} (category {alert['category']!r}) is not "
                "allow-listed; add it to allow_rules or allow_categories"
            )
        return alert, None

    def _maybe_run(self, alert: dict[str, Any], now: float) -> Answer:
        job, alert_id = alert["job"], alert["id"]
        with self._lock:
            if self._running is not None:
                return Answer(409, {"error": "the command is already running; try again later"})
            reason = self.budget.refusal(job, alert_id, now)
            if reason is not None:
                self.budget.record(job, alert_id, now, reason)
                used = self.budget.used(job, now)
                return Answer(
                    409,
                    {
                        "error": f"refused by the restart budget ({reason}): {used}/"
                        f"{self.config.budget} runs for job {job!r} in the "
                        f"window, cooldown {self.config.cooldown_s:.0f}s"
                    },
                )
            self.budget.record(job, alert_id, now, None)
            self._running = threading.Thread(
                target=self._run, args=(alert,), name="gradwatch-hook-command", daemon=True
            )
            self._running.start()
        log.warning(
            "restart hook: running %s for alert %s (%s, job %r)",
            self.config.command[0],
            alert_id,
            alert["rule"],
            job,
        )
        return Answer(202, {"accepted": True, "alert_id": alert_id})

    def _run(self, alert: dict[str, Any]) -> None:
        start = time.monotonic()
        code: int | None = None
        try:
            done = subprocess.run(
                self.config.command,
                env=alert_env(alert),
                shell=False,
                timeout=self.config.timeout_s,
                check=False,
                stdin=subprocess.DEVNULL,
            )
            code = done.returncode
            if code != 0:
                log.error("restart hook: %s exited with %d", self.config.command[0], code)
        except subprocess.TimeoutExpired:
            log.error(
                "restart hook: %s ran over %.0fs and was killed",
                self.config.command[0],
                self.config.timeout_s,
            )
        except OSError as exc:
            log.error("restart hook: cannot run %s: %s; fix `command`", self.config.command, exc)
        finally:
            with self._lock:
                self.runs.append(Run(alert["id"], code, time.monotonic() - start))
                self._running = None
                self._lock.notify_all()


def alert_env(alert: Mapping[str, Any]) -> dict[str, str]:
    """The process environment plus ``GRADWATCH_ALERT_<FIELD>`` for the alert's scalar fields.

    ``GRADWATCH_ALERT_JSON`` holds the whole alert. NULs are dropped (an
    environment cannot hold them); nothing here is ever interpreted by a shell.
    """
    env = dict(os.environ)
    for key in (
        "id",
        "rule",
        "category",
        "severity",
        "job",
        "rank",
        "state",
        "step",
        "summary",
        "last_good_checkpoint",
        "started_at",
    ):
        value = alert.get(key)
        if value is not None:
            env[ENV_PREFIX + key.upper()] = str(value).replace("\0", "")
    env[ENV_PREFIX + "JSON"] = json.dumps(alert).replace("\0", "")
    return env


class _Handler(BaseHTTPRequestHandler):
    owner: RestartHook
    server_version = "gradwatch-restart-hook"

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= self.owner.config.max_body_bytes:
            self._answer(
                Answer(
                    413 if length else 411,
                    {
                        "error": "a body of 1 byte to "
                        f"{self.owner.config.max_body_bytes} bytes is required"
                    },
                )
            )
            return
        body = self.rfile.read(length)
        self._answer(self.owner.handle(dict(self.headers.items()), body))

    def _answer(self, answer: Answer) -> None:
        data = json.dumps({"status": HTTPStatus(answer.status).phrase, **answer.body}).encode()
        self.send_response(answer.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("restart hook: " + format, *args)


SETTINGS_INTRO = (
    f"settings: each is a key of the --config YAML file and a {env_prefix(HookConfig)}<KEY>",
    "environment variable (allow_rules, allow_categories: a JSON list or comma-separated;",
    "command: a JSON list, or the ARGV after `--`). Flags beat the environment, which",
    "beats the file.",
)


def hook_parser(prog: str = "gradwatch restart-hook") -> argparse.ArgumentParser:
    """The command line; its ``--help`` lists every ``HookConfig`` setting."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run one allow-listed command when a signed gradwatch alert arrives "
        "(Standard\nWebhooks). The secret comes from GRADWATCH_HOOK_SECRET or --secret-file; "
        "the\ncommand follows `--` and never runs through a shell.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML config file")
    parser.add_argument("--listen", metavar="HOST:PORT", help="default 127.0.0.1:9402")
    parser.add_argument("--secret-file", type=Path, metavar="FILE")
    parser.add_argument("--allow-rule", dest="allow_rules", action="append", metavar="RULE")
    parser.add_argument(
        "--allow-category", dest="allow_categories", action="append", metavar="CATEGORY"
    )
    parser.add_argument("--timeout", dest="timeout_s", type=float, metavar="SECONDS")
    parser.add_argument("--data-dir", type=Path, metavar="DIR", help="persist the budget here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ARGV...")
    parser.epilog = settings_help(HookConfig, parser, SETTINGS_INTRO)
    return parser


def load_hook_config(path: Path | None, flags: Mapping[str, Any]) -> HookConfig:
    """File < environment < flags, as for the collector; raises ``ConfigError``."""
    values: dict[str, Any] = {}
    try:
        if path is not None:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"restart hook config {path} must be a mapping of keys")
            values = {str(k).replace("-", "_"): v for k, v in loaded.items()}
        # pydantic-settings ranks init arguments above the environment: drop the
        # file's value of every key the environment sets, so the environment wins.
        in_env = {
            name
            for name in HookConfig.model_fields
            if f"GRADWATCH_HOOK_{name.upper()}" in {k.upper() for k in os.environ}
        }
        merged = {k: v for k, v in values.items() if k not in in_env}
        merged.update({k: v for k, v in flags.items() if v is not None and v != []})
        return HookConfig(**merged)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read restart hook config {path}: {exc}") from exc
    except ValidationError as exc:
        problems = "\n".join(
            f"  {'.'.join(map(str, e['loc'])) or '(config)'}: "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid restart hook configuration:\n{problems}") from exc
    except SettingsError as exc:  # a GRADWATCH_HOOK_* list that is not JSON
        raise ConfigError(
            f"invalid restart hook configuration: {exc}: {exc.__cause__ or 'bad value'}; set "
            "that GRADWATCH_HOOK_<KEY> environment variable to a JSON list, e.g. "
            '\'["scontrol", "requeue", "1234"]\', or unset it'
        ) from exc


def hook_main(argv: Sequence[str] | None = None) -> int:
    """``gradwatch restart-hook [...] -- ARGV``: serve until SIGTERM/SIGINT."""
    args = hook_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    flags = {
        "listen": args.listen,
        "secret_file": args.secret_file,
        "allow_rules": args.allow_rules,
        "allow_categories": args.allow_categories,
        "timeout_s": args.timeout_s,
        "data_dir": args.data_dir,
        "command": command,
    }
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        hook = RestartHook(load_hook_config(args.config, flags))
        hook.start()
    except (ConfigError, OSError) as exc:
        print(f"gradwatch restart-hook: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    hook.stop()
    return 0
