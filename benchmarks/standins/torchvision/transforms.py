"""The transforms pytorch/examples' scripts compose, on uint8 tensors (C, H, W) or (H, W),
or PIL images (super_resolution's), taken as such tensors."""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


def _tensor(x: Any) -> torch.Tensor:
    """A PIL image (super_resolution's inputs) as uint8 (H, W) or (H, W, C) -> (C, H, W)."""
    if isinstance(x, torch.Tensor):
        return x
    array = torch.from_numpy(np.asarray(x).copy())
    return array.permute(2, 0, 1) if array.dim() == 3 else array


def _chw(x: Any) -> torch.Tensor:
    x = _tensor(x)
    return x.unsqueeze(0) if x.dim() == 2 else x


class ToTensor:
    """uint8 (H, W) or (C, H, W) -> float (C, H, W) in [0, 1], as torchvision's does for PIL."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _chw(x)
        return x.float().div(255.0) if x.dtype == torch.uint8 else x.float()


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class Resize:
    """The shorter side to ``size`` (an int), bilinear; dtype kept."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _chw(x)
        h, w = x.shape[-2:]
        scale = self.size / min(h, w)
        out = F.interpolate(
            x.unsqueeze(0).float(),
            size=(round(h * scale), round(w * scale)),
            mode="bilinear",
            align_corners=False,
        )[0]
        return out.round().clamp(0, 255).to(torch.uint8) if x.dtype == torch.uint8 else out


class CenterCrop:
    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: Any) -> torch.Tensor:
        x = _tensor(x)
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top : top + self.size, left : left + self.size]


class Lambda:
    """A user's function as a transform (mnist_forward_forward flattens with it)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, x: Any) -> Any:
        return self.fn(x)


class RandomCrop:
    """Pad each side by ``padding`` (zeros), then crop ``size`` at a random place."""

    def __init__(self, size: int, padding: int = 0) -> None:
        self.size, self.padding = size, padding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = _chw(x)
        p = self.padding
        if p:
            x = F.pad(x, (p, p, p, p))
        h, w = x.shape[-2:]
        top = int(torch.randint(0, h - self.size + 1, (1,)))
        left = int(torch.randint(0, w - self.size + 1, (1,)))
        return x[..., top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) if float(torch.rand(1)) < self.p else x
