"""Render deploy/k8s/prometheus-rules.yaml from deploy/prometheus/alerts.yml.

The Prometheus Operator loads alerting rules from PrometheusRule objects, not
files: this wraps the groups of alerts.yml (comments and all, so the reasons
travel) in one. ``python tests/deploy/k8s_alerts.py > deploy/k8s/prometheus-rules.yaml``
after changing alerts.yml; tests/deploy fails while the two differ.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = """\
# gradwatch's self-monitoring alerts (deploy/prometheus/alerts.yml) for the
# Prometheus Operator. They find the collector by its gradwatch_build_info, so
# they hold whatever job name the ServiceMonitor gives it. Label the object as
# your Prometheus' ruleSelector expects (kube-prometheus-stack: release=<name>).
# Generated; after changing deploy/prometheus/alerts.yml run:
#   python tests/deploy/k8s_alerts.py > deploy/k8s/prometheus-rules.yaml
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: gradwatch
  labels:
    app.kubernetes.io/name: gradwatch
    app.kubernetes.io/component: collector
    release: prometheus   # match your Prometheus' ruleSelector
spec:
"""


def render() -> str:
    text = (ROOT / "deploy/prometheus/alerts.yml").read_text(encoding="utf-8")
    start = text.index("\ngroups:\n") + 1  # the file's own header comment stays behind
    body = "".join(f"  {line}" if line.strip() else "\n" for line in text[start:].splitlines(True))
    return HEADER + body


if __name__ == "__main__":
    print(render(), end="")
