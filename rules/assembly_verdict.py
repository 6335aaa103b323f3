"""What :mod:`gradwatch.rules.assembly` decides about a pending step, and the values it adds.

:func:`_complete` says whether anyone is left to wait for; :func:`_blame`
names, per non-finite layer (and "loss"), the rank where it went non-finite
first; :func:`_ratios` turns the summed ||dw||^2 back into update ratios; and
:func:`_nonfinite_only` keeps a late report's non-finite values as a step of
their own. They read the state of :mod:`gradwatch.rules.assembly_state` and
never change a pending step's sums.

Internals of :class:`gradwatch.rules.assembly.Assembler`, which re-exports the
public ``MAX_BLAMED``. Pure: no I/O, no clock.

Example::

    if _complete(stream, pending):
        blame = _blame(stream, pending, layers, norms, loss, grad_norm)
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from gradwatch.rules.assembly_state import Record, _loss_bad, _Pending, _Stream
from gradwatch.rules.step import Step, nonfinite_layers
from gradwatch.wire.census import roles_for

MAX_BLAMED = 64  # layers named in one step's blame


def _complete(stream: _Stream, pending: _Pending) -> bool:
    """Whether nobody is left to wait for.

    The job's first step waits for the whole world (agents may connect after
    another rank's first batch). After it: every rank heard from and not absent
    has reported. A shard still missing then is held only by absent ranks or
    ranks never heard from, which are not waited for (and the check stays
    O(1) until every rank not absent reported, then O(absent ranks), never
    O(world): a hostile header may claim a huge world).
    """
    if not stream.counts.steps:  # nothing emitted yet: this is the job's first step
        return len(pending.ranks) >= stream.world
    # Reporting ranks are all known; absent ones are not waited for. At most
    # len(absent) are gone: below that bound the step cannot be complete, so the
    # exact count (O(absent), thousands of ranks after an outage) runs only near the end.
    if len(pending.ranks) + len(stream.absent) < len(stream.known):
        return False
    gone = sum(1 for r in stream.absent if r in stream.known and r not in pending.ranks)
    return len(pending.ranks) >= len(stream.known) - gone


def _nonfinite_only(record: Record) -> Step | None:
    """A late report's non-finite values, as a step of their own: a NaN is never dropped.

    Only those layers (and the loss) travel: the step was already judged
    without this rank, and re-judging its finite values would count them twice.
    """
    if not isinstance(record, Step):
        return None
    if not (nonfinite_layers(record) or _loss_bad(record)):
        return None
    bad = ~np.isfinite(record.layer_norms)
    layers = tuple(name for name, b in zip(record.layers, bad.tolist(), strict=True) if b)
    loss_bad = _loss_bad(record)
    norms = record.layer_norms[bad]
    norms.flags.writeable = False
    blame = dict.fromkeys(layers[:MAX_BLAMED], record.rank)
    if loss_bad:
        blame["loss"] = record.rank
    return replace(
        record,
        layers=layers,
        layer_norms=norms,
        layer_roles=roles_for(layers, record.layers, record.layer_roles),
        loss=record.loss if loss_bad else None,
        grad_norm=None,
        grad_norm_logged=False,
        assembled=1,
        blame=blame,
    )


def _ratios(
    pending: _Pending, rows: np.ndarray, keep: np.ndarray, norms: np.ndarray, shards: int
) -> np.ndarray | None:
    if pending.updates is None or pending.updates_seen is None or not pending.updates_seen.any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios: np.ndarray = np.where(
            pending.updates_seen[rows] >= shards,
            np.sqrt(pending.updates[rows]) / np.maximum(norms, 1e-30),
            np.nan,
        )
    out: np.ndarray = ratios[keep]
    out.flags.writeable = False
    return out


def _blame(
    stream: _Stream,
    pending: _Pending,
    layers: tuple[str, ...],
    norms: np.ndarray,
    loss: float | None,
    grad_norm: float | None,
) -> dict[str, int]:
    """Per non-finite layer (and "loss"), the rank where it first went non-finite."""
    bad_layers = [
        name for name, ok in zip(layers, np.isfinite(norms).tolist(), strict=True) if not ok
    ]
    if (
        pending.flagged
        and not bad_layers
        and grad_norm is not None
        and not math.isfinite(grad_norm)
    ):
        bad_layers = ["grad_norm"]  # only a flag: no layer to name
    loss_bad = loss is not None and not math.isfinite(loss)  # the mean over ranks
    if not bad_layers and not loss_bad:
        stream.first_bad.clear()  # a clean step ends the incident
        return {}
    # Data-parallel jobs combine gradients before the optimizer sees them, so a NaN
    # born on one rank shows on every rank's gradients at the same step; only that
    # rank's own loss went non-finite. Those reports come first, then by time, rank.
    reports = sorted(pending.bad, key=lambda bad: (not bad[3], bad[0], bad[1]))
    for name in bad_layers[:MAX_BLAMED]:
        if name not in stream.first_bad:
            culprit = next((rank for _, rank, names, _ in reports if name in names), None)
            if culprit is not None:
                stream.first_bad[name] = culprit
    if loss_bad and "loss" not in stream.first_bad:
        culprit = next((rank for _, rank, _, lb in reports if lb), None)
        if culprit is not None:
            stream.first_bad["loss"] = culprit
    wanted = set(bad_layers[:MAX_BLAMED]) | ({"loss"} if loss_bad else set())
    return {name: rank for name, rank in stream.first_bad.items() if name in wanted}
