"""The usual step's host row, from slots decided once.

Nearly every ``log()`` of a run looks like the one before: the same names
(``loss=``), each value of the same kind (a 0-d tensor, a Python number),
a float learning rate per parameter group. A column's slot never moves once
:class:`~gradwatch.agent.layout.Columns` assigned it, so a :class:`RowPlan`
records every slot one step used, and the next step writes its values
straight into a fresh host row: no slot lookups, no pair lists, no
per-column calls. That matters more than it looks: ``log()`` runs right after
the backward pass and the optimizer, on a cache they emptied, where each
Python call and each dictionary costs microseconds.

Anything the plan did not see returns ``None`` from :meth:`RowPlan.row` (a
new name, a value of another kind, a tensor on another device or of another
shape, a rate that is a tensor, a param group added, the step's rates not
read by the pre-hook), and the monitor's general path records the step and
makes a new plan. The two paths write the same cells: the general path is
the reference, and tests/agent/test_agent_rowplan.py compares them.

Example::

    >>> import torch
    >>> from gradwatch.agent.layout import Columns
    >>> from gradwatch.agent.rowplan import RowPlan
    >>> cols = Columns(layers=("w",), base=("loss", "lr/0", "skipped"), device_capacity=2)
    >>> slots = {c: cols.host_slot(c) for c in ("loss", "lr/0", "skipped")}
    >>> plan = RowPlan.make(cols, ("loss",), ("loss",), ("lr/0",), None, "skipped",
    ...                     None, None, True, torch.device("cpu"))
    >>> plan.row({"loss": 2.5}, 0.0, [0.1], 1, False, 0.0, 0.0, None)
    [2.5, 0.1, 0.0]
"""

from __future__ import annotations

from typing import Any

import torch

from gradwatch.agent.layout import Columns, HostValue, Later

# Logged numbers that go to their host slot as they are (an exact type test: an
# isinstance against numbers.Real costs a microsecond; the general path takes the rest).
_NUMBERS = (float, int, bool)
# Later(...) through tuple.__new__ directly: a NamedTuple's own __new__ is a
# Python function, one more call per step.
_later = tuple.__new__


class RowPlan:
    """Slots of one step's columns, for the next steps that log the same way.

    ``names``: the ``log()`` keywords in call order; ``host`` and ``dev``: the
    host and device slot of each (-1: none yet); ``lrs``: each param group's
    rate's host slot; ``phases``: the data and forward seconds' host slots, or
    None before the phase clock first ran; ``scale``: the loss scale's device
    slot (-1 without a GradScaler).
    """

    __slots__ = (
        "by_reference",
        "dev",
        "device",
        "host",
        "lrs",
        "names",
        "phases",
        "scale",
        "scaler",
        "skipped",
        "width",
    )

    def __init__(
        self,
        names: tuple[str, ...],
        host: tuple[int, ...],
        dev: tuple[int, ...],
        lrs: tuple[int, ...],
        phases: tuple[int, int] | None,
        skipped: int,
        scale: int,
        scaler: Any,
        width: int,
        by_reference: bool,
        device: torch.device,
    ) -> None:
        self.names, self.host, self.dev, self.lrs = names, host, dev, lrs
        self.phases, self.skipped, self.scale, self.scaler = phases, skipped, scale, scaler
        self.width, self.by_reference, self.device = width, by_reference, device

    @classmethod
    def make(
        cls,
        columns: Columns,
        names: tuple[str, ...],
        scalar_columns: tuple[str, ...],
        lr_columns: tuple[str, ...],
        phase_columns: tuple[str, str] | None,
        skipped_column: str,
        scale_column: str | None,
        scaler: Any,
        by_reference: bool,
        device: torch.device,
    ) -> RowPlan | None:
        """The plan of the slots ``columns`` holds now; None if a rate or the skipped
        flag has no host slot, or the loss scale (``scaler`` given) no device slot, yet."""
        lrs = tuple(columns.slots(c)[0] for c in lr_columns)
        skipped = columns.slots(skipped_column)[0]
        scale = -1 if scaler is None or scale_column is None else columns.slots(scale_column)[1]
        if skipped < 0 or min(lrs, default=0) < 0 or (scaler is not None and scale < 0):
            return None
        phases = None
        if phase_columns is not None:
            data, forward = (columns.slots(c)[0] for c in phase_columns)
            phases = (data, forward) if data >= 0 and forward >= 0 else None
        pairs = [columns.slots(c) for c in scalar_columns]
        return cls(
            names,
            tuple(h for h, _ in pairs),
            tuple(d for _, d in pairs),
            lrs,
            phases,
            skipped,
            scale,
            scaler,
            columns.host_width,
            by_reference,
            device,
        )

    def row(
        self,
        scalars: dict[str, Any],
        skipped: float,
        lrs: list[Any] | None,
        n_groups: int,
        began: bool,
        data_s: float,
        forward_s: float,
        buffer: Any,
    ) -> list[HostValue] | None:
        """This step's host row, its device values copied into ``buffer``'s open row
        (queued, no sync); None when the step does not fit the plan (nothing that
        the general path would not write again is written then)."""
        if lrs is None or len(lrs) != n_groups or n_groups != len(self.lrs):
            return None
        if len(scalars) != len(self.names) or (began and self.phases is None):
            return None
        row: list[HostValue] = [None] * self.width
        row[self.skipped] = skipped
        if began:
            data, forward = self.phases  # type: ignore[misc]  # checked above
            row[data], row[forward] = data_s, forward_s
        for slot, lr in zip(self.lrs, lrs):  # noqa: B905  # lengths checked above
            if type(lr) is not float:
                return None
            row[slot] = lr
        for (name, value), want, slot, cell in zip(  # noqa: B905  # lengths checked above
            scalars.items(), self.names, self.host, self.dev
        ):
            if name != want:
                return None
            if type(value) in _NUMBERS:
                if slot < 0:
                    return None
                row[slot] = value
            elif type(value) is not torch.Tensor or value.ndim:
                return None  # a subclass, a shape to reshape, or no tensor at all
            elif self.by_reference and not value.is_leaf:
                # An autograd result (is_leaf: grad_fn is None, without making the
                # grad_fn's Python object as reading it would).
                if slot < 0:
                    return None
                value = value.detach()
                row[slot] = _later(Later, (value, value._version))
            elif cell >= 0 and value.device == self.device:
                buffer.cell(cell).copy_(value.detach())
            else:
                return None
        if self.scaler is not None:
            scale = getattr(self.scaler, "_scale", None)
            if type(scale) is not torch.Tensor or scale.numel() != 1 or scale.device != self.device:
                return None
            buffer.cell(self.scale).copy_(scale.reshape(()))
        return row
