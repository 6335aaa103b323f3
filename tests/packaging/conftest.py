"""One wheel per test session, built from the work tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.packaging.venvs import build_wheel


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))
