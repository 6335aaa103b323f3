"""What a model is made of: per-layer roles (contract C1) and the census (contract C2).

Both are computed by the agent (``gradwatch.agent.census``), travel on the
wire (roles in the schema frame, the census in a cadence-statistics batch's
header) and in traces (roles in the header, the census on stats lines), and
are read by the rules. This module holds the one JSON form all of those use,
with its checks. Stdlib only.

Example::

    >>> c = Census(params_total=10, params_trainable=6, params_frozen=4,
    ...            params_not_in_optimizer=0, frozen_modules=(("backbone", 4),))
    >>> census_of(census_body(c)) == c
    True
    >>> round(c.frozen_share, 2)
    0.4
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# Layer roles (C1), aligned with a schema's ``layers``:
#   weight     >= 2-D weight of a linear / conv / attention projection
#   embedding  an nn.Embedding(Bag) weight that no other module uses
#   tied       a parameter reached from more than one module (embedding tied to the LM head)
#   norm       gain or bias of a normalisation layer (LayerNorm, RMSNorm, BatchNorm, *Norm)
#   bias       any other 1-D parameter
#   other      anything else (0-D scalars, >= 2-D parameters of modules of unknown kind)
ROLE_WEIGHT: Final = "weight"
ROLE_EMBEDDING: Final = "embedding"
ROLE_TIED: Final = "tied"
ROLE_NORM: Final = "norm"
ROLE_BIAS: Final = "bias"
ROLE_OTHER: Final = "other"
ROLES: Final = frozenset({ROLE_WEIGHT, ROLE_EMBEDDING, ROLE_TIED, ROLE_NORM, ROLE_BIAS, ROLE_OTHER})
MAX_ROLE_CHARS: Final = 32

# Census caps, so a census always fits a 64 KiB wire header: names are cut to
# MAX_CENSUS_NAME_CHARS, lists to MAX_CENSUS_NAMES, tied groups to
# MAX_TIED_GROUPS of at most MAX_TIED_NAMES names. The counts stay exact.
MAX_CENSUS_NAMES: Final = 32
MAX_CENSUS_NAME_CHARS: Final = 256
MAX_TIED_GROUPS: Final = 16
MAX_TIED_NAMES: Final = 4
# Towers travel as runs of [tower, layers] (a two-tower model: two runs); a model whose
# towers interleave in more runs than this sends none (the rules take parameter order).
MAX_TOWER_RUNS: Final = 256
# Param groups travel the same way; a weight-decay split alternates groups layer by layer,
# so a model of up to this many tensors still sends them (~8 bytes a run).
MAX_GROUP_RUNS: Final = 2048
MAX_TOWER_LAYERS: Final = 1 << 16
_MAX_COUNT: Final = 1 << 62


class CensusError(ValueError):
    """A census or role list that does not follow this module's JSON form."""


@dataclass(frozen=True, slots=True)
class Census:
    """The model's parameters and modes on one cadence step (contract C2).

    Counts are parameter *elements*, a tied tensor counted once.
    ``params_trainable`` requires grad and is held by the optimizer;
    ``params_frozen`` does not require grad; ``params_not_in_optimizer``
    requires grad but is in no param group (it never changes).
    ``frozen_modules`` are the largest wholly frozen module prefixes (or
    parameter names) with their frozen elements, largest first;
    ``not_in_optimizer`` names such parameters; ``tied`` groups the names
    sharing one tensor; ``eval_modules`` names the modules in eval mode on a
    training step among those whose mode changes the output (BatchNorm
    tracking running stats, Dropout with p > 0, MultiheadAttention/RNN with
    dropout > 0); ``model_training`` is the watched root module's
    ``.training`` on that step. Lists are capped (see the module's limits).
    ``towers``: each watched layer's tower, the part of the model on one path
    through it (agent/towers.py; -1: in none), aligned with the statistics'
    ``layers``; () when unknown or one tower. ``supervised_loss``: False when
    the job declared its loss no supervised loss (``watch(supervised_loss=False)``:
    RL, a GAN's generator), so the rules that read its shape do not judge it.
    ``eval_norms_only``: every module in ``eval_modules`` (not only the names
    sent) is a normalisation layer with running statistics: their statistics
    frozen while the rest trains (OpenMMLab's ``norm_eval``), not a model left
    in eval mode.
    ``groups``: each watched layer's optimizer param group (its index in
    ``optimizer.param_groups``, whose learning rates the steps carry in that
    order; -1: in none), aligned with ``layers``; () when unknown or one group.
    """

    params_total: int
    params_trainable: int
    params_frozen: int
    params_not_in_optimizer: int
    frozen_modules: tuple[tuple[str, int], ...] = ()
    not_in_optimizer: tuple[str, ...] = ()
    tied: tuple[tuple[str, ...], ...] = ()
    eval_modules: tuple[str, ...] = ()
    model_training: bool = True
    towers: tuple[int, ...] = ()
    supervised_loss: bool = True
    groups: tuple[int, ...] = ()
    eval_norms_only: bool = False

    @property
    def frozen_share(self) -> float:
        """Share of the model's elements that are frozen (0.0 for an empty model)."""
        return self.params_frozen / self.params_total if self.params_total else 0.0


def capped_name(name: str) -> str:
    """``name`` cut to the census's name limit (the agent applies it before sending)."""
    return name if len(name) <= MAX_CENSUS_NAME_CHARS else name[: MAX_CENSUS_NAME_CHARS - 1] + "…"


def census_body(c: Census) -> dict[str, Any]:
    """The JSON object of ``c`` (wire batch header ``census``, trace stats line ``census``)."""
    body: dict[str, Any] = {
        "total": c.params_total,
        "trainable": c.params_trainable,
        "frozen": c.params_frozen,
        "not_in_optimizer": c.params_not_in_optimizer,
        "frozen_modules": [[name, n] for name, n in c.frozen_modules],
        "not_in_optimizer_names": list(c.not_in_optimizer),
        "tied": [list(group) for group in c.tied],
        "eval_modules": list(c.eval_modules),
        "model_training": c.model_training,
    }
    # Only when they say something: the common census stays as it was.
    if c.towers:
        body["towers"] = tower_runs(c.towers)
    if not c.supervised_loss:
        body["supervised_loss"] = False
    if c.groups:
        body["groups"] = tower_runs(c.groups)
    if c.eval_norms_only:
        body["eval_norms_only"] = True
    return body


def census_of(body: Any) -> Census:
    """The :class:`Census` a JSON object describes; raises :class:`CensusError` if malformed.

    Counts must be whole numbers >= 0 and lists within the caps; anything
    else in the object is ignored (later fields stay readable by this build).
    """
    if not isinstance(body, Mapping):
        raise CensusError("census: expected a JSON object")
    frozen_modules = []
    for item in _list(body, "frozen_modules", MAX_CENSUS_NAMES):
        if not (isinstance(item, list) and len(item) == 2):
            raise CensusError("census.frozen_modules: expected [name, elements] pairs")
        frozen_modules.append((_name(item[0], "frozen_modules"), _count(item[1], "frozen_modules")))
    tied = tuple(
        _names(group, "tied", MAX_TIED_NAMES) for group in _list(body, "tied", MAX_TIED_GROUPS)
    )
    training = body.get("model_training", True)
    if not isinstance(training, bool):
        raise CensusError("census.model_training: expected true or false")
    supervised = body.get("supervised_loss", True)
    if not isinstance(supervised, bool):
        raise CensusError("census.supervised_loss: expected true or false")
    norms_only = body.get("eval_norms_only", False)
    if not isinstance(norms_only, bool):
        raise CensusError("census.eval_norms_only: expected true or false")
    return Census(
        params_total=_count(body.get("total"), "total"),
        params_trainable=_count(body.get("trainable"), "trainable"),
        params_frozen=_count(body.get("frozen"), "frozen"),
        params_not_in_optimizer=_count(body.get("not_in_optimizer"), "not_in_optimizer"),
        frozen_modules=tuple(frozen_modules),
        not_in_optimizer=_names(
            body.get("not_in_optimizer_names", []), "not_in_optimizer_names", MAX_CENSUS_NAMES
        ),
        tied=tied,
        eval_modules=_names(body.get("eval_modules", []), "eval_modules", MAX_CENSUS_NAMES),
        model_training=training,
        towers=_towers(_list(body, "towers", MAX_TOWER_RUNS)),
        supervised_loss=supervised,
        groups=_towers(_list(body, "groups", MAX_GROUP_RUNS), "groups"),
        eval_norms_only=norms_only,
    )


def tower_runs(towers: Sequence[int]) -> list[list[int]]:
    """``towers`` as runs of [tower, layers]: ``(0, 0, 1)`` is ``[[0, 2], [1, 1]]``."""
    runs: list[list[int]] = []
    for tower in towers:
        if runs and runs[-1][0] == tower:
            runs[-1][1] += 1
        else:
            runs.append([tower, 1])
    return runs


def _towers(runs: list[Any], what: str = "towers") -> tuple[int, ...]:
    """Runs of [index, layers] (``towers`` or ``groups``), expanded; raises CensusError."""
    towers: list[int] = []
    for run in runs:
        if not (
            isinstance(run, list)
            and len(run) == 2
            and all(type(v) is int for v in run)
            and -1 <= run[0] < MAX_TOWER_LAYERS
            and 0 < run[1] <= MAX_TOWER_LAYERS - len(towers)
        ):
            raise CensusError(
                f"census.{what}: expected [index, layers] runs (index >= -1, layers >= 1), "
                f"{MAX_TOWER_LAYERS} layers in all at most"
            )
        towers += [run[0]] * run[1]
    return tuple(towers)


def roles_of(value: Any, layers: int) -> tuple[str, ...]:
    """Layer roles from a JSON list aligned with ``layers`` names; raises :class:`CensusError`.

    A role this build does not know (a later agent's) reads as ``"other"``.
    """
    if not isinstance(value, list) or len(value) != layers:
        raise CensusError(f"layer_roles: expected a list of {layers} role names, one per layer")
    if any(not isinstance(v, str) or not 0 < len(v) <= MAX_ROLE_CHARS for v in value):
        raise CensusError(
            f"layer_roles: every role must be a string of 1 to {MAX_ROLE_CHARS} chars"
        )
    return tuple(v if v in ROLES else ROLE_OTHER for v in value)


def roles_for(
    names: Sequence[str], all_names: Sequence[str], all_roles: Sequence[str]
) -> tuple[str, ...]:
    """The roles of ``names`` (a subset of ``all_names``), or ``()`` when unknown.

    For records that keep only some layers (unmeasured ones left out): their
    roles stay aligned with their own layers.
    """
    if not all_roles or len(all_roles) != len(all_names):
        return ()
    if len(names) == len(all_names) and tuple(names) == tuple(all_names):
        return tuple(all_roles)
    role = dict(zip(all_names, all_roles, strict=True))
    found: list[str] = []
    for name in names:
        known = role.get(name)
        if known is None:  # a layer the census does not name: roles unknown
            return ()
        found.append(known)
    return tuple(found)


def _count(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_COUNT:
        raise CensusError(f"census.{what}: expected a whole number >= 0, got {value!r:.40}")
    return value


def _list(body: Mapping[str, Any], key: str, cap: int) -> list[Any]:
    value = body.get(key, [])
    if not isinstance(value, list) or len(value) > cap:
        raise CensusError(f"census.{key}: expected a list of at most {cap} entries")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CENSUS_NAME_CHARS:
        raise CensusError(f"census.{what}: names are strings of 1 to {MAX_CENSUS_NAME_CHARS} chars")
    return value


def _names(value: Any, what: str, cap: int) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > cap:
        raise CensusError(f"census.{what}: expected a list of at most {cap} names")
    return tuple(_name(v, what) for v in value)


def capped_names(names: Iterable[str], cap: int = MAX_CENSUS_NAMES) -> tuple[str, ...]:
    """The first ``cap`` of ``names``, each cut to the name limit."""
    out: list[str] = []
    for name in names:
        if len(out) >= cap:
            break
        out.append(capped_name(name))
    return tuple(out)
