"""A stand-in for the few parts of torchvision that pytorch/examples' scripts use (README.md)."""

from torchvision import datasets, transforms, utils

__all__ = ["datasets", "transforms", "utils"]
