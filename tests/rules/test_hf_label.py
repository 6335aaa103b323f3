"""The held-out labeler (benchmarks/hf_label.py) reproduces the shared corpus's labels.

The held-out sample (benchmarks/hf_heldout_sources.csv) is labelled by this
code before any monitor replays it, so it must label the 51 logs beside the
repository exactly as their runs.csv does. Reads the corpus as
test_hf_corpus.py does: skipped locally without it, never in CI.
"""

from __future__ import annotations

import csv
import os
from typing import Any

import pytest

from tests.rules.benchmark_module import CORPUS, ROOT, load

pytestmark = pytest.mark.skipif(
    not (CORPUS / "runs.csv").exists() and os.environ.get("CI", "").lower() != "true",
    reason=f"the HF log corpus is not at {CORPUS} (shared/ beside the clone)",
)


@pytest.fixture(scope="module")
def checked() -> list[tuple[str, str, Any]]:
    return list(load("hf_label").check(CORPUS))


def test_every_shared_label_is_reproduced(checked: list[tuple[str, str, Any]]) -> None:
    disagree = [(f, want, got) for f, want, got in checked if got.label != want]
    assert disagree == []


def test_broken_codes_match_the_corpus_reasons(checked: list[tuple[str, str, Any]]) -> None:
    # Not only the label: each broken run is broken for the same README rule(s).
    with (CORPUS / "runs.csv").open(encoding="utf-8") as f:
        why = {r["file"]: r["why"] for r in csv.DictReader(f)}
    codes = ("B1", "B2", "B3", "B4", "B5", "B6", "U1", "U2", "U3", "U4", "U5")
    wrong = [
        (file, why[file], got.why)
        for file, _, got in checked
        if [c for c in codes if c in why[file]] != [c for c in codes if c in got.why]
    ]
    assert wrong == []


def test_the_sources_list_never_repeats_a_shared_repository() -> None:
    # A held-out log from a repository already in the corpus would not be held out.
    with (CORPUS / "runs.csv").open(encoding="utf-8") as f:
        shared = {r["repo"] for r in csv.DictReader(f)}
    with (ROOT / "benchmarks" / "hf_heldout_sources.csv").open(encoding="utf-8") as f:
        held = [r["repo"] for r in csv.DictReader(f)]
    assert len(held) == len(set(held)) and not shared & set(held)
