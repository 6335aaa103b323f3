"""Commands from the collector to agents (rollback, takeover): the signed frame format, both ends.

A command is three ZeroMQ frames: the job name (the SUB topic), a canonical
JSON body, and ``v1=<hex HMAC-SHA256 of the body>`` under a key shared by the
collector and the job. The body carries ``issued_at`` and a random ``nonce``,
so the receiver checks freshness and replay on signed data. The checks
themselves (freshness, replay, fields) are the agent's
(:mod:`gradwatch.agent.commands`); the signing lives here so both ends agree.

A ``takeover`` command (docs/distributed.md, "Takeover") names the job's
silent ranks as ``[first, last]`` runs (:func:`rank_runs`, read back with
:func:`ranks_of_runs`): a node's eight ranks travel as one pair, so the body
stays small at 16,384 ranks.

Example::

    frames = encode_command({"job": "run-42", "action": "rollback", ...}, key)
    assert signature_ok(key, frames[1], frames[2])
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

SIGNATURE_PREFIX: Final = b"v1="
MIN_KEY_BYTES: Final = 16  # HMAC-SHA256 keys shorter than this are guessable; refuse them
MAX_COMMAND_BYTES: Final = 64 * 1024
ROLLBACK: Final = "rollback"
TAKEOVER: Final = "takeover"
# Runs of silent ranks one takeover may name, and ranks they may cover in all: the
# body stays under MAX_COMMAND_BYTES, and an authentic but absurd body cannot make
# the agent build a huge set (ranks are < 2**20 on the wire, wire.messages.MAX_RANK).
MAX_SILENT_RUNS: Final = 2048
MAX_SILENT_RANKS: Final = 1 << 20


def command_signature(key: bytes, body: bytes) -> bytes:
    """The signature frame of ``body`` under ``key``."""
    return SIGNATURE_PREFIX + hmac.new(key, body, hashlib.sha256).hexdigest().encode("ascii")


def encode_command(command: Mapping[str, Any], key: bytes) -> list[bytes]:
    """The frames of one command: topic (the job), canonical JSON body, signature."""
    body = json.dumps(dict(command), sort_keys=True, separators=(",", ":"), allow_nan=False).encode(
        "utf-8"
    )
    return [str(command["job"]).encode("utf-8"), body, command_signature(key, body)]


def signature_ok(key: bytes, body: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``body``'s under ``key`` (constant-time comparison)."""
    return hmac.compare_digest(signature, command_signature(key, body))


def rank_runs(ranks: Iterable[int]) -> list[list[int]]:
    """Sorted ``ranks`` as ``[first, last]`` runs of consecutive ranks.

    >>> rank_runs({0, 1, 2, 3, 9})
    [[0, 3], [9, 9]]
    """
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return runs


def ranks_of_runs(runs: object) -> frozenset[int]:
    """The ranks of :func:`rank_runs`' output; ``ValueError`` if malformed or too large."""
    if not isinstance(runs, list) or len(runs) > MAX_SILENT_RUNS:
        raise ValueError(f"silent: expected a list of at most {MAX_SILENT_RUNS} [first, last] runs")
    out: set[int] = set()
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(type(r) is int for r in run)
            or not 0 <= run[0] <= run[1]
        ):
            raise ValueError(f"silent: {str(run)[:40]} is not a [first, last] run of ranks")
        if len(out) + run[1] - run[0] + 1 > MAX_SILENT_RANKS:
            raise ValueError(f"silent: more than {MAX_SILENT_RANKS} ranks")
        out.update(range(run[0], run[1] + 1))
    return frozenset(out)
