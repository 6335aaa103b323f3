"""Calibration on real curves: the 51 labelled Hugging Face logs beside the repository.

``../shared/data/hf-trainer-logs`` (CI runs with ``shared/`` beside the clone)
holds what the Trainer callback would have sent live. Goals (issue 13): no
warning or critical alert on a healthy run, a fitting alert on at least 5 of
the 6 broken ones. ``benchmarks/hf_corpus.py`` prints the per-run detail.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest

from tests.rules.benchmark_module import CORPUS, load

_MISSING = f"the HF log corpus is not at {CORPUS} (shared/ beside the clone)"
# Locally a clone without shared/ beside it skips; CI always has it and must not skip.
pytestmark = pytest.mark.skipif(
    not (CORPUS / "runs.csv").exists() and os.environ.get("CI", "").lower() != "true",
    reason=_MISSING,
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load("hf_corpus")


@pytest.fixture(scope="module")
def results(bench: ModuleType) -> list[Any]:
    return bench.evaluate(CORPUS)


def test_the_corpus_is_the_one_the_readme_describes(results: list[Any]) -> None:
    labels = [r.label for r in results]
    assert (len(results), labels.count("healthy"), labels.count("broken")) == (51, 39, 6)


def test_no_false_page_on_a_healthy_run(results: list[Any]) -> None:
    pages = [
        (r.file, a.rule, a.step, a.summary)
        for r in results
        if r.label == "healthy"
        for a in r.pages
    ]
    assert pages == []


def test_broken_runs_get_a_fitting_alert(bench: ModuleType, results: list[Any]) -> None:
    summary = bench.summarize(results)
    missed = [
        (r.file, r.why, [(a.rule, a.category) for a in r.alerts])
        for r in results
        if r.label == "broken" and not r.fitting
    ]
    assert summary.detected >= 5, missed


def test_unlogged_steps_change_nothing(bench: ModuleType) -> None:
    # The live callback sends every step, the loss only every `logging_steps`: a rule's `for:`
    # counts observations of its signal, so the unlogged steps must not change any alert.
    # Runs of up to 3,000 steps keep this test fast; the benchmark's --gaps runs them all.
    from gradwatch.rules.imports import read_history
    from gradwatch.rules.replay import backtest

    checked = 0
    for path in sorted((CORPUS / "runs").iterdir()):
        run = read_history(path)
        last = max((r.step for r in run.records), default=0)
        if last > 3_000 or run.steps == last:
            continue  # too long for a unit test, or logged every step (no gaps to add)
        plain = [(t.alert.rule, t.alert.step, t.current) for t in backtest(path)[1]]
        gapped = [(t.alert.rule, t.alert.step, t.current) for t in backtest(path, gaps=True)[1]]
        assert gapped == plain, path.name
        checked += 1
    assert checked >= 20  # 21 of the 51
