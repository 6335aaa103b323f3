"""The model census and layer roles (contracts C1 and C2), read from Python attributes only.

:class:`ModelCensus` walks the model once at attach: which module owns each
parameter (so tied parameters, normalisation gains and embeddings are told
apart: :attr:`ModelCensus.roles`), the parameters' element counts, and the
modules whose train/eval mode changes what they compute. On a cadence step
:meth:`ModelCensus.take` re-reads only what can change (``requires_grad``
flags, the optimizer's param groups, module modes and dropout rates) and
rebuilds the :class:`~gradwatch.wire.census.Census` only when one of them did.
Nothing here touches a tensor's values, so nothing waits for the device.

A module's mode matters when it changes the output: BatchNorm (and
InstanceNorm) tracking running statistics, Dropout-family modules with
``p > 0``, ``nn.MultiheadAttention`` and multi-layer RNNs with ``dropout > 0``.
``Dropout(p=0.0)`` (nanoGPT's default) computes the same in both modes, so it
is never reported.

Example::

    >>> import torch
    >>> from gradwatch.agent.census import ModelCensus
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4),
    ...                             torch.nn.Dropout(0.1), torch.nn.Linear(4, 10))
    >>> model[3].weight = model[0].weight          # tie the output head to the embedding
    >>> _ = model[1].requires_grad_(False)
    >>> opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    >>> census = ModelCensus.attach(model, opt)
    >>> census.roles_of(["0.weight", "3.bias"])
    ('tied', 'bias')
    >>> c = census.take()
    >>> c.params_frozen, c.frozen_modules, c.tied
    (8, (('1', 8),), (('0.weight', '3.weight'),))
    >>> _ = model[2].eval()
    >>> census.take().eval_modules
    ('2',)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradwatch.agent.towers import towers_of
from gradwatch.wire.census import (
    MAX_CENSUS_NAMES,
    MAX_GROUP_RUNS,
    MAX_TIED_GROUPS,
    MAX_TIED_NAMES,
    MAX_TOWER_RUNS,
    ROLE_BIAS,
    ROLE_EMBEDDING,
    ROLE_NORM,
    ROLE_OTHER,
    ROLE_TIED,
    ROLE_WEIGHT,
    Census,
    capped_name,
    capped_names,
    tower_runs,
)

logger = logging.getLogger(__name__)

_COMPILED_PREFIX = "_orig_mod."
_NORM_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
# Custom normalisation modules (LlamaRMSNorm, T5LayerNorm, LayerNorm2d...): by class name.
_NORM_NAME = re.compile(r"norm(\d+d)?$", re.IGNORECASE)
_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
# Parameters of unknown modules named like these are embeddings (ViT's pos_embed, cls_token).
_EMBEDDING_NAME = re.compile(r"(emb|token)", re.IGNORECASE)
_MODE_TYPES = (
    nn.modules.batchnorm._NormBase,
    nn.modules.dropout._DropoutNd,
    nn.MultiheadAttention,
    nn.RNNBase,
)


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (by type, or a class name ending in Norm)."""
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def mode_matters(module: nn.Module) -> bool:
    """Whether ``module`` computes something different in training and in eval mode."""
    if isinstance(module, nn.modules.batchnorm._NormBase):
        # Without running statistics both modes normalise with the batch's own.
        return bool(module.track_running_stats)
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return float(module.p) > 0.0
    if isinstance(module, nn.MultiheadAttention):
        return float(module.dropout) > 0.0
    if isinstance(module, nn.RNNBase):
        return float(module.dropout) > 0.0 and module.num_layers > 1
    return False


def mode_modules(model: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    """The modules whose mode may matter (filter with :func:`mode_matters` when reading:
    a dropout rate may change during the run)."""
    return tuple(
        (_clean(name) or type(m).__name__, m)
        for name, m in model.named_modules()
        if isinstance(m, _MODE_TYPES)
    )


def _clean(name: str) -> str:
    return name.removeprefix(_COMPILED_PREFIX).replace("." + _COMPILED_PREFIX, ".")


@dataclass(slots=True)
class _Param:
    param: nn.Parameter
    name: str  # the name named_parameters() gives it (its first)
    names: list[str]  # every name it is reachable by
    owners: list[nn.Module]
    numel: int


class ModelCensus:
    """The census of one model and optimizer; see the module docstring.

    It never raises: a model it cannot walk (or a failure later) logs one
    warning and switches the census off (no roles, no census), leaving every
    other signal running.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, supervised_loss: bool = True
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._off = False
        self._supervised_loss = supervised_loss
        self._towers: tuple[int, ...] = ()
        # Until a logged loss with an autograd graph came (find_towers).
        self.towers_due = True
        self._params: tuple[_Param, ...] = ()
        self._by_id: dict[int, _Param] = {}
        self._modes: tuple[tuple[str, nn.Module], ...] = ()
        self._tied: tuple[tuple[str, ...], ...] = ()
        self._flags: list[bool] | None = None
        self._groups_key: tuple[int, ...] | None = None
        self._in_optimizer: set[int] = set()
        self._counts: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._frozen_modules: tuple[tuple[str, int], ...] = ()
        self._not_in_optimizer: tuple[str, ...] = ()
        # The watched layers' param groups (Census.groups), for the layers last asked about.
        self._layers: tuple[int, ...] = ()
        self._layers_from: Sequence[nn.Parameter] | None = None
        self._layer_groups: tuple[int, ...] = ()
        self._last: Census | None = None
        try:
            self._walk(model)
        except Exception as exc:
            self._switch_off("walking the model's modules at attach", exc)

    def _switch_off(self, what: str, exc: Exception) -> None:
        self._off = True
        logger.warning(
            "gradwatch: the model census failed while %s (%s: %s); layer roles and "
            "the census are off for this run, every other signal is unaffected",
            what,
            type(exc).__name__,
            exc,
        )

    def _walk(self, model: nn.Module) -> None:
        by_id: dict[int, _Param] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            for local, param in module.named_parameters(recurse=False):
                name = _clean(f"{prefix}.{local}" if prefix else local)
                entry = by_id.get(id(param))
                if entry is None:
                    by_id[id(param)] = _Param(param, name, [name], [module], param.numel())
                elif name not in entry.names:
                    entry.names.append(name)
                    entry.owners.append(module)
        self._params = tuple(by_id.values())
        self._by_id = by_id
        self._modes = mode_modules(model)
        self._tied = tuple(
            tuple(capped_names(p.names, MAX_TIED_NAMES)) for p in self._params if len(p.names) > 1
        )[:MAX_TIED_GROUPS]

    @classmethod
    def attach(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, supervised_loss: bool = True
    ) -> ModelCensus:
        return cls(model, optimizer, supervised_loss)

    def find_towers(self, loss: object, params: Sequence[nn.Parameter]) -> None:
        """The watched layers' towers, from the first logged loss with a graph (the loop's
        ``log(loss=...)``; agent/towers.py): once, at the cost of one walk of that graph."""
        if getattr(loss, "grad_fn", None) is None:
            return  # a float or a detached loss: the next one may carry its graph
        self.towers_due = False
        if self._off:
            return
        try:
            towers = towers_of(loss, params, self.roles(params))
        except Exception as exc:  # the census's other parts do not depend on it
            logger.warning(
                "gradwatch: reading the model's towers from the loss's graph failed (%s: %s); "
                "the layer-ratio rules take the first and last layers in parameter order",
                type(exc).__name__,
                exc,
            )
            return
        if towers and len(tower_runs(towers)) <= MAX_TOWER_RUNS:
            self._towers, self._last = towers, None

    # ------------------------------------------------------------ roles (C1)

    def role(self, param: nn.Parameter) -> str:
        """The role of one parameter of the model (``"other"`` for one it does not hold)."""
        entry = self._by_id.get(id(param))
        if entry is None:
            return ROLE_OTHER
        if len(entry.names) > 1:
            return ROLE_TIED
        owner = entry.owners[0]
        if is_norm(owner):
            return ROLE_NORM
        if isinstance(owner, _EMBEDDING_TYPES):
            return ROLE_EMBEDDING
        if param.dim() >= 2:
            known = isinstance(
                owner,
                (
                    nn.Linear,
                    nn.modules.conv._ConvNd,
                    nn.Bilinear,
                    nn.MultiheadAttention,
                    nn.RNNBase,
                ),
            )
            leaf = entry.name.rsplit(".", 1)[-1]
            return ROLE_EMBEDDING if not known and _EMBEDDING_NAME.search(leaf) else ROLE_WEIGHT
        return ROLE_BIAS if param.dim() == 1 else ROLE_OTHER

    def roles(self, params: Iterable[nn.Parameter]) -> tuple[str, ...]:
        """Roles of ``params`` (e.g. the watched layers), in their order; () when off."""
        return () if self._off else tuple(self.role(p) for p in params)

    def roles_of(self, names: Sequence[str]) -> tuple[str, ...]:
        """Roles of the parameters called ``names`` (for examples and tests)."""
        index = {name: p.param for p in self._params for name in p.names}
        return tuple(self.role(index[name]) if name in index else ROLE_OTHER for name in names)

    # ------------------------------------------------------------ census (C2)

    def take(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        layers: Sequence[nn.Parameter] = (),
    ) -> Census | None:
        """The census now (None when off); rebuilt only when flags, groups or modes changed.

        ``optimizer``: the one the loop steps now, when it re-created it; ``layers``: the
        watched parameters in the statistics' order, whose param groups it names.
        """
        if self._off:
            return None
        try:
            return self._take(optimizer, layers)
        except Exception as exc:
            self._switch_off("taking a census on a cadence step", exc)
            return None

    def _take(
        self, optimizer: torch.optim.Optimizer | None, layers: Sequence[nn.Parameter]
    ) -> Census:
        if optimizer is not None and optimizer is not self._optimizer:
            self._optimizer, self._groups_key = optimizer, None
        flags = [p.param.requires_grad for p in self._params]
        groups = self._optimizer.param_groups
        key = tuple(len(g["params"]) for g in groups)
        # The reader's params are one tuple for the run (a new one after a recovery): the
        # ids are taken again only then, not on every sample's training step.
        ids = self._layers if layers is self._layers_from else tuple(id(p) for p in layers)
        self._layers_from = layers
        changed = flags != self._flags or key != self._groups_key or ids != self._layers
        if key != self._groups_key or ids != self._layers:
            self._groups_key, self._layers = key, ids
            self._in_optimizer = {id(p) for g in groups for p in g["params"]}
            self._layer_groups = layer_groups(groups, ids)
        if changed:
            self._flags = flags
            self._recount(flags)
        evals = [(name, m) for name, m in self._modes if not m.training and mode_matters(m)]
        eval_modules = capped_names(name for name, _ in evals)
        # Normalisation layers alone in eval mode (running statistics kept frozen while
        # the rest trains, OpenMMLab's norm_eval), told from a model left in eval mode.
        norms_only = bool(evals) and all(is_norm(m) for _, m in evals)
        training = bool(self._model.training)
        last = self._last
        if (
            last is None
            or changed
            or last.eval_modules != eval_modules
            or last.eval_norms_only != norms_only
            or last.model_training != training
        ):
            total, trainable, frozen, orphan = self._counts
            last = self._last = Census(
                params_total=total,
                params_trainable=trainable,
                params_frozen=frozen,
                params_not_in_optimizer=orphan,
                frozen_modules=self._frozen_modules,
                not_in_optimizer=self._not_in_optimizer,
                tied=self._tied,
                eval_modules=eval_modules,
                model_training=training,
                towers=self._towers,
                supervised_loss=self._supervised_loss,
                groups=self._layer_groups,
                eval_norms_only=norms_only,
            )
        return last

    def _recount(self, flags: list[bool]) -> None:
        total = trainable = frozen = orphan = 0
        orphans: list[str] = []
        for entry, grad in zip(self._params, flags, strict=True):
            total += entry.numel
            if not grad:
                frozen += entry.numel
            elif id(entry.param) in self._in_optimizer:
                trainable += entry.numel
            else:
                orphan += entry.numel
                orphans.append(entry.name)
        self._counts = (total, trainable, frozen, orphan)
        self._not_in_optimizer = capped_names(orphans)
        found: list[tuple[str, int]] = []
        if frozen:
            frozen_ids = {
                id(e.param) for e, grad in zip(self._params, flags, strict=True) if not grad
            }
            found = _frozen_prefixes(self._model, "", frozen_ids)[2]
        found.sort(key=lambda item: -item[1])
        self._frozen_modules = tuple(
            (capped_name(name or type(self._model).__name__), n)
            for name, n in found[:MAX_CENSUS_NAMES]
        )


def _frozen_prefixes(
    module: nn.Module, prefix: str, frozen: set[int]
) -> tuple[bool, int, list[tuple[str, int]]]:
    """Whether ``module`` holds parameters that are all frozen, its frozen elements, and
    the largest wholly frozen prefixes (or frozen parameter names) below it; one pass."""
    has_params, whole, count = False, True, 0
    items: list[tuple[str, int]] = []
    for local, child in module.named_children():
        name = f"{prefix}.{local}" if prefix else local
        child_whole, child_count, child_items = _frozen_prefixes(child, name, frozen)
        if child_whole:
            has_params = True
            items.append((_clean(name), child_count))
        elif child_items or any(True for _ in child.parameters()):
            has_params, whole = True, False
            items += child_items
        count += child_count
    for local, param in module.named_parameters(recurse=False):
        has_params = True
        if id(param) in frozen:
            count += param.numel()
            items.append((_clean(f"{prefix}.{local}" if prefix else local), param.numel()))
        else:
            whole = False
    whole = whole and has_params
    return whole, count, [(prefix, count)] if whole else items


def layer_groups(groups: Sequence[dict[str, Any]], layers: Sequence[int]) -> tuple[int, ...]:
    """Each layer's (``id`` of its parameter) param group index, -1 in none: () for one
    group, or when the groups alternate in more runs than a census carries."""
    if len(groups) < 2 or not layers:
        return ()
    index = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    found = tuple(index.get(i, -1) for i in layers)
    return found if len(tower_runs(found)) <= MAX_GROUP_RUNS else ()
