"""A 1,000-layer x 2,000-step trace gives a small page: binned heatmap, lr panel showing the fault.

Before binning this trace gave a 32 MB page with 240k SVG rects (issue 16).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from gradwatch.report.binning import MAX_CELLS
from tests.report.conftest import BIG_LAYERS, BIG_STEPS
from tests.report.synthetic import LR_FAULT_FACTOR, SPIKE, layer_names, spikes
from tests.report.test_report_html import parse

MAX_BYTES = 2_000_000


class Cells(HTMLParser):
    """The hover text of every heatmap cell (each ``rect`` inside ``<g class="cells">``)."""

    def __init__(self) -> None:
        super().__init__()
        self.titles: list[str] = []
        self.rects = 0
        self._depth = 0  # > 0 inside the cells group
        self._title: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "g" and ("class", "cells") in attrs:
            self._depth = 1
        elif tag == "g" and self._depth:
            self._depth += 1
        elif tag == "rect" and self._depth:
            self.rects += 1
        elif tag == "title" and self._depth:
            self._title = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "g" and self._depth:
            self._depth -= 1
        elif tag == "title" and self._title is not None:
            self.titles.append(self._title)
            self._title = None

    def handle_data(self, data: str) -> None:
        if self._title is not None:
            self._title += data


def test_the_page_stays_small_and_the_heatmap_binned(big_report: Path) -> None:
    size = big_report.stat().st_size
    assert size < MAX_BYTES, f"{size:,} bytes for {BIG_LAYERS} layers x {BIG_STEPS} steps"
    html = big_report.read_text(encoding="utf-8")
    cells = Cells()
    cells.feed(html)
    assert 0 < cells.rects <= MAX_CELLS and len(cells.titles) == cells.rects
    assert html.count("<rect") < MAX_CELLS + 100  # frames, colour bar and badges besides the cells
    note = parse(html).sections["layers"]
    assert "largest gradient norm among up to 25 consecutive tensor(s) × 20 step(s)" in note


def test_a_one_step_spike_in_one_layer_shows_in_its_cell(big_report: Path) -> None:
    cells = Cells()
    cells.feed(big_report.read_text(encoding="utf-8"))
    names = layer_names(BIG_LAYERS)
    for layer, step in spikes(BIG_LAYERS, BIG_STEPS):
        hits = [t for t in cells.titles if _covers(t, names, layer, step)]
        assert len(hits) == 1, (layer, step, hits[:3])
        high, low = (float(v) for v in re.findall(r"(?:max|min) ([0-9.e+-]+)", hits[0]))
        assert high / low > SPIKE / 10, hits[0]  # the spike is the cell's max, not averaged away


def test_the_lr_panel_shows_the_scheduler_fault(big_report: Path) -> None:
    page = parse(big_report.read_text(encoding="utf-8"))
    lr = page.sections["lr"]
    fault = int(0.6 * BIG_STEPS)  # write_synthetic_trace's default fault step
    rise = re.search(r"Largest step-to-step rise: ×([0-9.]+) at step (\d+)", lr)
    assert rise is not None, lr
    assert float(rise.group(1)) > LR_FAULT_FACTOR / 2 and int(rise.group(2)) == fault
    assert "At the first alert (LossRising" in lr
    assert "learning rate too high" in page.sections["summary"]


def _covers(title: str, names: tuple[str, ...], layer: int, step: int) -> bool:
    found = re.match(r"(\S+)(?: … (\S+) \(\d+ layers\))?, steps (\d+)–(\d+):", title)
    assert found is not None, title
    first = names.index(found.group(1))
    last = names.index(found.group(2)) if found.group(2) else first
    return first <= layer <= last and int(found.group(3)) <= step <= int(found.group(4))
