"""Render deploy/k8s/rules-configmap.yaml from the packaged default rule pack.

``python tests/deploy/k8s_rules.py > deploy/k8s/rules-configmap.yaml`` after
changing rules/default.yaml; tests/deploy fails while the two differ.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = """\
# The collector's rule file as a ConfigMap: a copy of the packaged default pack
# (rules/default.yaml), mounted at /etc/gradwatch/rules and read with --rules.
# Edit the copy here to tune thresholds for your cluster. Generated; after
# changing rules/default.yaml run:
#   python tests/deploy/k8s_rules.py > deploy/k8s/rules-configmap.yaml
apiVersion: v1
kind: ConfigMap
metadata:
  name: gradwatch-rules
  labels:
    app.kubernetes.io/name: gradwatch
    app.kubernetes.io/component: collector
data:
  rules.yaml: |
"""


def render() -> str:
    pack = (ROOT / "rules/default.yaml").read_text(encoding="utf-8")
    body = "".join(f"    {line}" if line.strip() else "\n" for line in pack.splitlines(True))
    return HEADER + body


if __name__ == "__main__":
    print(render(), end="")
