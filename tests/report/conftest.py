"""Traces shared by the report tests: a real recording, a large synthetic trace and its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.report.synthetic import write_synthetic_trace

BIG_LAYERS, BIG_STEPS = 1000, 2000  # the case: 32 MB and 240k SVG rects before binning


@pytest.fixture(scope="session")
def recorded_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from tests.report.recorded import record_trace

    return record_trace(tmp_path_factory.mktemp("recorded"))


@pytest.fixture(scope="session")
def big_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of a 1,000-layer x 2,000-step synthetic trace with an lr fault (~10 s, once)."""
    from gradwatch.report import write_report

    folder = tmp_path_factory.mktemp("big")
    trace = write_synthetic_trace(folder / "big.jsonl", layers=BIG_LAYERS, steps=BIG_STEPS)
    return write_report(trace, folder / "big.html")
