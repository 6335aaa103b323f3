"""/metrics behind basic auth and TLS; /healthz and /readyz stay open for probes."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gradwatch.collector.config import CollectorConfig, ConfigError
from tests.binaries import require_binary
from tests.security.helpers import WAIT_S, running

PASSWORD = "s3cret-scrape"


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key (so it is its own CA)."""
    try:
        return _with_cryptography(tmp_path)
    except ImportError:
        return _with_openssl(tmp_path)


def _with_openssl(tmp_path: Path) -> tuple[Path, Path]:
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            require_binary("openssl"),
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=gradwatch-test",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key_file),
            "-out",
            str(cert_file),
        ],
        check=True,
        capture_output=True,
        timeout=WAIT_S,
    )
    return cert_file, key_file


def _with_cryptography(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gradwatch-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return cert_file, key_file


def get(
    url: str, auth: str | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_basic_auth_guards_metrics_only(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        metrics_basic_auth_user="prometheus",
        metrics_basic_auth_password_file=password_file,
    )
    with running(config) as server:
        base = server.metrics_url.removesuffix("/metrics")
        assert get(server.metrics_url)[0] == 401
        assert get(server.metrics_url, "prometheus:wrong")[0] == 401
        status, body = get(server.metrics_url, f"prometheus:{PASSWORD}")
        assert status == 200 and "gradwatch_build_info" in body
        assert get(base + "/healthz") == (200, "ok\n")
        assert get(base + "/readyz") == (200, "ready\n")


def test_tls_scrape_with_the_test_ca(tmp_path: Path) -> None:
    cert_file, key_file = self_signed(tmp_path)
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        metrics_tls_cert_file=cert_file,
        metrics_tls_key_file=key_file,
        metrics_basic_auth_user="prometheus",
        metrics_basic_auth_password=PASSWORD,
    )
    with running(config) as server:
        https = server.metrics_url.replace("http://", "https://")
        trusted = ssl.create_default_context(cafile=str(cert_file))
        status, body = get(https, f"prometheus:{PASSWORD}", trusted)
        assert status == 200 and "gradwatch_build_info" in body
        assert get(https, None, trusted)[0] == 401
        # A client that does not trust the CA is refused at the handshake.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(https, f"prometheus:{PASSWORD}", ssl.create_default_context())
        # Plain HTTP gets no answer, and the server stays up for the next scrape.
        with socket.create_connection(("127.0.0.1", server.metrics_port), WAIT_S) as plain:
            plain.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert b"gradwatch" not in plain.recv(4096)
        assert get(https.replace("/metrics", "/healthz"), None, trusted) == (200, "ok\n")


def test_half_configured_metrics_security_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        CollectorConfig(metrics_tls_cert_file=tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="metrics_basic_auth_user needs"):
        CollectorConfig(metrics_basic_auth_user="prometheus")
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        metrics_tls_cert_file=tmp_path / "missing.pem",
        metrics_tls_key_file=tmp_path / "missing.key",
    )
    with (
        pytest.raises(ConfigError, match="cannot load the metrics TLS certificate"),
        running(config),
    ):
        pass
