"""The HF callback at the oldest versions the ``[hf]`` extra allows (its floors in pyproject.toml).

The dev environment has the newest transformers; users on 4.x must work too. This
builds a venv holding the built wheel and the floor releases of transformers and
accelerate (with the huggingface_hub and tokenizers they require), everything else
(torch, pytest, the collector's dependencies) seen from the test environment after
them, and runs tests/integrations/test_integration_transformers.py there unchanged.

It needs those wheels: pip fetches them from the configured indexes. Where none is
reachable the test skips and says so; point GRADWATCH_FLOOR_WHEELS at a folder
holding them to run it offline. Takes about two minutes (installing transformers).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.packaging.venvs import ROOT, Venv, requirements_of

pytestmark = pytest.mark.slow

# What transformers 4.57's own metadata requires of these two: the newer majors
# in the dev environment would not import with it.
COMPANIONS = ("huggingface_hub>=0.34,<1.0", "tokenizers>=0.22,<=0.23.0")


def floors() -> list[str]:
    """``NAME==FLOOR`` for each distribution of the hf extra, from its ``>=`` bound."""
    pins = []
    for req in requirements_of(["hf"]):
        if canonicalize_name(req.name) in ("transformers", "accelerate"):
            (floor,) = [s.version for s in req.specifier if s.operator == ">="]
            pins.append(f"{req.name}=={floor}")
    assert len(pins) == 2, f"the hf extra should floor transformers and accelerate: {pins}"
    return pins


def floor_wheels(out: Path) -> list[Path]:
    given = os.environ.get("GRADWATCH_FLOOR_WHEELS")
    if given:
        return sorted(Path(given).glob("*.whl"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(out),
            *floors(),
            *COMPANIONS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.skip(
            f"the floor wheels ({', '.join(floors())}) could not be fetched: "
            f"{result.stderr.strip().splitlines()[-1:]}; set GRADWATCH_FLOOR_WHEELS=DIR "
            "to a folder holding them"
        )
    return sorted(out.glob("*.whl"))


def test_the_transformers_callback_at_the_hf_floors(wheel: Path, tmp_path: Path) -> None:
    venv = Venv.create(tmp_path / "venv", wheel, *floor_wheels(tmp_path / "wheels"))
    venv.overlay()
    versions = venv.run(
        "python",
        "-c",
        "import transformers, accelerate; print(transformers.__version__, accelerate.__version__)",
    )
    assert versions.stdout.split() == [pin.split("==")[1] for pin in floors()], versions.stderr
    # The tests, outside the checkout: its gradwatch/ folder must not shadow the wheel.
    suite = tmp_path / "suite"
    for folder in ("integrations", "agent"):
        shutil.copytree(ROOT / "tests" / folder, suite / "tests" / folder)
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "tests")
    (suite / "pytest.ini").write_text(
        "[pytest]\npythonpath = .\naddopts = -p no:cacheprovider\nfilterwarnings =\n    error\n"
        "    ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning\n"
        "markers =\n    gpu: needs a CUDA device\n    slow: takes more than a few seconds\n"
    )
    result = venv.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-x",
        "tests/integrations/test_integration_transformers.py",
        cwd=suite,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
