"""Datasets the trials' scripts load: a synthetic stand-in for MNIST, and ``FakeData``.

No data can be downloaded here, and a trial needs a dataset a network can learn without
learning it at once. Each digit is a 5x7 glyph, enlarged to a 14x20 box in a 28x28 frame,
then warped per image (rotation up to 15 degrees, scale 0.8-1.15, shear, a shift of up to
3 pixels), given a random stroke width and ink level and light noise. Fixed seeds: the
same images on every run. It is not MNIST and README.md says so.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

GLYPHS = (
    (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
)
CHUNK = 5000


def _templates() -> torch.Tensor:
    """(10, 1, 28, 28) float: each glyph enlarged to 14x20, centred."""
    bits = torch.tensor([[[c == "#" for c in row] for row in g] for g in GLYPHS]).float()
    big = F.interpolate(bits.unsqueeze(1), size=(20, 14), mode="bilinear", align_corners=False)
    frame = torch.zeros(10, 1, 28, 28)
    frame[:, :, 4:24, 7:21] = big
    return frame


def synthetic_digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 28, 28) uint8 and their labels (n,) int64."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    templates = _templates()
    out = torch.empty(n, 28, 28, dtype=torch.uint8)
    for start in range(0, n, CHUNK):
        y = labels[start : start + CHUNK]
        m = len(y)

        def u(lo: float, hi: float, m: int = m) -> torch.Tensor:
            return lo + (hi - lo) * torch.rand(m, generator=gen)

        angle = u(-15, 15) * math.pi / 180
        scale = u(0.8, 1.15)
        shear = u(-0.25, 0.25)
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack(
            [
                torch.stack([cos, -sin + shear, u(-0.2, 0.2)], 1),
                torch.stack([sin, cos, u(-0.2, 0.2)], 1),
            ],
            1,
        )
        grid = F.affine_grid(theta, [m, 1, 28, 28], align_corners=False)
        warped = F.grid_sample(templates[y], grid, align_corners=False)[:, 0]
        cut = u(0.1, 0.45).view(m, 1, 1)  # lower: thicker strokes
        ink = u(0.75, 1.0).view(m, 1, 1)
        img = ((warped - cut) / 0.25).clamp(0, 1) * ink
        img = (img + 0.04 * torch.randn(img.shape, generator=gen)).clamp(0, 1)
        out[start : start + m] = (img * 255).round().to(torch.uint8)
    return out, labels


class _Images:
    """Images held as one uint8 tensor and their labels, made and read as torchvision's
    datasets are (``root`` and ``download`` are taken and ignored: nothing is read or
    fetched); a subclass's ``_make(train)`` gives the images and labels."""

    def __init__(
        self,
        root: Any = None,
        train: bool = True,
        download: bool = False,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.data, self.targets = self._make(train)
        self.transform = transform
        self.target_transform = target_transform

    def _make(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        img: Any = self.data[i]
        target: Any = int(self.targets[i])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class MNIST(_Images):
    """60,000 training or 10,000 test synthetic digits, in MNIST's shape and API."""

    def _make(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return synthetic_digits(60_000 if train else 10_000, 0 if train else 1)


class FakeData:
    """Random uint8 images and labels, a fixed one per index, as torchvision's FakeData."""

    def __init__(
        self,
        size: int = 1000,
        image_size: tuple[int, ...] = (3, 224, 224),
        num_classes: int = 10,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        random_offset: int = 0,
    ) -> None:
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.transform, self.target_transform = transform, target_transform
        self.random_offset = random_offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(i + self.random_offset)
        img: Any = torch.randint(0, 256, self.image_size, generator=gen, dtype=torch.uint8)
        target: Any = int(torch.randint(0, self.num_classes, (1,), generator=gen))
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class CIFAR10(_Images):
    """Synthetic 32x32 colour images in CIFAR-10's shape and API: a warped digit (its class)
    in a random light colour on a random darker one, so the class is the shape alone.
    6,400 for training, 1,000 for test: 50 and 10 batches of the script's 128 and 100. It
    is not CIFAR-10, and README.md says so."""

    def _make(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = 6_400 if train else 1_000
        digits, targets = synthetic_digits(n, 2 if train else 3)
        gen = torch.Generator().manual_seed(4 if train else 5)
        ink = F.pad(digits, (2, 2, 2, 2)).float().div(255.0).unsqueeze(1)  # (n, 1, 32, 32)
        # Light ink on a darker ground, each its own colour: learnable within an epoch or two.
        fg = 0.6 + 0.4 * torch.rand(n, 3, 1, 1, generator=gen)
        bg = 0.4 * torch.rand(n, 3, 1, 1, generator=gen)
        return ((bg + (fg - bg) * ink) * 255).round().to(torch.uint8), targets  # (n, 3, 32, 32)
