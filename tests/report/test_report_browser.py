"""The report in a real browser: headless Chromium renders it to a screenshot that is not blank."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from gradwatch.report import write_report
from tests.binaries import require_binary
from tests.report.png import decode_png

WIDTH, HEIGHT = 1400, 2400
RED = (192, 57, 43)  # the non-finite / critical colour: only drawn if the SVG charts rendered
TIMEOUT_S = 90


def screenshot(
    chromium: str, page: Path, out: Path, profile: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={out}",
            f"--window-size={WIDTH},{HEIGHT}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def rendered(chromium: str, page: Path, work: Path) -> np.ndarray:
    """The screenshot's pixels as ``(pixels, 3)`` RGB, after checking the page is not blank."""
    shot = work / "report.png"
    done = screenshot(chromium, page, shot, work / "profile")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    pixels = decode_png(shot.read_bytes())
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    rgb = pixels[..., :3].reshape(-1, 3).astype(np.int64)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
    assert len(colours) > 500, f"only {len(colours)} colours: the page looks blank"
    background = np.all(rgb == rgb[0], axis=1).mean()  # the top-left pixel is page background
    assert background < 0.7, f"{background:.0%} of the screenshot is background"
    return rgb


def test_chromium_renders_the_report(recorded_trace: Path, tmp_path: Path) -> None:
    chromium = require_binary("chromium")
    rgb = rendered(chromium, write_report(recorded_trace, tmp_path / "report.html"), tmp_path)
    assert np.all(rgb == RED, axis=1).sum() > 1000, (
        "no alert/non-finite red: the charts did not render"
    )


def test_chromium_renders_the_binned_report_of_a_large_model(
    big_report: Path, tmp_path: Path
) -> None:
    chromium = require_binary("chromium")
    rgb = rendered(chromium, big_report, tmp_path)
    html = big_report.read_text(encoding="utf-8")
    cells = html[html.index('<g class="cells">') :]
    fills = {int(c, 16) for c in re.findall(r'fill="#([0-9a-f]{6})"', cells[: cells.index("</g>")])}
    drawn = np.isin(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2], list(fills)).sum()
    # About 700 x 420 px of heatmap: most of it must show the cells' own colours.
    assert drawn > 100_000, (
        f"{drawn} pixels in the heatmap cells' colours: the cells did not render"
    )
