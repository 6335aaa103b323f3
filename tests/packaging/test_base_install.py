"""``pip install gradwatch`` and ``pip install 'gradwatch[collector]'``, run as a user would.

The built wheel goes into a fresh venv with the base dependencies only (pyzmq):
every subcommand's ``--help`` and one real action either works or exits 2 with
one line naming the extra to install; never a traceback. Then the collector
extra's dependencies are added and each command does its real job from the
installed wheel (packaged rules and dashboard included).
"""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from gradwatch.cli import COMMAND_EXTRAS, COMMANDS, EXTRA_MODULES, install_hint
from tests.packaging.venvs import Venv, distributions_of, requirements_of

pytestmark = pytest.mark.slow

HINT = re.compile(
    r"^gradwatch [\w-]+: needs the ([\w, ]+) extras?\s\(.+ not installed\): "
    r"pip install 'gradwatch\[([\w,]+)\]'\n$"
)

# One real action per command: what a first-hour user would type.
ACTIONS: dict[str, list[str]] = {
    "collector": ["collector", "--listen", "not-an-endpoint"],
    "rules": ["rules", "check", "RULES"],
    "replay": ["replay", "TRACE", "--json"],
    "report": ["report", "TRACE", "-o", "report.html"],
    "grafana": ["grafana", "push", "--url", "http://127.0.0.1:9", "--token-file", "TOKEN"],
    "restart-hook": ["restart-hook", "--config", "missing.yaml", "--", "true"],
    "keys": ["keys", "generate", "--name", "collector", "--dir", "keys"],
    "demo": ["demo", "--out", "demo", "--full-steps", "1"],
    "version": ["version"],
}


def test_every_command_has_a_real_action() -> None:
    assert set(ACTIONS) == set(COMMANDS)


def test_the_extra_table_matches_pyproject() -> None:
    """cli.EXTRA_MODULES lists, per extra, one module of each distribution pyproject puts in it."""
    owners = packages_distributions()  # module -> distributions, in the test environment
    for extra, modules in EXTRA_MODULES.items():
        wanted = {canonicalize_name(r.name) for r in requirements_of([extra])} - {"pyzmq"}
        found = {canonicalize_name(d) for m in modules for d in owners.get(m, [])}
        assert found == wanted, f"[{extra}]: pyproject has {sorted(wanted)}, cli.py {sorted(found)}"
    for needed in COMMAND_EXTRAS.values():
        assert set(needed) <= set(EXTRA_MODULES)


def _inputs(where: Path) -> dict[str, str]:
    trace = where / "t.jsonl"
    lines = ['{"type":"header","version":1,"job":"j","layers":[]}']
    lines += [
        json.dumps(
            {
                "type": "step",
                "step": s,
                "rank": 0,
                "time": float(s),
                "loss": 1.0 if s < 10 else "nan",
            }
        )
        for s in range(1, 21)
    ]
    trace.write_text("\n".join(lines) + "\n")
    token = where / "token"
    token.write_text("not-a-real-token\n")
    return {"TRACE": str(trace), "TOKEN": str(token)}


def _argv(command: str, inputs: dict[str, str]) -> list[str]:
    return [inputs.get(arg, arg) for arg in ACTIONS[command]]


def _check_no_traceback(result: subprocess.CompletedProcess[str], what: str) -> None:
    assert "Traceback" not in result.stderr, f"{what}: {result.stderr}"


@pytest.fixture(scope="module")
def base(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = Venv.create(tmp_path_factory.mktemp("base") / "venv", wheel)
    venv.link(distributions_of([]))
    return venv


def test_base_install_every_command_works_or_names_its_extra(
    base: Venv, wheel: Path, tmp_path: Path
) -> None:
    inputs = _inputs(tmp_path)
    assert base.run("gradwatch", "--help").returncode == 0
    for command in COMMANDS:
        for argv in ([command, "--help"], _argv(command, {**inputs, "RULES": "rules.yaml"})):
            result = base.run("gradwatch", *argv, cwd=tmp_path)
            _check_no_traceback(result, " ".join(argv))
            if command in COMMAND_EXTRAS:
                match = HINT.match(result.stderr)
                assert result.returncode == 2 and match, f"{argv}: {result.stderr!r}"
                assert install_hint(COMMAND_EXTRAS[command]) in result.stderr
            else:
                assert result.returncode == 0, f"{argv}: {result.stderr}"
    version = base.run("gradwatch", "--version")
    assert version.stdout == f"gradwatch {wheel.name.split('-')[1]}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl", "token"]  # nothing written


@pytest.fixture(scope="module")
def collector(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = Venv.create(tmp_path_factory.mktemp("collector") / "venv", wheel)
    venv.link(distributions_of(["collector"]))
    return venv


def test_collector_install_runs_each_command_from_the_wheel(
    collector: Venv, wheel: Path, tmp_path: Path
) -> None:
    site = collector.site_packages
    rules = site / "gradwatch/rules/default.yaml"
    dashboard = site / "gradwatch/collector/dashboards/gradwatch.json"
    assert rules.is_file() and dashboard.is_file()
    assert "gradwatch/collector/dashboards/gradwatch.json" in zipfile.ZipFile(wheel).namelist()
    inputs = {**_inputs(tmp_path), "RULES": str(rules)}
    results = {c: collector.run("gradwatch", *_argv(c, inputs), cwd=tmp_path) for c in COMMANDS}
    for command, result in results.items():
        _check_no_traceback(result, command)
    assert results["rules"].returncode == 0 and "rule(s) OK" in results["rules"].stdout
    assert results["replay"].returncode == 0
    assert (
        json.loads(results["replay"].stdout.splitlines()[0])["alert"]["rule"]
        == "NonFiniteGradients"
    )
    assert results["report"].returncode == 0 and (tmp_path / "report.html").stat().st_size > 1000
    assert results["keys"].returncode == 0 and (tmp_path / "keys").is_dir()
    assert results["collector"].returncode == 2 and "listen" in results["collector"].stderr
    assert results["restart-hook"].returncode == 2
    # The default dashboard is the installed one: it was read, then Grafana was unreachable.
    assert results["grafana"].returncode == 1, results["grafana"].stderr
    assert "cannot reach Grafana" in results["grafana"].stderr
    # torch is not in the collector extra: the demo names the agent extra.
    assert results["demo"].returncode == 2
    assert results["demo"].stderr.endswith(f"{install_hint(['agent'])}\n")
    help_text = collector.run("gradwatch", "collector", "--help").stdout
    assert "GRADWATCH_MAX_MEMORY_BYTES" in help_text and "GRADWATCH_LOG_FORMAT" in help_text
