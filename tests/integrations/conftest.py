"""Fixtures for the framework callbacks: a recording collector, and no network."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.recording import RecordingCollector

# Nothing here may reach the network: tiny models are built from code. Set before
# the test modules import transformers (conftest is imported first).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[RecordingCollector]:
    rc = RecordingCollector(tmp_path / "trace")
    try:
        yield rc
    finally:
        rc.server.stop(timeout=5.0)
