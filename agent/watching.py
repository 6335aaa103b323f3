"""``watch()``: from the user's arguments to a running :class:`~gradwatch.agent.Monitor`.

Everything here happens once, before training: the arguments are checked
(agent/steps.py), rank and world resolved (torch.distributed, the environment,
or 0/1), the job's parallel layout and shard count worked out
(agent/topology.py), the rollback command settings read, and an
:class:`~gradwatch.agent.config.AgentConfig` built; the Monitor does the rest
(agent/monitor.py).

Example::

    >>> import torch
    >>> from gradwatch.agent.watching import watch
    >>> model = torch.nn.Linear(2, 1)
    >>> mon = watch(model, torch.optim.SGD(model.parameters(), lr=0.1), job="doc",
    ...             endpoint="tcp://127.0.0.1:1")
    >>> mon.config.heartbeat_every, mon.config.shards
    (2.0, 1)
    >>> mon.close()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from gradwatch.agent.acttargets import check_activation_modules
from gradwatch.agent.commands import command_settings
from gradwatch.agent.config import DEFAULT_ENDPOINT, AgentConfig, resolve_rank_world
from gradwatch.agent.monitor import Monitor
from gradwatch.agent.steps import check_watch_args
from gradwatch.agent.topology import reports_layers, resolve_layout, resolve_shards

logger = logging.getLogger(__name__)

# The default heartbeat period keeps a job's heartbeats at about this many a second.
HEARTBEAT_RANKS_PER_S = 2048


def watch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    job: str | None = None,
    endpoint: str = DEFAULT_ENDPOINT,
    *,
    rank: int | None = None,
    world: int | None = None,
    flush_every: int = 10,
    scaler: Any = None,
    heartbeat_every: float | None = None,
    stats_every: int = 50,
    enabled: bool = True,
    activation_stats: bool = True,
    update_ratios: bool = True,
    activation_modules: Mapping[str, str] | None = None,
    command_endpoint: str | None = None,
    command_key: str | bytes | None = None,
    on_rollback: str = "return",
    resume_file: str | None = None,
    curve_server_public_key_file: str | None = None,
    curve_secret_key_file: str | None = None,
    shards: int | None = None,
    start_step: int = 1,
    early_stats: bool = True,
    layout: object = None,
    supervised_loss: bool = True,
    phase_clock: bool | None = None,
) -> Monitor:
    """Attach a :class:`Monitor` to ``model`` and ``optimizer``; see the module example.

    ``job`` (required) names the run. ``optimizer`` None: the loop updates the
    parameters by hand, and the gradients are read at each ``log()``
    (agent/manual.py). ``start_step``: the number of the first logged step (a
    resumed run: the step it continues at); ``log(step=...)`` also takes the
    loop's own numbers (agent/steps.py). ``endpoint``: the collector's ZeroMQ
    address, or both addresses of an HA pair of collectors separated by a comma
    (every message goes to each: agent/destinations.py).

    ``rank``/``world`` default to torch.distributed's when it is initialised,
    else to the ``RANK``/``WORLD_SIZE`` environment variables, else 0/1.
    ``heartbeat_every`` (seconds) defaults to 2, or ``world / 2048`` for a
    world over 4,096 ranks (8 s at 16,384), so a large job's heartbeats stay
    near 2,048 a second at the collector. Pass
    the ``torch.amp.GradScaler`` as ``scaler`` to report the loss scale.
    Every ``stats_every`` steps (0: never; ``early_stats``: densely at the
    start and after ``data_changed``, backing off to that, agent/cadence.py)
    the parameters' own L2 norms are also shipped, as a separate
    cadence-statistics batch, with activation statistics of that step's
    forward pass (``activation_stats``; forward hooks armed for that forward
    only; ReLU/Tanh/Sigmoid/GELU/SiLU/Softmax-family modules, and with
    ``activation_modules`` (e.g. ``{"*.mlp.c_proj": "gelu"}``) the inputs of
    named modules, for activations called functionally: agent/activations.py;
    off for ``torch.compile``d models, with one warning) and each
    layer's update ratio ||dw||/||w|| (``update_ratios``; estimated on a fixed
    sample of at most 4,096 elements per tensor, agent/weightstats.py).
    Rollback commands (off by default; docs/rollback.md): ``command_endpoint``
    (else ``$GRADWATCH_COMMAND_ENDPOINT``) is the collector's command socket
    and ``command_key`` (else ``$GRADWATCH_COMMAND_KEY`` or the file named by
    ``$GRADWATCH_COMMAND_KEY_FILE``) its HMAC key. ``on_rollback="return"``
    hands commands to :meth:`Monitor.pending_rollback`; ``"exit"`` writes
    ``resume_file`` (default ``$GRADWATCH_RESUME_FILE`` or
    ``./.gradwatch-resume.json``) and raises ``SystemExit(ROLLBACK_EXIT_CODE)``
    from the next ``log()``.
    ``shards``: how many ranks one replica's gradients are split across, so
    the collector can assemble exact global norms (1 for DDP, the world size for
    FSDP/ZeRO); detected from DTensor/FSDP parameters when not given
    (agent/topology.py; ``$GRADWATCH_SHARDS`` overrides the detection).
    ``layout``: the job's parallel layout (a ``gradwatch.agent.topology.Layout``,
    a DeviceMesh with ``mesh_dim_names``, ``{"pp": 4, "dp": 512, "tp": 8}``
    outermost first, or ``"pp=4,dp=512,tp=8"``; else ``$GRADWATCH_LAYOUT``):
    it sets ``shards``, and only one replica per model shard sends per-layer
    norms; the others send the loss, a ``grad_nonfinite`` flag, phases and
    heartbeats, and no cadence statistics (docs/distributed.md). With the
    command endpoint and key set, a replica takes over when the collector
    reports its shard's reporter silent (a signed ``takeover`` command).
    ``supervised_loss=False``: the loss logged is no supervised loss, so its rising
    says nothing wrong: reinforcement learning (PPO's value loss grows with the
    returns), a GAN's generator. The rules that read the loss's shape (spikes,
    rises, divergence, a loss above its start) then leave it alone, as they do
    from the first loss below zero; the gradient, weight and non-finite rules go on.
    ``phase_clock``: time each step's wait for data and its forward pass with two hooks
    on the model (the ``data_seconds``/``forward_seconds`` signals the straggler and
    hung-rank rules compare across ranks). None (default): on in a job of several
    ranks, or without an optimizer; off in a single process, where nothing reads them
    and the hooks cost ~20 us a step on a small model (docs/agent-cost.md).
    CurveZMQ (SECURITY.md): ``curve_server_public_key_file`` (the collector's
    ``NAME.key``) and ``curve_secret_key_file`` (this agent's ``NAME.key_secret``),
    else the ``GRADWATCH_CURVE_*`` environment variables.
    Raises ``TypeError`` (an argument of the wrong type, named) or ``ValueError``
    (a bad value) before training starts; after that, nothing the monitor does
    raises into the loop, except that deliberate ``SystemExit``.
    """
    check_watch_args(
        model,
        optimizer,
        job=job,
        endpoint=endpoint,
        rank=rank,
        world=world,
        flush_every=flush_every,
        heartbeat_every=heartbeat_every,
        stats_every=stats_every,
        enabled=enabled,
        activation_stats=activation_stats,
        update_ratios=update_ratios,
        command_endpoint=command_endpoint,
        command_key=command_key,
        on_rollback=on_rollback,
        resume_file=resume_file,
        curve_server_public_key_file=curve_server_public_key_file,
        curve_secret_key_file=curve_secret_key_file,
        shards=shards,
        start_step=start_step,
        supervised_loss=supervised_loss,
        phase_clock=phase_clock,
    )
    assert job is not None  # checked above
    rank, world = resolve_rank_world(rank, world)
    if heartbeat_every is None:
        # Every rank beats: at 16,384 ranks, 2 s would be half the collector's messages.
        heartbeat_every = max(2.0, world / HEARTBEAT_RANKS_PER_S)
    topo = resolve_layout(model, world, layout)
    shards = (
        topo.shards if topo is not None and shards is None else resolve_shards(model, world, shards)
    )
    try:
        cmd_endpoint, cmd_key = command_settings(command_endpoint, command_key)
    except ValueError as exc:
        if command_endpoint is not None or command_key is not None:
            raise
        # Set up by the environment: a broken rollback setup must not stop training.
        logger.error("gradwatch: %s; rollback commands are off for this run", exc)
        cmd_endpoint, cmd_key = None, None
    config = AgentConfig(
        job=job,
        rank=rank,
        world=world,
        shards=shards,
        endpoint=endpoint,
        layout=topo,
        reports_layers=reports_layers(topo, rank),
        flush_every=flush_every,
        heartbeat_every=heartbeat_every,
        stats_every=stats_every,
        activation_stats=activation_stats,
        activation_modules=check_activation_modules(activation_modules),
        update_ratios=update_ratios,
        command_endpoint=cmd_endpoint,
        command_key=cmd_key,
        on_rollback=on_rollback,
        resume_file=resume_file,
        curve_server_public_key_file=curve_server_public_key_file,
        curve_secret_key_file=curve_secret_key_file,
        start_step=start_step,
        early_stats=early_stats,
        supervised_loss=supervised_loss,
        phase_clock=(world > 1 or optimizer is None) if phase_clock is None else phase_clock,
    )
    return Monitor(model, optimizer, config, scaler=scaler, enabled=enabled)
