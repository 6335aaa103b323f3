#!/usr/bin/env bash
# gradwatch's one entry point for a fresh machine: set-up first (idempotent),
# then the demo or the test suite.
#   bash run.sh demo   # agent + collector + rules + alert webhook, ends by itself
#   bash run.sh test   # static checks, then the whole test suite (what CI runs)
#   bash run.sh lint [paths...]   # ruff, ruff format --check, mypy, import contracts
set -euo pipefail
cd "$(dirname "$0")"
venv=${GRADWATCH_VENV:-.venv}

# System binaries the integration tests run for real (tests/binaries.py), each
# as "name|Debian alias", and the Debian packages that provide them.
system_binaries=(prometheus promtool "prometheus-alertmanager|alertmanager" amtool
                 "chromium|chromium-browser")
system_packages=(prometheus prometheus-alertmanager chromium)

have_binary() {
  local name
  for name in ${1//|/ }; do
    PATH="$PATH:/usr/sbin:/usr/bin" command -v "$name" >/dev/null 2>&1 && return 0
  done
  return 1
}

setup_system() {
  local missing=() binary
  for binary in "${system_binaries[@]}"; do
    have_binary "$binary" || missing+=("${binary%%|*}")
  done
  [ ${#missing[@]} -eq 0 ] && return
  local sudo=() can_install=1
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      can_install=
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || can_install=
  if [ -z "$can_install" ]; then
    echo "missing ${missing[*]} (the integration tests need them; they skip locally and" \
         "fail under CI=true): install the packages ${system_packages[*]} as root," \
         "e.g. apt-get install -y --no-install-recommends ${system_packages[*]}" >&2
    return
  fi
  echo "installing ${system_packages[*]} with apt-get (missing: ${missing[*]})..." >&2
  # The Debian packages start prometheus and alertmanager as services on their
  # default ports (9090, 9093) in postinst. The tests start their own instances
  # on free ports and a service would only hold ports and CPU, so while
  # installing, a policy-rc.d that answers 101 ("action forbidden") tells
  # invoke-rc.d / deb-systemd-invoke not to start anything. An existing
  # policy-rc.d (e.g. a container's) is left as it is.
  local policy=/usr/sbin/policy-rc.d added_policy=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | ${sudo[@]+"${sudo[@]}"} tee "$policy" >/dev/null &&
      ${sudo[@]+"${sudo[@]}"} chmod 755 "$policy" && added_policy=1
    # Never leave it behind, even if apt-get is interrupted.
    [ -n "$added_policy" ] && trap '${sudo[@]+"${sudo[@]}"} rm -f "$policy"' EXIT
  fi
  if ! { ${sudo[@]+"${sudo[@]}"} apt-get update -qq &&
         ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           --no-install-recommends "${system_packages[@]}" >/dev/null; }; then
    echo "apt-get could not install ${system_packages[*]}; install them by hand" \
         "(apt-get install -y ${system_packages[*]}) or the integration tests cannot run" >&2
  fi
  if [ -n "$added_policy" ]; then
    ${sudo[@]+"${sudo[@]}"} rm -f "$policy"
    trap - EXIT
  fi
}

setup() {
  setup_system
  # Re-install when pyproject changes; otherwise set-up costs nothing.
  if [ -x "$venv/bin/gradwatch" ] && [ "$venv/.installed" -nt pyproject.toml ]; then
    return
  fi
  echo "setting up $venv (first run, or pyproject.toml changed; a minute or two)..." >&2
  # The venv takes ~1.7 GB (torch's CPU build is most of it) and pip unpacks in
  # TMPDIR on the way; a CI run once died of a full disk with only pip's errno.
  local need_mb=2500 free_mb
  free_mb=$(free_mb_at "$(dirname "$venv")")
  if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
    echo "warning: ${free_mb} MB free where $venv goes, set-up needs about ${need_mb} MB;" \
         "free disk space or set GRADWATCH_VENV to a folder on a larger disk" >&2
  fi
  python3 -m venv "$venv"
  # torch==2.13.0 is the CPU build kept on this machine's disk; an open range
  # would download a multi-GB CUDA build. Only the agent side needs torch.
  if ! { "$venv/bin/pip" install -q torch==2.13.0 &&
         "$venv/bin/pip" install -q -e '.[dev]'; }; then
    echo "set-up failed: pip could not install into $venv ($(free_mb_at "$(dirname "$venv")")" \
         "MB free there, $(free_mb_at "${TMPDIR:-/tmp}") MB in ${TMPDIR:-/tmp}). If pip said" \
         "'No space left on device', free ~${need_mb} MB or point GRADWATCH_VENV and TMPDIR" \
         "at a larger disk; otherwise read pip's message above. Then run this again." >&2
    exit 1
  fi
  touch "$venv/.installed"
}

# Megabytes free on the filesystem holding $1 (empty when df cannot tell).
free_mb_at() {
  df -Pm "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'
}

# CI runs the static checks before the tests, in the same environment (issue 18).
# GRADWATCH_LINT=0 skips them (a local run of a few tests); CI leaves it unset.
lint_in_test=${GRADWATCH_LINT:-1}

# mypy checks the package by import name: gradwatch/ holds a directory symlink per
# subpackage folder (docs/layout.md), so wire/x.py is the module gradwatch.wire.x.
# Prints "-p NAME" / "-m NAME" pairs for the paths given; other paths are skipped.
mypy_targets() {
  local path top module skipped=()
  for path in "$@"; do
    path=${path#./}; path=${path%/}
    top=${path%%/*}
    if [ "$top" = gradwatch ]; then
      module=$path
    elif [ -L "gradwatch/$top" ]; then
      module=gradwatch/$path
    else
      skipped+=("$path")
      continue
    fi
    module=${module%.py}; module=${module%/__init__}; module=${module//\//.}
    if [ -d "$path" ]; then echo "-p $module"; else echo "-m $module"; fi
  done
  [ ${#skipped[@]} -eq 0 ] ||
    echo "mypy checks the gradwatch package only; not: ${skipped[*]}" >&2
}

# mypy on the gradwatch modules among the given paths. mypy also reports the modules
# they import (other people's); only the errors in the given paths count here.
mypy_paths() {
  local targets=() prefixes=() target report own
  # shellcheck disable=SC2207 # each line is "-p NAME" or "-m NAME", no spaces in names
  targets=($(mypy_targets "$@"))
  [ ${#targets[@]} -eq 0 ] && return 0
  for target in "${targets[@]}"; do
    case "$target" in -p|-m) ;; *) prefixes+=("${target//.//}") ;; esac
  done
  echo "== mypy ${targets[*]} (errors in these paths only)" >&2
  report=$("$venv/bin/mypy" "${targets[@]}" 2>&1) || true
  own=$(printf '%s\n' "$report" |
        grep -E "^($(IFS='|'; echo "${prefixes[*]}"))(/|\.py:)" || true)
  if [ -n "$own" ]; then
    printf '%s\n' "$own"
    echo "mypy: $(printf '%s\n' "$own" | grep -c ': error:') errors in the given paths" >&2
    return 1
  fi
  if ! printf '%s\n' "$report" | grep -qE '^(Success|Found [0-9]+ errors?)'; then
    printf '%s\n' "$report"
    return 1
  fi
  echo "mypy: no errors in the given paths" >&2
}

# Static checks over the whole tree, or over the given files and folders (what a
# contributor runs on their own change). Every check runs; any failure fails.
lint() {
  local failed=() bin=$venv/bin paths=("$@")
  [ $# -eq 0 ] && paths=(.)
  echo "== ruff check ${paths[*]}" >&2
  "$bin/ruff" check "${paths[@]}" || failed+=("ruff check")
  echo "== ruff format --check ${paths[*]}" >&2
  "$bin/ruff" format --check "${paths[@]}" ||
    failed+=("ruff format (run: $bin/ruff format ${paths[*]})")
  if [ $# -eq 0 ]; then
    echo "== mypy -p gradwatch" >&2
    "$bin/mypy" -p gradwatch || failed+=("mypy")
  else
    mypy_paths "$@" || failed+=("mypy")
  fi
  echo "== lint-imports" >&2
  "$bin/lint-imports" --no-cache || failed+=("import contracts (lint-imports)")
  if [ ${#failed[@]} -gt 0 ]; then
    echo "static checks failed: ${failed[*]}. Fix what they report; every # noqa or" \
         "# type: ignore names its code and says why" >&2
    return 1
  fi
}

# The tests run even when the static checks fail, so one CI run reports both.
test_suite() {
  local lint_failed=
  if [ "$lint_in_test" = 1 ]; then
    lint || lint_failed=1
  else
    echo "static checks skipped (GRADWATCH_LINT=$lint_in_test; bash run.sh lint runs them)" >&2
  fi
  "$venv/bin/python" -m pytest -q "$@" || return
  if [ -n "$lint_failed" ]; then
    echo "the tests passed but the static checks failed (see above)" >&2
    return 1
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo) setup; exec "$venv/bin/gradwatch" demo "$@" ;;
  test) setup; test_suite "$@" ;;
  # An existing environment is used as it is: contributors lint while others share it.
  lint) [ -x "$venv/bin/ruff" ] && [ -x "$venv/bin/mypy" ] || setup; lint "$@" ;;
  setup) setup ;;
  *) echo "usage: bash run.sh demo|test|lint|setup [args...]" >&2; exit 2 ;;
esac
