"""The development layout: every module under a mapped folder is a ``gradwatch.*`` module.

pyproject's ``[tool.setuptools.package-dir]`` maps top-level folders to subpackages
(``wire/`` is ``gradwatch.wire``) for the wheel. In the checkout, ``gradwatch/`` holds
one relative directory symlink per mapped folder (``gradwatch/wire -> ../wire``), so the
checkout itself is a complete ``gradwatch`` tree that Python, mypy, editors and
import-linter follow with no import hook (docs/layout.md). These tests fail when the two
disagree, so a new file or folder cannot silently go missing from either.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]
SUBPACKAGES = {name: folder for name, folder in PACKAGE_DIR.items() if name != "gradwatch"}


def _modules_on_disk() -> dict[str, Path]:
    """Every module the wheel ships, by import name, from the real folders."""
    found: dict[str, Path] = {}
    for name, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        # The root package's own folder holds the symlinks: its subfolders are counted
        # under their own mapping, so only its top-level files belong to it here.
        files = base.glob("*.py") if name == "gradwatch" else base.rglob("*.py")
        for path in files:
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


MODULES = _modules_on_disk()


def test_every_subpackage_folder_has_its_link_in_gradwatch() -> None:
    for name, folder in SUBPACKAGES.items():
        link = ROOT / "gradwatch" / name.removeprefix("gradwatch.")
        assert link.is_symlink(), (
            f"{link.relative_to(ROOT)} is missing: pyproject maps {name} to {folder}/, so "
            f"create it with `ln -s ../{folder} {link.relative_to(ROOT)}` and commit it"
        )
        # Relative, so a clone, a copy or a Docker build context resolves it too.
        assert os.readlink(link) == f"../{folder}", (
            f"{link.relative_to(ROOT)} points to {os.readlink(link)!r}; "
            f"it must be the relative link ../{folder}"
        )


def test_every_link_in_gradwatch_is_mapped() -> None:
    mapped = {name.removeprefix("gradwatch.") for name in SUBPACKAGES}
    links = {p.name for p in (ROOT / "gradwatch").iterdir() if p.is_symlink()}
    assert links <= mapped, (
        f"gradwatch/ links {sorted(links - mapped)} that pyproject's [tool.setuptools.package-dir]"
        " does not map: the wheel would miss them. Map them there (and list them in packages)."
    )


def test_the_root_package_folder_has_no_real_subpackage() -> None:
    # A real folder inside gradwatch/ would ship only if listed in packages, unlike its siblings.
    real = [p.name for p in (ROOT / "gradwatch").iterdir() if p.is_dir() and not p.is_symlink()]
    real = [n for n in real if n != "__pycache__"]
    assert not real, f"gradwatch/{real} are folders: put subpackages at the top level and link them"


_RESOLVE = """
import importlib.util, json, os, sys
out = {}
for name in json.loads(sys.argv[1]):
    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:  # the report lists it; the test names the module
        out[name] = f"error: {exc!r}"
        continue
    out[name] = os.path.realpath(spec.origin) if spec and spec.origin else None
print(json.dumps(out))
"""


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_every_module_resolves_as_gradwatch_from_the_development_install(
    where: str, tmp_path: Path
) -> None:
    """From the repo root (the symlink tree) and from any other folder (the editable install)."""
    cwd = ROOT if where == "checkout" else tmp_path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(sorted(MODULES))],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    wrong = {
        name: resolved[name]
        for name, path in MODULES.items()
        if resolved[name] != os.path.realpath(path)
    }
    assert not wrong, (
        f"from {cwd}, these modules do not resolve to their files in the checkout: {wrong}. "
        "Re-run `bash run.sh setup` if the editable install is stale; check the gradwatch/ links."
    )


@pytest.mark.slow
def test_mypy_finds_every_gradwatch_module(tmp_path: Path) -> None:
    """`mypy -p gradwatch` resolves the whole package from the checkout, nothing left out.

    Imports outside the package are skipped (their types are the lint step's business);
    a module mypy could not find would be missing from the count or reported as not found.
    """
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=skip",
            "--cache-dir",
            str(tmp_path),
            "--no-error-summary",
            "-p",
            "gradwatch",
            "--verbose",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    unresolved = re.findall(
        r".*(?:Can't find package|Cannot find implementation).*gradwatch.*",
        done.stdout + done.stderr,
    )
    assert not unresolved, unresolved
    checked = set(re.findall(r"Parsing \S+ \((gradwatch(?:\.\w+)*)\)", done.stderr))
    missing = sorted(set(MODULES) - checked)
    assert not missing, f"mypy -p gradwatch did not find {missing}:\n{done.stderr[-2000:]}"


@pytest.mark.slow
def test_mypy_strict_wire_passes(tmp_path: Path) -> None:
    """The bottom layer type-checks under its strict settings (pyproject [tool.mypy])."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=skip",
            "--cache-dir",
            str(tmp_path),
            "-p",
            "gradwatch.wire",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
