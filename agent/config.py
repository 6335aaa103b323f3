"""The agent's settings: a pure, validated value; building one does no I/O.

Example::

    >>> from gradwatch.agent.config import AgentConfig
    >>> cfg = AgentConfig(job="run-42", rank=0, world=1)
    >>> cfg.flush_every, cfg.endpoint
    (10, 'tcp://127.0.0.1:5555')
    >>> AgentConfig(job="", rank=0, world=1)
    Traceback (most recent call last):
    ...
    ValueError: job must be 1 to 128 printable characters, got ''
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradwatch.wire.fields import MAX_JOB_CHARS, MAX_RANK
from gradwatch.wire.messages import MAX_ROWS

if TYPE_CHECKING:
    from gradwatch.agent.topology import Layout

MAX_STEP = 2**62  # the wire's bound on step numbers

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
# Collectors one agent may feed (agent/destinations.py): an HA pair is the intended use;
# more would multiply the agent's sends for no gain.
MAX_ENDPOINTS = 4
# Not GRADWATCH_CURVE_SECRET_KEY_FILE: that is the collector's own setting, and
# both may live in one environment (a demo, a test, a sidecar pod).
ENV_CURVE_SERVER_KEY = "GRADWATCH_CURVE_SERVER_KEY"
ENV_CURVE_SERVER_KEY_FILE = "GRADWATCH_CURVE_SERVER_KEY_FILE"
ENV_CURVE_SECRET_KEY_FILE = "GRADWATCH_AGENT_CURVE_SECRET_KEY_FILE"
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything ``watch()`` accepts that is not the model, optimizer or scaler.

    The last group are tuning knobs with safe defaults; they bound how much
    memory the agent can hold when the collector is slow or absent.
    """

    job: str
    rank: int
    world: int
    # Ranks one replica's gradients are split across (agent/topology.py):
    # 1 replicated (DDP), world fully sharded (FSDP/ZeRO).
    shards: int = 1
    endpoint: str = DEFAULT_ENDPOINT
    flush_every: int = 10
    heartbeat_every: float = 2.0
    # Every this many steps the agent also ships cadence statistics (weight
    # norms); 0 switches them off.
    stats_every: int = 50
    # On cadence steps, also measure forward activations (forward hooks armed
    # for that step's forward pass only) of at most this many modules.
    activation_stats: bool = True
    max_act_modules: int = 256
    # (module name pattern, activation kind): modules whose input is the output of a
    # functional activation (F.gelu...), measured as that kind (agent/activations.py).
    activation_modules: tuple[tuple[str, str], ...] = ()
    # On cadence steps, also send each layer's update ratio ||dw||/||w||, estimated
    # on a fixed sample of elements per tensor (agent/weightstats.py; docs/agent-cost.md).
    update_ratios: bool = True
    # Cadence statistics dense at the start and after data_changed, backing off to
    # stats_every (agent/cadence.py); False: exactly every stats_every steps.
    early_stats: bool = True
    # False: the logged loss is no supervised loss (RL, a GAN's generator); sent in the
    # census, so the rules that read its shape as one's do not judge it (rules/engine.py).
    supervised_loss: bool = True
    # The phase clock: forward pre/post hooks on the model timing each step's wait for
    # data and its forward (agent/recording.py). What they measure serves the rules of a
    # job of several ranks (a straggler, the rank a hung job waits for); watch() turns
    # them on there, and in a loop without an optimizer (its first forward is where the
    # initial weights are read), and off in a single process, where their cost (~20 us a
    # step on a small model, docs/agent-cost.md) buys nothing.
    phase_clock: bool = True
    # Host buffers in flight between the training thread and the shipper.
    # Four covers one being encoded, one queued and two being copied.
    pool_size: int = 4
    # Queue slots for eval/checkpoint events, on top of the pool's batches.
    max_pending_events: int = 64
    # ZeroMQ send high-water mark: messages held for a slow collector.
    send_hwm: int = 16
    # The schema is resent at least this often, so a collector that started
    # late (or lost its state) learns the layer names within this bound.
    schema_every_s: float = 30.0
    # Device column slots allocated up front; doubles if a loop logs more.
    device_columns: int = 16
    # How long close() waits for the last batch to leave.
    close_timeout: float = 2.0
    # Rollback commands (gradwatch.agent.commands): the collector's command
    # socket (None: off), the shared HMAC key, and what a rollback does:
    # "return" hands it to mon.pending_rollback(), "exit" writes resume_file
    # and exits with ROLLBACK_EXIT_CODE at the next step boundary.
    command_endpoint: str | None = None
    command_key: bytes | None = field(default=None, repr=False)
    on_rollback: str = "return"
    resume_file: str | None = None
    # CurveZMQ (SECURITY.md): the collector's public key (a NAME.key file, or its
    # 40-character Z85 text) and this agent's NAME.key_secret, which holds both
    # halves of its pair. None: $GRADWATCH_CURVE_SERVER_KEY(_FILE) and
    # $GRADWATCH_AGENT_CURVE_SECRET_KEY_FILE, read when the shipper starts.
    curve_server_public_key_file: str | None = None
    curve_secret_key_file: str | None = None
    # The number of the first logged step (agent/steps.py); 1 unless resuming.
    start_step: int = 1
    # The job's parallel layout (agent/topology.py), and whether this rank sends
    # per-layer norms: one replica per model shard does; the others send the
    # loss, a non-finite-gradient flag, phases, heartbeats and events only.
    layout: Layout | None = None
    reports_layers: bool = True

    def __post_init__(self) -> None:
        if not (0 < len(self.job) <= MAX_JOB_CHARS and self.job.isprintable()):
            raise ValueError(
                f"job must be 1 to {MAX_JOB_CHARS} printable characters, got {self.job!r}"
            )
        if not 1 <= self.world <= MAX_RANK + 1 or not 0 <= self.rank < self.world:
            raise ValueError(
                f"rank {self.rank} / world {self.world} is not a valid pair: need "
                "0 <= rank < world; pass rank= and world= or set RANK and WORLD_SIZE"
            )
        if not 1 <= self.shards <= self.world or self.world % self.shards:
            raise ValueError(
                f"shards={self.shards} must divide the world size {self.world}: 1 for DDP "
                f"(replicated gradients), {self.world} for FSDP/ZeRO, the shard group size "
                "for hybrid sharding"
            )
        if not 1 <= self.flush_every <= MAX_ROWS:
            raise ValueError(f"flush_every must be in [1, {MAX_ROWS}], got {self.flush_every}")
        if not 0 <= self.start_step < MAX_STEP:
            raise ValueError(f"start_step must be in [0, {MAX_STEP}), got {self.start_step}")
        if self.stats_every < 0:
            raise ValueError(
                f"stats_every must be >= 0 (0: no cadence statistics), got {self.stats_every}"
            )
        if not self.heartbeat_every > 0:
            raise ValueError(f"heartbeat_every must be > 0 seconds, got {self.heartbeat_every}")
        for name in (
            "pool_size",
            "max_pending_events",
            "send_hwm",
            "device_columns",
            "max_act_modules",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.on_rollback not in ("return", "exit"):
            raise ValueError(f"on_rollback must be 'return' or 'exit', got {self.on_rollback!r}")
        if self.command_endpoint is not None and (
            "://" not in self.command_endpoint or not self.command_key
        ):
            raise ValueError(
                "command_endpoint needs a ZeroMQ address and command_key the "
                f"collector's command key; got {self.command_endpoint!r}"
            )
        parts = split_endpoints(self.endpoint)
        if not parts or any("://" not in part for part in parts):
            raise ValueError(
                f"endpoint must be a ZeroMQ address like {DEFAULT_ENDPOINT!r}, or the "
                f"addresses of an HA pair of collectors separated by a comma; got "
                f"{self.endpoint!r}"
            )
        if len(set(parts)) != len(parts):
            raise ValueError(
                f"endpoint names a collector twice ({self.endpoint!r}); it would receive "
                "every message twice: list each collector of the pair once"
            )
        if len(parts) > MAX_ENDPOINTS:
            raise ValueError(
                f"endpoint names {len(parts)} collectors; at most {MAX_ENDPOINTS} (an HA "
                "pair is two): every message goes to each"
            )


def split_endpoints(endpoint: str) -> tuple[str, ...]:
    """The addresses of a comma-separated ``endpoint`` (agent/destinations.py), in order.

    >>> split_endpoints(" tcp://a:5555, tcp://b:5555 ")
    ('tcp://a:5555', 'tcp://b:5555')
    """
    return tuple(part.strip() for part in endpoint.split(",") if part.strip())


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """What a CURVE client socket needs (all Z85 bytes); see :func:`load_curve_keys`."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    def apply(self, sock: Any) -> None:
        """Make ``sock`` (a ``zmq.Socket``, before ``connect``) a CURVE client."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


class SetupError(ValueError):
    """The user's agent settings are unusable (say which and how to fix); not a bug."""


def load_curve_keys(config: AgentConfig, env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The CURVE keys of ``config``, else of the environment; None when neither names any.

    Reads the key files (the one place the agent does). Raises ``SetupError``
    saying which setting is wrong when only half is set or a file is unusable.
    """
    env = os.environ if env is None else env
    server = (
        config.curve_server_public_key_file
        or env.get(ENV_CURVE_SERVER_KEY)
        or env.get(ENV_CURVE_SERVER_KEY_FILE)
        or None
    )
    secret_file = config.curve_secret_key_file or env.get(ENV_CURVE_SECRET_KEY_FILE) or None
    if server is None and secret_file is None:
        return None
    if server is None or secret_file is None:
        raise SetupError(
            f"CurveZMQ needs both the collector's public key ({ENV_CURVE_SERVER_KEY} or "
            f"{ENV_CURVE_SERVER_KEY_FILE}) and this agent's key pair "
            f"({ENV_CURVE_SECRET_KEY_FILE}); only one is set"
        )
    if _Z85_KEY.match(server) and not os.path.exists(server):
        server_public = server.encode("ascii")
    else:
        server_public, _ = _read_certificate(server, "the collector's public key")
    public, secret = _read_certificate(secret_file, "this agent's secret key")
    if secret is None:
        raise SetupError(
            f"{secret_file} holds no secret key: point "
            f"{ENV_CURVE_SECRET_KEY_FILE} at NAME.key_secret, not NAME.key"
        )
    try:
        mode = os.stat(secret_file).st_mode
    except OSError as exc:
        raise SetupError(f"cannot read {secret_file!r}: {exc.strerror or exc}") from exc
    if mode & 0o077:
        raise SetupError(
            f"{secret_file} is readable by other users (mode {mode & 0o777:o}); "
            f"run `chmod 600 {secret_file}`"
        )
    return CurveKeys(server_public, public, secret)


def _read_certificate(path: str, what: str) -> tuple[bytes, bytes | None]:
    from zmq.auth import load_certificate

    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SetupError(
            f"cannot read {what} from {path!r}: {exc}; create key files with "
            "`gradwatch keys generate`"
        ) from exc
    if not _Z85_KEY.match(public.decode("ascii", "replace")):
        raise SetupError(f"{path!r}: {what} is not 40 Z85 characters")
    return public, secret


def resolve_rank_world(
    rank: int | None, world: int | None, env: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """Rank and world size: explicit, else torch.distributed, else env, else 0/1.

    ``torch.distributed`` is asked only when it is initialised, so a plain
    single-process run never touches it.
    """
    if rank is not None and world is not None:
        return rank, world
    env = os.environ if env is None else env
    d_rank, d_world = 0, 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        d_rank, d_world = dist.get_rank(), dist.get_world_size()
    else:
        d_rank = _env_int(env, "RANK", 0)
        d_world = _env_int(env, "WORLD_SIZE", 1)
    return (d_rank if rank is None else rank), (d_world if world is None else world)


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
