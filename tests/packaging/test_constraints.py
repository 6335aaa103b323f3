"""constraints.txt pins the collector image's whole dependency tree, inside pyproject's ranges."""

from __future__ import annotations

import re
from importlib.metadata import version

from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.packaging.venvs import ROOT, distributions_of, requirements_of

CONSTRAINTS = ROOT / "constraints.txt"


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for number, line in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        text = line.partition("#")[0].strip()
        if not text:
            continue
        req = Requirement(text)
        spec = str(req.specifier)
        assert spec.startswith("==") and "," not in spec, (
            f"constraints.txt:{number}: {text!r} is not an exact pin (NAME==VERSION)"
        )
        found[canonicalize_name(req.name)] = spec[2:]
    return found


def test_every_dependency_of_the_collector_extra_is_pinned() -> None:
    wanted = distributions_of(["collector"])
    missing = sorted(wanted - set(pins()))
    lines = "\n".join(f"{name}=={version(name)}" for name in missing)
    assert not missing, f"constraints.txt lacks {missing}; the tested versions are:\n{lines}"


def test_each_pin_is_inside_pyprojects_range() -> None:
    pinned = pins()
    for req in requirements_of(["collector"]):
        name = canonicalize_name(req.name)
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside pyproject's {req}"
        )


def test_the_image_installs_with_the_constraints_and_a_pinned_base() -> None:
    parser = DockerfileParser(str(ROOT / "Dockerfile"))
    runs = " ".join(i["value"] for i in parser.structure if i["instruction"] == "RUN")
    assert re.search(r'pip install [^&]*-c constraints\.txt [^&]*"\.\[collector\]"', runs)
    copied = {
        word
        for i in parser.structure
        if i["instruction"] == "COPY"
        for word in i["value"].split()[:-1]
    }
    assert "constraints.txt" in copied
    (base,) = [i["value"] for i in parser.structure if i["instruction"] == "FROM"]
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", base), (
        f"FROM {base}: pin the base image by digest (TAG@sha256:...)"
    )
