"""The ``takeover`` command as the agent reads it (checked in agent/commands.py).

The collector names the job's silent ranks (wire/commands.py: ``[first,
last]`` runs); :class:`Takeover` is that set and when it was issued. What the
agent does with it is agent/takeover.py's. Apart from it so the command
checks do not import the monitor's class chain.

Example::

    >>> from gradwatch.agent.takeover_command import takeover_of
    >>> takeover_of({"silent": [[0, 0], [4, 7]], "issued_at": 5.0}).silent == {0, 4, 5, 6, 7}
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradwatch.wire.commands import ranks_of_runs


@dataclass(frozen=True, slots=True)
class Takeover:
    """The job's silent ranks, as the collector saw them at ``issued_at`` (its clock)."""

    silent: frozenset[int]
    issued_at: float


def takeover_of(fields: Mapping[str, Any]) -> Takeover:
    """A takeover from a verified command body; ``ValueError``/``KeyError`` if malformed."""
    return Takeover(ranks_of_runs(fields["silent"]), float(fields["issued_at"]))
