"""Standard Webhooks signatures: HMAC-SHA256 over ``"{id}.{timestamp}.{body}"``.

The scheme of https://www.standardwebhooks.com: every request carries
``webhook-id`` (stable per notification, so receivers drop retried copies),
``webhook-timestamp`` (Unix seconds, so receivers reject replays) and
``webhook-signature`` (``v1,<base64 HMAC>``; a space-separated list while
secrets rotate). Secrets are written ``whsec_<base64 key>``. Any receiver that
uses a Standard Webhooks library can verify gradwatch's alerts.

Example::

    from gradwatch.collector.signing import decode_secret, signature_headers, verify

    key = decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    headers = signature_headers(key, "a1b2c3d4e5f60718:firing", b'{"x": 1}', now=time.time())
    verify(key, headers, b'{"x": 1}', now=time.time())   # 'a1b2c3d4e5f60718:firing'
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
DEFAULT_TOLERANCE_S = 300.0


class SignatureError(ValueError):
    """A secret or a signed request is invalid; the message says which part and why."""


def decode_secret(text: str) -> bytes:
    """The key bytes of a ``whsec_<base64>`` secret; raises ``SignatureError`` otherwise."""
    value = text.strip()
    if not value.startswith(SECRET_PREFIX):
        raise SignatureError(
            "webhook secret must start with 'whsec_' followed by base64 key bytes; generate one "
            "with: python -c \"import base64,os; print('whsec_'+base64.b64encode(os.urandom(32))"
            '.decode())"'
        )
    try:
        key = base64.b64decode(value[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureError(
            "webhook secret after 'whsec_' is not valid base64; copy it again without "
            "spaces or line breaks"
        ) from exc
    if len(key) < 16:
        raise SignatureError(
            f"webhook secret is only {len(key)} bytes; use at least 16 (24-64 recommended)"
        )
    return key


def sign(secret: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """``"v1,<base64 HMAC-SHA256(secret, f'{msg_id}.{timestamp}.{body}')>"``."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret, content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def signature_headers(secret: bytes, msg_id: str, body: bytes, now: float) -> dict[str, str]:
    """The three Standard Webhooks headers for one request sent at ``now``."""
    timestamp = int(now)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def verify(
    secret: bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float,
    tolerance: float = DEFAULT_TOLERANCE_S,
) -> str:
    """Check a received request; return its ``webhook-id`` or raise ``SignatureError``.

    Header names are matched case-insensitively. The timestamp must be within
    ``tolerance`` seconds of ``now`` either way (replay protection) and one of
    the listed ``v1`` signatures must match, compared in constant time.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    missing = [
        h for h in ("webhook-id", "webhook-timestamp", "webhook-signature") if not lower.get(h)
    ]
    if missing:
        raise SignatureError(
            f"missing header(s) {', '.join(missing)}; "
            "the sender must use the Standard Webhooks scheme"
        )
    msg_id, stamp = lower["webhook-id"], lower["webhook-timestamp"].strip()
    if not stamp.isdigit():
        raise SignatureError(f"webhook-timestamp {stamp[:32]!r} is not Unix seconds")
    timestamp = int(stamp)
    if timestamp < now - tolerance:
        raise SignatureError(
            f"webhook-timestamp is {now - timestamp:.0f}s old (tolerance "
            f"{tolerance:.0f}s): a replay, or the sender's clock is wrong"
        )
    if timestamp > now + tolerance:
        raise SignatureError(
            f"webhook-timestamp is {timestamp - now:.0f}s in the future "
            f"(tolerance {tolerance:.0f}s): check both clocks (NTP)"
        )
    expected = sign(secret, msg_id, timestamp, body).encode()
    for candidate in lower["webhook-signature"].split():
        if hmac.compare_digest(candidate.encode(), expected):
            return msg_id
    raise SignatureError(
        "no webhook-signature matches: the secret differs from the sender's "
        "or the body was changed after signing"
    )
