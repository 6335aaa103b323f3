"""What the agent does when the model changes under it, instead of switching itself off.

Users change a watched model mid-run in ordinary ways: ``model.double()`` or
``.half()`` (the parameters keep their identity, but not their dtype),
``nn.Embedding(sparse=True)`` (sparse gradients, which ``torch._foreach_norm``
does not take), ``model.to(other_device)``. A gradient read that fails after
such a change comes here: :func:`recover` returns a reader that works with the
parameters as they are now, and a :class:`Notice` saying what is no longer
measured, which the monitor sends to the collector as a ``degraded`` event
(the collector raises ``AgentDegraded``, or the info ``AgentStatisticOff`` for what
the model has by design). Monitoring of everything else goes on.

* dtype changed: a fresh :class:`GradReader` over the same parameters; nothing is off.
* sparse gradients: the dense layers are read as before, the sparse ones are
  sent as MISSING ("not measured"); a log line names them, and the notice is
  optional (info) while dense layers remain.
* device changed: the step buffer lives on the old device and a cross-device
  read would have to wait for it, so gradient and weight norms go MISSING;
  the loss, learning rates and everything else still flow.

Example::

    >>> import torch
    >>> from gradwatch.agent.gradients import GradReader
    >>> from gradwatch.agent.recovery import recover
    >>> model = torch.nn.Linear(2, 2)
    >>> reader = GradReader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> _ = model.double(); model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    >>> fixed, notice = recover(reader)
    >>> row = torch.empty(2); fixed.read_into(row); notice is None
    True
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from gradwatch.agent.gradients import GradReader
from gradwatch.agent.layout import fill_missing

# Parameters normed in float32 by the reader; others (float64) are normed in
# their own precision (see gradwatch.agent.gradients).
_NARROW = (torch.float32, torch.float16, torch.bfloat16)
MAX_NAMED = 8  # layer names quoted in a notice


@dataclass(frozen=True, slots=True)
class Notice:
    """A part of the agent that is off: ``off`` names it, ``reason`` says why and what to do.

    ``optional``: only an optional statistic is off (info), not a core signal (warning).
    """

    off: str
    reason: str
    optional: bool = False


class Reader(Protocol):
    """What the monitor needs of a gradient reader (GradReader and the stand-ins here)."""

    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def params(self) -> tuple[torch.nn.Parameter, ...]: ...

    def read_into(self, row: torch.Tensor) -> None: ...
    def read_weights_into(self, row: torch.Tensor) -> None: ...
    def snapshot_weights(self) -> list[torch.Tensor]: ...
    def read_updates_into(self, before: list[torch.Tensor], row: torch.Tensor) -> None: ...


class PartialReader:
    """Reads the gradient norms of the layers ``inner`` covers; the others stay MISSING.

    Weight norms and updates are dense for every layer, so ``full`` reads them.
    ``inner`` None: no gradient norm is read at all.
    """

    def __init__(
        self, full: GradReader, inner: GradReader | None, index: torch.Tensor, weights: bool = True
    ) -> None:
        self.names = full.names
        self.device = full.device
        self.params = full.params
        self._full = full
        # What reads the weights (cadence statistics), or None when they are off.
        self.weights_reader: GradReader | None = full if weights else None
        self._inner = inner
        self._index = index
        self._weights = weights
        self._scratch = torch.empty(len(index), dtype=torch.float32, device=full.device)

    def read_into(self, row: torch.Tensor) -> None:
        fill_missing(row)
        if self._inner is not None:
            self._inner.read_into(self._scratch)
            row.index_copy_(0, self._index, self._scratch)

    def read_weights_into(self, row: torch.Tensor) -> None:
        if self._weights:
            self._full.read_weights_into(row)
        else:
            fill_missing(row)

    def snapshot_weights(self) -> list[torch.Tensor]:
        return self._full.snapshot_weights() if self._weights else []

    def read_updates_into(self, before: list[torch.Tensor], row: torch.Tensor) -> None:
        if self._weights and before:
            self._full.read_updates_into(before, row)
        else:
            fill_missing(row)


def recover(reader: Reader) -> tuple[Reader, Notice | None] | None:
    """A reader for the parameters as they are now, and what it leaves out; None if no cause
    is recognised (the failure is then the agent's own, and the monitor switches off)."""
    full = reader._full if isinstance(reader, PartialReader) else reader
    if not isinstance(full, GradReader):
        return None
    params = full.params
    devices = {p.device for p in params}
    if devices != {full.device} and not full.multi_device:
        moved = ", ".join(sorted(str(d) for d in devices - {full.device}))
        index = torch.empty(0, dtype=torch.long, device=full.device)
        return PartialReader(full, None, index, weights=False), Notice(
            "gradient and weight norms",
            f"the model moved from {full.device} to {moved} after watch(); call "
            "gradwatch.watch() after model.to(device)",
        )
    wide = tuple(i for i, p in enumerate(params) if p.dtype not in _NARROW)
    fresh = GradReader(full.names, params, full.device, wide, full.multi_device, full.sharded)
    sparse = [
        i for i, p in enumerate(params) if p.grad is not None and p.grad.layout != torch.strided
    ]
    if not sparse:
        if wide == full.wide:
            return None  # nothing about the parameters changed
        return fresh, None
    dense = [i for i in range(len(params)) if i not in sparse]
    inner = None
    if dense:
        inner = GradReader(
            tuple(full.names[i] for i in dense),
            tuple(params[i] for i in dense),
            full.device,
            tuple(dense.index(i) for i in wide if i in dense),
            full.multi_device,
            full.sharded,
        )
    names = [full.names[i] for i in sparse]
    quoted = ", ".join(names[:MAX_NAMED]) + (
        f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    )
    index = torch.tensor(dense, dtype=torch.long, device=full.device)
    # With dense layers still read, this is a gap in coverage the model has by design (a
    # recommender's sparse embedding on every healthy run), not an incident: info. Only
    # a model whose every layer is sparse has lost its gradient signal: a warning.
    return PartialReader(fresh, inner, index), Notice(
        "gradient norms of sparse layers",
        f"{quoted} get sparse gradients (e.g. nn.Embedding(sparse=True)), whose norms "
        "cannot be read without a device sync; these layers are not measured, the others are",
        optional=bool(dense),
    )


class NoticeBoard:
    """The notices in force, and when each is due to be sent again.

    An event sent before the collector is connected is lost (the socket
    queues nothing for an absent peer), so a notice added before the
    connection is due again as soon as there is one, and every notice is
    resent every ``every_s`` seconds while it holds; the collector's alert
    deduplicates.
    """

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._held: dict[str, Notice] = {}
        self.next_s = float("inf")

    def add(self, notice: Notice, now: float, connected: bool) -> bool:
        """Hold ``notice``; False if the same part was already off."""
        new = notice.off not in self._held
        self._held[notice.off] = notice
        self.next_s = now + self._every_s if connected else 0.0
        return new

    def due(self, now: float, connected: bool) -> list[Notice]:
        """The notices to send again now (a float compare when none is due)."""
        if now < self.next_s or not connected:
            return []
        self.next_s = now + self._every_s
        return list(self._held.values())


class Follower:
    """Decides whether an optimizer the loop created after ``watch()`` replaces the watched one.

    It does when it holds any of the watched parameters and steps first in a
    step (the monitor asks only then): a loop that re-creates its optimizer
    (a new training phase, a resume) keeps being watched, while a wrapper
    that steps an inner optimizer (Lookahead), or another model's optimizer,
    does not take over. Each optimizer is judged once.
    """

    def __init__(self, params: tuple[torch.nn.Parameter, ...], watched: object) -> None:
        self._ids = frozenset(id(p) for p in params)
        self._verdicts: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()
        self._verdicts[watched] = True

    def adopts(self, optimizer: object) -> bool:
        verdict = self._verdicts.get(optimizer)
        if verdict is None:
            groups = getattr(optimizer, "param_groups", ())
            verdict = any(id(p) in self._ids for g in groups for p in g.get("params", ()))
            self._verdicts[optimizer] = verdict
        return verdict
