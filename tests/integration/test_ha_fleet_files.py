"""deploy/fleet/: many collectors, one Prometheus, an Alertmanager cluster; files checked.

The Compose file against the Compose Specification (vendored by
check-jsonschema), the Kubernetes objects against Kubernetes' schemas
(kubernetes-validate), the Prometheus configs with ``promtool check config`` and
the Alertmanager config with ``amtool check-config``; and the HA wiring that no
schema sees: every collector and Prometheus post to every Alertmanager replica,
every replica peers with all of them, Prometheus scrapes every collector.
tests/integration/test_ha_pair.py runs that shape with real processes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gradwatch.collector.config import CollectorConfig
from tests.binaries import require_binary

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "deploy" / "fleet"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted((FLEET / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
        if doc
    ]


def k8s(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def collector_settings(env: dict[str, str] | list[dict[str, Any]]) -> dict[str, Any]:
    items = env.items() if isinstance(env, dict) else ((e["name"], e.get("value")) for e in env)
    return {
        k.removeprefix("GRADWATCH_").lower(): v
        for k, v in items
        if k.startswith("GRADWATCH_") and v is not None
    }


def check(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"


def kubernetes_discovery(promtool: str) -> bool:
    """Whether this promtool knows ``kubernetes_sd_configs`` (distribution builds may drop it)."""
    probe = "scrape_configs:\n  - job_name: p\n    kubernetes_sd_configs: [{role: pod}]\n"
    done = subprocess.run(
        [promtool, "check", "config", "/dev/stdin"],
        input=probe,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return "kubernetes_sd_configs not found" not in done.stdout + done.stderr


# ------------------------------------------------------------------------ compose


def test_fleet_compose_is_valid_and_wired_for_ha() -> None:
    compose = load(FLEET / "compose.yaml")
    schema = json.loads(
        files("check_jsonschema.builtin_schemas.vendor")
        .joinpath("compose-spec.json")
        .read_text(encoding="utf-8")
    )
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(compose)
    ]
    assert not errors, "\n".join(errors)
    services = compose["services"]
    collectors = sorted(n for n in services if n.startswith("collector-"))
    ams = sorted(n for n in services if n.startswith("alertmanager-"))
    assert len(collectors) >= 2 and len(ams) >= 2
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (FLEET / source).exists(), f"{name}: {source} does not exist"
    am_urls = {f"http://{am}:9093" for am in ams}
    for name in collectors:
        settings = collector_settings(services[name]["environment"])
        assert not set(settings) - set(CollectorConfig.model_fields), name
        assert set(CollectorConfig(**settings).alertmanager_urls) == am_urls, name
    for name in ams:
        args = services[name]["command"]
        assert {a.split("=", 1)[1] for a in args if a.startswith("--cluster.peer=")} == {
            f"{am}:9094" for am in ams
        }, name
        assert "--cluster.listen-address=0.0.0.0:9094" in args
    prometheus = load(FLEET / "prometheus.yml")
    (scrape,) = prometheus["scrape_configs"]
    assert {t for sc in scrape["static_configs"] for t in sc["targets"]} == {
        f"{c}:9400" for c in collectors
    }
    assert {
        t
        for am in prometheus["alerting"]["alertmanagers"]
        for sc in am["static_configs"]
        for t in sc["targets"]
    } == {f"{am}:9093" for am in ams}


def test_promtool_and_amtool_accept_the_compose_configs(tmp_path: Path) -> None:
    promtool, amtool = require_binary("promtool"), require_binary("amtool")
    shutil.copy(FLEET / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    check([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    check([amtool, "check-config", str(ROOT / "deploy" / "alertmanager" / "alertmanager.yml")])


# --------------------------------------------------------------------- kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_fleet_k8s_objects_are_valid(version: str) -> None:
    for name, doc in k8s_documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']} is invalid for Kubernetes {version}: {exc}")
    assert {d["kind"] for _, d in k8s_documents()} >= {
        "StatefulSet",
        "Deployment",
        "Service",
        "ConfigMap",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
        "PodDisruptionBudget",
    }


def test_fleet_k8s_alertmanager_cluster_and_who_posts_to_it(tmp_path: Path) -> None:
    sts = k8s("StatefulSet", "alertmanager")
    replicas = sts["spec"]["replicas"]
    assert replicas >= 2
    service = sts["spec"]["serviceName"]
    assert k8s("Service", service)["spec"]["clusterIP"] == "None"  # per-pod DNS names
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    peers = {a.split("=", 1)[1] for a in container["args"] if a.startswith("--cluster.peer=")}
    names = [f"alertmanager-{i}.{service}" for i in range(replicas)]
    assert peers == {f"{n}:9094" for n in names}
    # Every collector and Prometheus post to every replica.
    pool = k8s("Deployment", "gradwatch-collector-pool-a")
    (collector,) = pool["spec"]["template"]["spec"]["containers"]
    settings = collector_settings(collector["env"])
    assert not set(settings) - set(CollectorConfig.model_fields)
    # (The rest of its settings need the secret files: parse the URLs as the collector does.)
    urls = CollectorConfig(alertmanager_urls=settings["alertmanager_urls"]).alertmanager_urls
    assert set(urls) == {f"http://{n}:9093" for n in names}
    prometheus = yaml.safe_load(k8s("ConfigMap", "prometheus-config")["data"]["prometheus.yml"])
    assert {
        t
        for am in prometheus["alerting"]["alertmanagers"]
        for sc in am["static_configs"]
        for t in sc["targets"]
    } == {f"{n}:9093" for n in names}
    # The ConfigMap is deploy/alertmanager/alertmanager.yml (same routes and receivers).
    config = k8s("ConfigMap", "alertmanager-config")["data"]["alertmanager.yml"]
    assert yaml.safe_load(config) == load(ROOT / "deploy" / "alertmanager" / "alertmanager.yml")
    (tmp_path / "alertmanager.yml").write_text(config)
    check([require_binary("amtool"), "check-config", str(tmp_path / "alertmanager.yml")])


def test_fleet_k8s_prometheus_finds_every_collector_and_promtool_accepts_it(tmp_path: Path) -> None:
    text = k8s("ConfigMap", "prometheus-config")["data"]["prometheus.yml"]
    config = yaml.safe_load(text)
    (scrape,) = config["scrape_configs"]
    keep = {
        tuple(r["source_labels"]): r["regex"]
        for r in scrape["relabel_configs"]
        if r.get("action") == "keep"
    }
    # The pool collector's pod matches every keep rule: its labels and its port's name.
    pod = k8s("Deployment", "gradwatch-collector-pool-a")["spec"]["template"]
    labels = {
        f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
        for k, v in pod["metadata"]["labels"].items()
    }
    (container,) = pod["spec"]["containers"]
    ports = {p["name"] for p in container["ports"]}
    for (source,), regex in keep.items():
        value = labels.get(source) if "label" in source else regex if regex in ports else None
        assert value is not None and re.fullmatch(regex, value), (source, regex)
    # promtool reads the files it names: put them where the test can give them.
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("metrics-password", "metrics-ca-crt"):
        (secrets / name).write_text("x")
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    text = text.replace("/etc/prometheus/secrets", str(secrets)).replace(
        "/etc/prometheus/alerts/alerts.yml", str(tmp_path / "alerts.yml")
    )
    if not kubernetes_discovery(require_binary("promtool")):
        # Debian builds Prometheus without Kubernetes discovery: check everything else.
        checked = yaml.safe_load(text)
        del checked["scrape_configs"][0]["kubernetes_sd_configs"]
        checked["scrape_configs"][0]["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
        text = yaml.safe_dump(checked)
    (tmp_path / "prometheus.yml").write_text(text)
    check([require_binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml")])
