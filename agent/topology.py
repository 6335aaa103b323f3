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

Under 3D parallelism a rank's place is a :class:`Layout`: the sizes of the
job's mesh dimensions, outermost first (``pp`` pipeline stages, ``dp`` /
``dp_replicate`` / ``cp`` replicas, ``dp_shard`` / ``fsdp`` / ``tp`` shards),
read from the DeviceMesh of the model's DTensor parameters, or declared as
``watch(layout=...)`` (a DeviceMesh, a mapping, a :class:`Layout`) or
``$GRADWATCH_LAYOUT`` (``"pp=4,dp=512,tp=8"``). Then ``shards`` is the product
of the shard dimensions (the collector tells stages apart by their layer names),
:func:`reports_layers` says whether this rank sends per-layer norms (one replica
per model shard does; every rank still sends its loss, flags and timing), and
:func:`share_scales` scales each parameter replicated across a shard group
(a LayerNorm under TP) by 1/sqrt(copies), so the collector's sum of squares
counts it once.

Example::

    >>> import torch
    >>> from gradwatch.agent.topology import resolve_shards
    >>> resolve_shards(torch.nn.Linear(2, 2), world=8, shards=None, env={})
    1
    >>> resolve_shards(torch.nn.Linear(2, 2), world=8, shards=None, env={"GRADWATCH_SHARDS": "8"})
    8
    >>> layout = parse_layout("pp=2,dp=2,tp=2")
    >>> layout.shards, [reports_layers(layout, r) for r in range(8)]
    (2, [True, True, False, False, True, True, False, False])
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

ENV_SHARDS = "GRADWATCH_SHARDS"
ENV_LAYOUT = "GRADWATCH_LAYOUT"
STAGE_DIMS = frozenset({"pp"})
# Gradients are all-reduced across these: every member holds the same values.
REPLICA_DIMS = frozenset({"dp", "dp_replicate", "cp", "dp_cp"})
# Gradients are split across these: the collector adds their sums of squares.
SHARD_DIMS = frozenset({"tp", "dp_shard", "fsdp", "dp_shard_cp"})


def resolve_shards(
    model: torch.nn.Module, world: int, shards: int | None, env: Mapping[str, str] | None = None
) -> int:
    """The number of ranks one replica's gradients are split across; see the module docstring.

    Raises ``ValueError`` for a ``$GRADWATCH_SHARDS`` that is not an integer.
    """
    env = os.environ if env is None else env
    if shards is None and env.get(ENV_SHARDS):
        raw = env[ENV_SHARDS]
        try:
            shards = int(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {ENV_SHARDS}={raw!r} is not an integer"
            ) from None
    # AgentConfig checks that the result divides the world size.
    return _detect(model, world) if shards is None else shards


def _detect(model: torch.nn.Module, world: int) -> int:
    if world == 1:
        return 1
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None:
        # The widest split: a replicated parameter (a LayerNorm under TP) must not decide it.
        found = [
            math.prod(
                param.device_mesh.size(dim)
                for dim, placement in enumerate(param.placements)
                if placement.is_shard()
            )
            for param in model.parameters()
            if isinstance(param, dtensor)
        ]
        if found:
            return max(found)
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp_class = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp_class is not None:
        for module in model.modules():
            if isinstance(module, fsdp_class):
                strategy = getattr(module, "sharding_strategy", None)
                return 1 if getattr(strategy, "name", "") == "NO_SHARD" else world
    return 1


@dataclass(frozen=True, slots=True)
class Layout:
    """A job's mesh: ``(name, size)`` per dimension, outermost first (row-major ranks).

    The shard dimensions must be the innermost ones (torchtitan's and
    Megatron-LM's default orders put ``tp`` innermost), so that rank ``r``
    holds shard ``r % shards`` within its stage, as the collector assumes.
    """

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        known = STAGE_DIMS | REPLICA_DIMS | SHARD_DIMS
        for name, size in self.dims:
            if name not in known:
                raise ValueError(
                    f"layout dimension {name!r} is not one of {sorted(known)}; "
                    "rename it, or declare the layout as pp=..,dp=..,tp=.."
                )
            if size < 1:
                raise ValueError(f"layout dimension {name!r} has size {size}; sizes are >= 1")
        kinds = [name in SHARD_DIMS for name, size in self.dims if size > 1]
        if True in kinds and False in kinds[kinds.index(True) :]:
            raise ValueError(
                f"layout {self}: shard dimensions ({sorted(SHARD_DIMS)}) must be "
                "the innermost ones, so rank r holds shard r % shards; put them last"
            )

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.dims)

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.dims)

    @property
    def shards(self) -> int:
        """Ranks one pipeline stage's gradients are split across (the wire's ``shards``)."""
        return math.prod(size for name, size in self.dims if name in SHARD_DIMS)

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension."""
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return out

    def replica(self, rank: int) -> int:
        """Which data-parallel replica ``rank`` belongs to (0 .. replicas - 1)."""
        coords, index = self.coords(rank), 0
        for name, size in self.dims:
            if name in REPLICA_DIMS:
                index = index * size + coords[name]
        return index

    def stage(self, rank: int) -> int:
        return self.coords(rank).get("pp", 0)


def parse_layout(text: str) -> Layout:
    """``"pp=4,dp=512,tp=8"`` (outermost first) as a :class:`Layout`; ValueError if malformed."""
    dims = []
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not size.strip().isdigit():
            raise ValueError(
                f"layout {text!r}: expected name=size pairs such as "
                "'pp=4,dp=512,tp=8' (outermost dimension first)"
            )
        dims.append((name.strip(), int(size)))
    return Layout(tuple(dims))


def resolve_layout(
    model: torch.nn.Module, world: int, layout: object = None, env: Mapping[str, str] | None = None
) -> Layout | None:
    """The job's :class:`Layout`: ``layout=`` (a Layout, a DeviceMesh, a ``{name: size}``
    mapping, a string), else ``$GRADWATCH_LAYOUT``, else the root DeviceMesh of the
    model's DTensor parameters when it names its dimensions, else None.

    Raises ``ValueError`` when the layout does not cover ``world`` ranks.
    """
    env = os.environ if env is None else env
    if layout is None and env.get(ENV_LAYOUT):
        layout = env[ENV_LAYOUT]
    found: Layout | None
    if layout is None:
        found = _mesh_layout(_model_mesh(model), strict=False)
    elif isinstance(layout, Layout):
        found = layout
    elif isinstance(layout, str):
        found = parse_layout(layout)
    elif isinstance(layout, Mapping):
        found = Layout(tuple((str(k), int(v)) for k, v in layout.items()))
    else:
        found = _mesh_layout(layout, strict=True)
    if found is not None and found.world != world:
        raise ValueError(
            f"layout {found} covers {found.world} ranks but the world has {world}; "
            "declare every mesh dimension (pp, dp, tp, ...)"
        )
    return found


def reports_layers(layout: Layout | None, rank: int, silent: frozenset[int] = frozenset()) -> bool:
    """Whether ``rank`` sends per-layer norms: its model shard's reporter.

    Replicas hold the same gradients after the reduce, so one report per model
    shard suffices: the lowest replica whose rank is not in ``silent`` (a rank
    told its reporter went quiet takes over). Without a layout every rank reports.
    """
    if layout is None:
        return True
    replicas = math.prod(size for name, size in layout.dims if name in REPLICA_DIMS)
    for index in range(replicas):
        peer = _with_replica(layout, rank, index)
        if peer not in silent:
            return peer == rank
    return True  # every peer silent: report rather than leave the shard out


def share_scales(model: torch.nn.Module, layout: Layout | None) -> list[float] | None:
    """Per parameter (``named_parameters()`` order), the factor its norm is sent with.

    A parameter held whole by every rank of a shard group (a LayerNorm or a
    row-parallel bias under TP) would be added once per shard by the collector;
    sent as norm/sqrt(copies), the sum of squares counts it once. DTensor
    parameters say so by a ``Replicate`` placement on a shard dimension;
    Megatron-style parameters by lacking ``tensor_model_parallel=True`` when
    some parameter has it; a plain tensor among DTensors is a whole copy on
    every shard rank. None: every factor is 1.
    """
    if layout is None or layout.shards == 1:
        return None
    sizes = dict(layout.dims)
    params = [p for _, p in model.named_parameters()]
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    is_dtensor = [dtensor is not None and isinstance(p, dtensor) for p in params]
    any_dtensor = any(is_dtensor)
    megatron = any(getattr(p, "tensor_model_parallel", False) for p in params)
    scales = []
    for p, dt in zip(params, is_dtensor, strict=True):
        copies = 1
        if dt:
            mesh, placements = getattr(p, "device_mesh"), getattr(p, "placements")  # noqa: B009 -- DTensor attributes a Parameter's type lacks
            names = mesh.mesh_dim_names or ()
            for name, placement in zip(names, placements, strict=False):
                if name in SHARD_DIMS and placement.is_replicate():
                    copies *= mesh.size(names.index(name))
        elif any_dtensor or (megatron and not getattr(p, "tensor_model_parallel", False)):
            # A plain tensor in a sharded model is a whole copy on every shard rank.
            copies = layout.shards if any_dtensor else sizes.get("tp", 1)
        scales.append(1.0 / math.sqrt(copies))
    return None if all(s == 1.0 for s in scales) else scales


def _with_replica(layout: Layout, rank: int, index: int) -> int:
    """The rank at ``rank``'s stage and shard in replica ``index``."""
    coords = layout.coords(rank)
    for name, size in reversed([d for d in layout.dims if d[0] in REPLICA_DIMS]):
        index, coords[name] = divmod(index, size)
    out = 0
    for name, size in layout.dims:
        out = out * size + coords[name]
    return out


def _model_mesh(model: torch.nn.Module) -> object | None:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return None
    for param in model.parameters():
        if isinstance(param, dtensor):
            mesh = param.device_mesh
            root = getattr(mesh, "_get_root_mesh", None)  # private: a sub-mesh's whole mesh
            return root() if callable(root) else mesh
    return None


def _mesh_layout(mesh: object, strict: bool) -> Layout | None:
    names = getattr(mesh, "mesh_dim_names", None)
    shape = getattr(mesh, "shape", None)
    if not names or shape is None:
        if strict:
            raise ValueError(
                "layout=: expected a Layout, a DeviceMesh with mesh_dim_names, a "
                "{name: size} mapping or 'pp=..,dp=..,tp=..'"
            )
        return None
    try:
        return Layout(tuple(zip(names, (int(s) for s in shape), strict=True)))
    except ValueError:
        if strict:
            raise
        return None  # an unnamed or unusual mesh: fall back to shards detection
