"""How a job's gradients are split across its ranks, so the collector can add them up.

The collector assembles one step from every rank's report (docs/wire.md,
``shards``): per layer it adds the ranks' sums of squares across the shards of
one replica, and needs only one report per shard. This module works out the
shard count once, at ``watch()``:

* an explicit ``shards=`` (or ``$GRADWATCH_SHARDS``) wins;
* DTensor parameters (FSDP2 ``fully_shard``, HSDP, tensor parallel): the
  product of the sizes of the mesh dimensions the parameter is sharded over;
* an FSDP1 ``FullyShardedDataParallel`` module anywhere in the model: the
  whole world (``FULL_SHARD``/``SHARD_GRAD_OP``), 1 for ``NO_SHARD``; hybrid
  strategies need an explicit ``shards=``;
* anything else is replicated (DDP, or one process): 1.

Example::

    >>> import torch
    >>> from gradwatch.agent.topology import resolve_shards
    >>> resolve_shards(torch.nn.Linear(2, 2), world=8, shards=None, env={})
    1
    >>> resolve_shards(torch.nn.Linear(2, 2), world=8, shards=None, env={"GRADWATCH_SHARDS": "8"})
    8
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping

import torch

ENV_SHARDS = "GRADWATCH_SHARDS"


def resolve_shards(model: torch.nn.Module, world: int, shards: int | None,
                   env: Mapping[str, str] | None = None) -> int:
    """The number of ranks one replica's gradients are split across; see the module docstring.

    Raises ``ValueError`` for a ``$GRADWATCH_SHARDS`` that is not an integer.
    """
    env = os.environ if env is None else env
    if shards is None and env.get(ENV_SHARDS):
        raw = env[ENV_SHARDS]
        try:
            shards = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {ENV_SHARDS}={raw!r} is not an integer") from None
    # AgentConfig checks that the result divides the world size.
    return _detect(model, world) if shards is None else shards


def _detect(model: torch.nn.Module, world: int) -> int:
    if world == 1:
        return 1
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None:
        for param in model.parameters():
            if isinstance(param, dtensor):
                mesh = param.device_mesh
                return math.prod(mesh.size(dim) for dim, placement in enumerate(param.placements)
                                 if placement.is_shard())
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp_class = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp_class is not None:
        for module in model.modules():
            if isinstance(module, fsdp_class):
                strategy = getattr(module, "sharding_strategy", None)
                return 1 if getattr(strategy, "name", "") == "NO_SHARD" else world
    return 1
