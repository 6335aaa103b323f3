"""Commands from the collector to agents (rollback): the signed frame format, both ends.

A command is three ZeroMQ frames: the job name (the SUB topic), a canonical
JSON body, and ``v1=<hex HMAC-SHA256 of the body>`` under a key shared by the
collector and the job. The body carries ``issued_at`` and a random ``nonce``,
so the receiver checks freshness and replay on signed data. The checks
themselves (freshness, replay, fields) are the agent's
(:mod:`gradwatch.agent.commands`); the signing lives here so both ends agree.

Example::

    frames = encode_command({"job": "run-42", "action": "rollback", ...}, key)
    assert signature_ok(key, frames[1], frames[2])
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any, Final

SIGNATURE_PREFIX: Final = b"v1="
MIN_KEY_BYTES: Final = 16  # HMAC-SHA256 keys shorter than this are guessable; refuse them
MAX_COMMAND_BYTES: Final = 64 * 1024


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
