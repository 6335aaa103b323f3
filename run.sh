#!/usr/bin/env bash
# gradwatch's one entry point for a fresh machine: set-up first (idempotent),
# then the demo or the test suite.
#   bash run.sh demo   # agent + collector + rules + alert webhook, ends by itself
#   bash run.sh test   # the whole test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")"
venv=${GRADWATCH_VENV:-.venv}

setup() {
  # Re-install when pyproject changes; otherwise set-up costs nothing.
  if [ -x "$venv/bin/gradwatch" ] && [ "$venv/.installed" -nt pyproject.toml ]; then
    return
  fi
  echo "setting up $venv (first run only; takes a minute or two)..." >&2
  python3 -m venv "$venv"
  # torch==2.13.0 is the CPU build kept on this machine's disk; an open range
  # would download a multi-GB CUDA build. Only the agent side needs torch.
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q -e '.[dev]'
  touch "$venv/.installed"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo) setup; exec "$venv/bin/gradwatch" demo "$@" ;;
  test) setup; exec "$venv/bin/python" -m pytest -q "$@" ;;
  setup) setup ;;
  *) echo "usage: bash run.sh demo|test|setup [args...]" >&2; exit 2 ;;
esac
