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
from collections.abc import Mapping
from dataclasses import dataclass, field

from gradwatch.wire.messages import MAX_JOB_CHARS, MAX_RANK, MAX_ROWS

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything ``watch()`` accepts that is not the model, optimizer or scaler.

    The last group are tuning knobs with safe defaults; they bound how much
    memory the agent can hold when the collector is slow or absent.
    """

    job: str
    rank: int
    world: int
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
    # On cadence steps, also send each layer's update ratio ||dw||/||w||: the
    # optimizer step pre-hook copies the parameters (one transient copy of the
    # model's trainable parameters, on cadence steps only). False saves it.
    update_ratios: bool = True
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

    def __post_init__(self) -> None:
        if not (0 < len(self.job) <= MAX_JOB_CHARS and self.job.isprintable()):
            raise ValueError(
                f"job must be 1 to {MAX_JOB_CHARS} printable characters, got {self.job!r}")
        if not 1 <= self.world <= MAX_RANK + 1 or not 0 <= self.rank < self.world:
            raise ValueError(
                f"rank {self.rank} / world {self.world} is not a valid pair: need "
                "0 <= rank < world; pass rank= and world= or set RANK and WORLD_SIZE")
        if not 1 <= self.flush_every <= MAX_ROWS:
            raise ValueError(f"flush_every must be in [1, {MAX_ROWS}], got {self.flush_every}")
        if self.stats_every < 0:
            raise ValueError(f"stats_every must be >= 0 (0: no cadence statistics), "
                             f"got {self.stats_every}")
        if not self.heartbeat_every > 0:
            raise ValueError(f"heartbeat_every must be > 0 seconds, got {self.heartbeat_every}")
        for name in ("pool_size", "max_pending_events", "send_hwm", "device_columns",
                     "max_act_modules"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.on_rollback not in ("return", "exit"):
            raise ValueError(f"on_rollback must be 'return' or 'exit', got {self.on_rollback!r}")
        if self.command_endpoint is not None and (
                "://" not in self.command_endpoint or not self.command_key):
            raise ValueError("command_endpoint needs a ZeroMQ address and command_key the "
                             f"collector's command key; got {self.command_endpoint!r}")
        if not self.endpoint or "://" not in self.endpoint:
            raise ValueError(
                f"endpoint must be a ZeroMQ address like {DEFAULT_ENDPOINT!r}, "
                f"got {self.endpoint!r}")


def resolve_rank_world(rank: int | None, world: int | None,
                       env: Mapping[str, str] | None = None) -> tuple[int, int]:
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
