"""``gymnasium.spaces.Discrete`` and ``Box``: only what CleanRL's ``ppo.py`` reads of them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Discrete:
    n: int
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Box:
    shape: tuple[int, ...]
