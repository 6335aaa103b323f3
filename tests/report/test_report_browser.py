"""The report in a real browser: headless Chromium renders it to a screenshot that is not blank."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from gradwatch.report import write_report
from tests.binaries import require_binary
from tests.report.png import decode_png

WIDTH, HEIGHT = 1400, 2400
RED = (192, 57, 43)  # the non-finite / critical colour: only drawn if the SVG charts rendered
TIMEOUT_S = 90


def screenshot(chromium: str, page: Path, out: Path, profile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={out}",
         f"--window-size={WIDTH},{HEIGHT}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def test_chromium_renders_the_report(recorded_trace: Path, tmp_path: Path) -> None:
    chromium = require_binary("chromium")
    page = write_report(recorded_trace, tmp_path / "report.html")
    shot = tmp_path / "report.png"
    done = screenshot(chromium, page, shot, tmp_path / "profile")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    pixels = decode_png(shot.read_bytes())
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    rgb = pixels[..., :3].reshape(-1, 3).astype(np.int64)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
    assert len(colours) > 500, f"only {len(colours)} colours: the page looks blank"
    background = np.all(rgb == rgb[0], axis=1).mean()  # the top-left pixel is page background
    assert background < 0.7, f"{background:.0%} of the screenshot is background"
    assert np.all(rgb == RED, axis=1).sum() > 1000, "no alert/non-finite red: the charts did not render"
