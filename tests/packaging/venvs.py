"""Throwaway virtual environments holding the built wheel and exactly the dependencies asked for.

Nothing is downloaded for the base and collector checks: the wheel is installed
with ``--no-deps --no-index``, and the dependencies it should have (those of
pyproject.toml for the extras under test, followed through their own metadata)
are linked in from the environment running the tests, so the venv sees those
distributions and no other (no torch unless an extra brings it).

Example::

    venv = Venv.create(tmp_path / "venv", wheel)
    venv.link(distributions_of([], PYPROJECT))   # the base install: pyzmq
    print(venv.run("gradwatch", "--version").stdout)
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements_of(
    extras: Iterable[str], pyproject: dict[str, Any] = PYPROJECT
) -> list[Requirement]:
    """pyproject's base dependencies plus those of ``extras`` (self-references expanded)."""
    project = pyproject["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == canonicalize_name(project["name"]):
                todo += sorted(req.extras)
            else:
                found.append(req)
    return found


def distributions_of(extras: Iterable[str], pyproject: dict[str, Any] = PYPROJECT) -> set[str]:
    """Every distribution ``pip install 'gradwatch[extras]'`` brings, by installed metadata."""
    names: set[str] = set()
    todo = [(req, frozenset()) for req in requirements_of(extras, pyproject)]
    while todo:
        req, asked = todo.pop()
        if req.marker is not None and not any(
            req.marker.evaluate({"extra": extra}) for extra in (asked or {""})
        ):
            continue
        name = canonicalize_name(req.name)
        dist = distribution(name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in names:
            continue
        names.add(key)
        todo += [(Requirement(sub), frozenset(req.extras)) for sub in dist.requires or ()]
    return {key.partition("[")[0] for key in names}


@dataclass(frozen=True)
class Venv:
    """A venv at ``path``; ``run`` calls its console scripts with a clean environment."""

    path: Path

    @classmethod
    def create(cls, path: Path, *wheels: Path) -> Venv:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120
        )
        venv = cls(path)
        if wheels:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "--python",
                    str(venv.python),
                    "install",
                    "-q",
                    "--no-deps",
                    "--no-index",
                    *map(str, wheels),
                ],
                check=True,
                timeout=600,
                capture_output=True,
            )
        return venv

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        out = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return Path(out.stdout.strip())

    def link(self, names: Iterable[str]) -> None:
        """Make the test environment's installed ``names`` visible in the venv, nothing else."""
        shelf = self.path / "linked"
        shelf.mkdir(exist_ok=True)
        for name in names:
            try:
                dist = distribution(name)
            except PackageNotFoundError as exc:
                raise AssertionError(f"{name} is not installed where the tests run") from exc
            base = Path(str(dist.locate_file("")))
            tops = {Path(str(f)).parts[0] for f in dist.files or ()} - {"..", "bin"}
            for top in tops:
                if (base / top).exists() and not (shelf / top).exists():
                    (shelf / top).symlink_to(base / top)
        # A .pth line appends the folder after the venv's own site-packages: what the
        # venv installed itself (the wheel, an older transformers) comes first.
        (self.site_packages / "zz_linked.pth").write_text(f"{shelf}\n")

    def overlay(self) -> None:
        """Everything the test environment has, after what the venv installed itself."""
        (self.site_packages / "zz_overlay.pth").write_text(sysconfig.get_path("purelib") + "\n")

    def run(
        self,
        *args: str,
        cwd: Path | None = None,
        timeout: float = 300,
        stdin: int | None = subprocess.DEVNULL,
    ) -> subprocess.CompletedProcess[str]:
        exe = self.path / "bin" / args[0]
        env = {
            "PATH": f"{self.path / 'bin'}:/usr/bin:/bin",
            "HOME": str(self.path),
            "LANG": "C.UTF-8",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        return subprocess.run(
            [str(exe), *args[1:]],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd or self.path,
            timeout=timeout,
            stdin=stdin,
        )


def build_wheel(out: Path) -> Path:
    """Build the project's wheel into ``out`` (no build isolation: no download)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    (built,) = out.glob("gradwatch-*.whl")
    return built


__all__ = ["PYPROJECT", "ROOT", "Venv", "build_wheel", "distributions_of", "requirements_of"]
