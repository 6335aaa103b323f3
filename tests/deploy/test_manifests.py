"""deploy/: the Compose file against the Compose Specification's JSON schema, the
Kubernetes manifests against Kubernetes' OpenAPI-derived JSON schemas, and both
against what the collector really accepts and serves.

Schemas come inside packages (no network): the Compose spec vendored by
check-jsonschema, Kubernetes' by kubernetes-validate. No package ships the
Prometheus Operator's CRD schemas, so the ServiceMonitor and PodMonitor get
structural checks against what they select, and the PrometheusRule's groups go
through promtool.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gradwatch.collector.cli import collector_parser
from gradwatch.collector.config import CollectorConfig
from gradwatch.collector.server import Server
from gradwatch.rules import load_rules
from tests.binaries import require_binary
from tests.deploy.k8s_alerts import render as render_prometheus_rules
from tests.deploy.k8s_rules import render as render_rules_configmap

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest release with native sidecars on by default, and the newest with a schema.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
        if doc
    ]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in k8s_documents() if doc["kind"] == kind]


def pod_specs() -> Iterator[dict[str, Any]]:
    for doc in by_kind("Deployment") + by_kind("Job"):
        yield doc["spec"]["template"]["spec"]


def collector_containers() -> list[dict[str, Any]]:
    return [
        c
        for spec in pod_specs()
        for c in spec.get("containers", []) + spec.get("initContainers", [])
        if c["image"].startswith("gradwatch-collector")
    ]


def env_fields(env: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    items = env.items() if isinstance(env, dict) else ((e["name"], e.get("value")) for e in env)
    return {
        name.removeprefix("GRADWATCH_").lower(): value
        for name, value in items
        if name.startswith("GRADWATCH_")
    }


# ------------------------------------------------------------------------ compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "compose.yaml")


def test_compose_file_is_valid_against_the_compose_spec(compose: dict[str, Any]) -> None:
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
    broken = dict(compose, services={"collector": {"image": "x", "ports": {"bad": 1}}})
    assert list(validator.iter_errors(broken)), "the schema must reject a malformed file"


def test_compose_mounts_the_files_the_other_configs_name(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= {"collector", "prometheus", "alertmanager", "grafana"}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
    build = services["collector"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    assert mounts["/etc/prometheus/alerts.yml"] == "./prometheus/alerts.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    am = {v.split(":")[1]: v.split(":")[0] for v in services["alertmanager"]["volumes"]}
    assert am["/etc/alertmanager/alertmanager.yml"] == "./alertmanager/alertmanager.yml"
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert grafana["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
    assert grafana["/etc/grafana/provisioning/dashboards"] == "./grafana/provisioning/dashboards"
    # The dashboards provider reads the folder the dashboard JSON is mounted at.
    (provider,) = load_yaml(DEPLOY / "grafana/provisioning/dashboards/gradwatch.yaml")["providers"]
    assert grafana[provider["options"]["path"]] == "../collector/dashboards"
    assert (DEPLOY / "../collector/dashboards/gradwatch.json").is_file()


def test_compose_host_names_match_prometheus_and_grafana(compose: dict[str, Any]) -> None:
    prometheus_yml = DEPLOY / "prometheus/prometheus.yml"
    if not prometheus_yml.exists():
        pytest.fail("deploy/prometheus/prometheus.yml is missing; compose mounts it")
    config = load_yaml(prometheus_yml)
    targets = {
        t
        for job in config["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    targets |= {
        t
        for am in config["alerting"]["alertmanagers"]
        for sc in am["static_configs"]
        for t in sc["targets"]
    }
    published = {
        f"{name}:{port.split(':')[-1]}"
        for name, service in compose["services"].items()
        for port in service.get("ports", [])
    }
    assert targets <= published, f"Prometheus targets not served by compose: {targets - published}"
    (datasource,) = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"].removeprefix("http://") in published


def test_compose_collector_settings_are_real_config_fields(compose: dict[str, Any]) -> None:
    settings = env_fields(compose["services"]["collector"].get("environment", {}))
    unknown = set(settings) - set(CollectorConfig.model_fields)
    assert not unknown, f"compose sets GRADWATCH_* variables the collector ignores: {unknown}"
    CollectorConfig(**settings)  # and the values validate


# --------------------------------------------------------------------- kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_are_valid_kubernetes_objects(version: str) -> None:
    checked = 0
    for name, doc in k8s_documents():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: structural checks below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']} is invalid for Kubernetes {version}: {exc}")
        checked += 1
    assert {d["kind"] for _, d in k8s_documents()} >= {
        "Deployment",
        "Service",
        "ServiceMonitor",
        "ConfigMap",
        "Secret",
        "Job",
        "PersistentVolumeClaim",
        "PrometheusRule",
        "PodMonitor",
    }
    assert checked >= 6


def test_service_monitor_selects_the_collector_service() -> None:
    (monitor,) = by_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (service,) = by_kind("Service")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= service["metadata"]["labels"].items()
    # The Operator names the scrape job after this Service label (else the Service's name).
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "gradwatch"
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
        # The training job has its own label: `job` must stay the scrape job's.
        assert not endpoint.get("honorLabels", False)
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
    (deployment,) = by_kind("Deployment")
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_the_training_pod_carries_the_collector_as_a_sidecar() -> None:
    (job,) = by_kind("Job")
    spec = job["spec"]["template"]["spec"]
    (sidecar,) = spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: ends after the trainer
    args = collector_parser().parse_args(sidecar["args"])
    # The agent's default endpoint: the pod's shared loopback.
    assert args.listen == "tcp://127.0.0.1:5555"
    assert [c["name"] for c in spec["containers"]] == ["trainer"]


def test_collector_containers_use_real_settings_and_existing_secrets() -> None:
    (secret,) = by_kind("Secret")
    (rules_map,) = by_kind("ConfigMap")
    secret_keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    containers = collector_containers()
    assert len(containers) == 2
    for container in containers:
        args = collector_parser().parse_args(container["args"])
        assert args.rules.parent == Path("/etc/gradwatch/rules")
        assert args.rules.name in rules_map["data"]
        settings = env_fields(container.get("env", []))
        unknown = set(settings) - set(CollectorConfig.model_fields)
        assert not unknown, f"GRADWATCH_* variables the collector ignores: {unknown}"
        CollectorConfig(**{k: v for k, v in settings.items() if v is not None})
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret_keys
            if env["name"].endswith("_FILE"):
                path = Path(env["value"])
                assert path.parent == Path("/run/secrets/gradwatch") and path.name in secret_keys
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_probes_hit_endpoints_a_live_collector_serves() -> None:
    probes = {
        (probe["httpGet"]["path"])
        for c in collector_containers()
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if kind in c
        for probe in [c[kind]]
    }
    assert probes == {"/readyz", "/healthz"}
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"),
        registry=CollectorRegistry(),
        sinks=[],
    )
    server.start()
    try:
        for path in sorted(probes):
            url = f"http://127.0.0.1:{server.metrics_port}{path}"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200, path
    finally:
        assert server.stop(10)


def test_rules_configmap_is_the_packaged_pack(tmp_path: Path) -> None:
    text = (K8S / "rules-configmap.yaml").read_text(encoding="utf-8")
    assert text == render_rules_configmap(), (
        "deploy/k8s/rules-configmap.yaml differs from rules/default.yaml; regenerate it: "
        "python tests/deploy/k8s_rules.py > deploy/k8s/rules-configmap.yaml"
    )
    (rules_map,) = by_kind("ConfigMap")
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(rules_map["data"]["rules.yaml"])
    assert load_rules(rule_file)


def test_the_outbox_is_on_a_persistent_volume_claim_of_this_manifest() -> None:
    (deployment,) = by_kind("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    data_dir = env_fields(container["env"])["data_dir"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data_dir]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    claims = {c["metadata"]["name"]: c for c in by_kind("PersistentVolumeClaim")}
    claim = claims[volume["persistentVolumeClaim"]["claimName"]]
    # One pod at a time may hold a ReadWriteOnce volume: Recreate, never a rolling update.
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert deployment["spec"]["replicas"] == 1


def test_prometheus_rule_is_alerts_yml_and_promtool_accepts_it(tmp_path: Path) -> None:
    text = (K8S / "prometheus-rules.yaml").read_text(encoding="utf-8")
    assert text == render_prometheus_rules(), (
        "deploy/k8s/prometheus-rules.yaml differs from deploy/prometheus/alerts.yml; "
        "regenerate it: python tests/deploy/k8s_alerts.py > deploy/k8s/prometheus-rules.yaml"
    )
    (rule,) = by_kind("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == load_yaml(DEPLOY / "prometheus/alerts.yml")["groups"]
    groups = tmp_path / "groups.yml"
    groups.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run(
        [require_binary("promtool"), "check", "rules", str(groups)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_sidecar_is_scraped_by_annotations_and_by_a_pod_monitor() -> None:
    (job,) = by_kind("Job")
    template = job["spec"]["template"]
    (sidecar,) = template["spec"]["initContainers"]
    (port,) = [p for p in sidecar["ports"] if p["name"] == "metrics"]
    metrics_addr = collector_parser().parse_args(sidecar["args"]).metrics_addr
    assert metrics_addr.rsplit(":", 1)[1] == str(port["containerPort"])
    # The usual kubernetes-pods scrape config reads these annotations.
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"
    # The Prometheus Operator ignores annotations: its PodMonitor selects the pod.
    (monitor,) = by_kind("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= template["metadata"]["labels"].items()
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
        assert not endpoint.get("honorLabels", False)
