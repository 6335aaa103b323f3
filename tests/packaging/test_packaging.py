"""Packaging: every folder ships, and imports only flow one way."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every folder holding an __init__.py, named by the import name it must map to."""
    found = {}
    for top_name, top_dir in SETUPTOOLS["package-dir"].items():
        if "." in top_name:
            continue
        found[top_name] = ROOT / top_dir
    for name, folder in SETUPTOOLS["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            dotted = ".".join((name, *rel.parts)) if rel.parts else name
            found[dotted] = init.parent
    return found


def test_every_package_folder_is_listed() -> None:
    listed = set(SETUPTOOLS["packages"])
    missing = sorted(set(_package_folders()) - listed)
    assert not missing, (
        f"{missing} have an __init__.py but are not in [tool.setuptools] packages in "
        "pyproject.toml: the wheel would silently miss them. Add them there (and to "
        "package-dir if the folder is at the top level)."
    )


def test_every_top_level_folder_with_python_is_mapped() -> None:
    mapped = {Path(d).parts[0] for d in SETUPTOOLS["package-dir"].values()}
    unmapped = sorted(
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in mapped
    )
    assert not unmapped, f"folders {unmapped} hold a package but pyproject maps none of them"


def test_wheel_contains_every_module_and_the_default_rules(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for dotted, folder in _package_folders().items():
        for module in folder.glob("*.py"):
            arcname = "/".join(dotted.split(".")) + "/" + module.name
            assert arcname in names, f"{arcname} is missing from the wheel"
    assert "gradwatch/rules/default.yaml" in names


def test_import_direction_contracts_hold(wheel: Path, tmp_path: Path) -> None:
    """wire <- agent; wire <- rules <- collector (import-linter contracts in pyproject).

    Run over the unpacked wheel: the source tree maps folders to subpackages, so
    only the installed layout is one `gradwatch` directory grimp can walk.
    """
    zipfile.ZipFile(wheel).extractall(tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), str(ROOT / "pyproject.toml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "KEPT" in result.stdout


def _imported_modules(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    return set(out.stdout.split())


def test_collector_and_rules_never_import_torch() -> None:
    modules = _imported_modules(
        "import gradwatch, gradwatch.wire, gradwatch.rules, gradwatch.collector, "
        "gradwatch.collector.server, gradwatch.collector.cli"
    )
    assert "torch" not in modules
    assert not any(m.startswith("gradwatch.agent") for m in modules)


def test_wire_is_stdlib_only() -> None:
    modules = _imported_modules("import gradwatch.wire")
    third_party = {m.split(".")[0] for m in modules} & {"numpy", "torch", "zmq", "pydantic", "yaml"}
    assert not third_party
