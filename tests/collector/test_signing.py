"""Standard Webhooks signing: the specification's published vector, and every way to fail."""

from __future__ import annotations

import base64

import pytest

from gradwatch.collector.signing import (
    SignatureError,
    decode_secret,
    sign,
    signature_headers,
    verify,
)

# The Standard Webhooks specification's test vector.
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TIMESTAMP = 1614265330
BODY = b'{"test": 2432232314}'
SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def headers(signature: str = SIGNATURE, timestamp: int = TIMESTAMP) -> dict[str, str]:
    return {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
    }


def test_sign_reproduces_the_specification_vector() -> None:
    assert sign(decode_secret(SECRET), MSG_ID, TIMESTAMP, BODY) == SIGNATURE


def test_verify_accepts_the_vector_with_any_header_case_and_a_signature_list() -> None:
    key = decode_secret(SECRET)
    upper = {k.upper(): v for k, v in headers(f"v1,bm90LWl0 {SIGNATURE}").items()}
    assert verify(key, upper, BODY, now=TIMESTAMP + 10) == MSG_ID


def test_signature_headers_round_trip() -> None:
    key = decode_secret(SECRET)
    got = signature_headers(key, "abc:firing", b"{}", now=1_700_000_000.9)
    assert got["webhook-id"] == "abc:firing" and got["webhook-timestamp"] == "1700000000"
    assert verify(key, got, b"{}", now=1_700_000_001.0) == "abc:firing"


@pytest.mark.parametrize(
    ("hdrs", "body", "now", "match"),
    [
        ({"webhook-id": MSG_ID}, BODY, TIMESTAMP, "missing header"),
        (headers(), b'{"test": 2432232315}', TIMESTAMP, "no webhook-signature matches"),
        (headers("v1,AAAA"), BODY, TIMESTAMP, "no webhook-signature matches"),
        (headers(), BODY, TIMESTAMP + 301, "old"),
        (headers(), BODY, TIMESTAMP - 301, "future"),
        ({**headers(), "webhook-timestamp": "soon"}, BODY, TIMESTAMP, "not Unix seconds"),
    ],
)
def test_verify_rejects(hdrs: dict[str, str], body: bytes, now: float, match: str) -> None:
    with pytest.raises(SignatureError, match=match):
        verify(decode_secret(SECRET), hdrs, body, now=now)


def test_verify_rejects_another_secret() -> None:
    other = decode_secret("whsec_" + base64.b64encode(b"x" * 32).decode())
    with pytest.raises(SignatureError, match="secret differs"):
        verify(other, headers(), BODY, now=TIMESTAMP)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must start with 'whsec_'"),
        ("whsec_not base64!", "not valid base64"),
        ("whsec_c2hvcnQ=", "only 5 bytes"),
    ],
)
def test_decode_secret_explains_bad_secrets(text: str, match: str) -> None:
    with pytest.raises(SignatureError, match=match):
        decode_secret(text)
