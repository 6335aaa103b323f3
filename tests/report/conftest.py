"""One real recorded trace, shared by the report tests (recording it takes a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def recorded_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from tests.report.recorded import record_trace

    return record_trace(tmp_path_factory.mktemp("recorded"))
