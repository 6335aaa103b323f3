"""A BSDS300-shaped image folder for pytorch/examples' ``super_resolution``: **not BSDS300**.

The script downloads the Berkeley segmentation set's 200 training and 100 test photos
(481 x 321) unless ``dataset/BSDS300/images`` exists. This writes seeded synthetic
scenes there instead: a smooth background (a few broad colour blobs), overlapping
discs and bars with hard edges, and fine texture, saved as JPEG. Edges and texture are
what a super-resolution model must restore from the downscaled input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SIZES = {"train": 200, "test": 100}
WIDTH, HEIGHT = 481, 321


def _scene(rng: np.random.Generator) -> np.ndarray:
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    img = np.zeros((HEIGHT, WIDTH, 3), np.float32)
    for _ in range(4):  # the smooth background
        cy, cx, r = rng.uniform(0, HEIGHT), rng.uniform(0, WIDTH), rng.uniform(80, 300)
        img += (
            rng.uniform(0, 120, 3)
            * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))[..., None]
        )
    for _ in range(int(rng.integers(6, 16))):  # objects with hard edges
        colour = rng.uniform(0, 255, 3)
        if rng.random() < 0.5:
            cy, cx, r = rng.uniform(0, HEIGHT), rng.uniform(0, WIDTH), rng.uniform(8, 70)
            mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
        else:
            top, left = rng.uniform(0, HEIGHT), rng.uniform(0, WIDTH)
            mask = (
                (y > top)
                & (y < top + rng.uniform(4, 90))
                & (x > left)
                & (x < left + rng.uniform(4, 160))
            )
        img[mask] = 0.4 * img[mask] + 0.6 * colour
    stripes = np.sin(x * rng.uniform(0.2, 0.9) + y * rng.uniform(0.1, 0.6))  # fine texture
    img += (rng.uniform(4, 18) * stripes)[..., None] + rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_bsds(root: Path, seed: int = 0) -> Path:
    """Write ``root/dataset/BSDS300/images/{train,test}/*.jpg``; return the images folder."""
    images = root / "dataset" / "BSDS300" / "images"
    rng = np.random.default_rng(seed)
    for split, n in SIZES.items():
        folder = images / split
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(_scene(rng)).save(folder / f"{i:04d}.jpg", quality=92)
    return images
