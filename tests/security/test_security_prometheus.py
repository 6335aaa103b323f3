"""A real Prometheus scrapes /metrics over TLS with basic auth, using SECURITY.md's snippet."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from gradwatch.collector.config import CollectorConfig
from tests.binaries import require_binary
from tests.integration.promstack import _serve, query, wait_until
from tests.security.helpers import running
from tests.security.test_security_metrics_http import PASSWORD, self_signed

SECURITY_MD = Path(__file__).resolve().parents[2] / "SECURITY.md"
SCRAPE_WAIT_S = 30.0


def documented_scrape_config() -> dict[str, Any]:
    """The ``scrape_configs`` YAML block of SECURITY.md, parsed."""
    blocks = re.findall(r"```yaml\n(.*?)```", SECURITY_MD.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "scrape_configs:" in b]
    config: dict[str, Any] = yaml.safe_load(block)
    return config


def test_prometheus_scrapes_with_the_documented_tls_and_basic_auth(tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    cert_file, key_file = self_signed(tmp_path)
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*",
        metrics_addr="127.0.0.1:0",
        metrics_tls_cert_file=cert_file,
        metrics_tls_key_file=key_file,
        metrics_basic_auth_user="prometheus",
        metrics_basic_auth_password_file=password_file,
    )
    prom_config = documented_scrape_config()
    (job,) = prom_config["scrape_configs"]
    with running(config) as server:
        job["tls_config"].update(ca_file=str(cert_file), server_name="127.0.0.1")
        job["basic_auth"]["password_file"] = str(password_file)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{server.metrics_port}"]}]
        prom_config["global"] = {"scrape_interval": "1s"}
        config_file = tmp_path / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(prom_config))

        def argv(port: int) -> list[str]:
            return [
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ]

        with _serve(binary, argv, tmp_path / "prometheus.log", "prometheus") as prom:
            up = wait_until(
                lambda: query(prom.url, 'up{job="gradwatch"} == 1') or None,
                SCRAPE_WAIT_S,
                "a successful https + basic auth scrape",
            )
            assert up[0]["value"][1] == "1"
            built = query(prom.url, "gradwatch_build_info")
            assert built and built[0]["metric"]["job"] == "gradwatch"
