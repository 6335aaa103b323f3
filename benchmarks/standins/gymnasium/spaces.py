"""``gymnasium.spaces``: only what CleanRL's ``ppo.py``, ``dqn.py`` and its replay buffer
(``cleanrl_utils/buffers.py``) read of them: shapes, dtypes, ``n``, ``sample`` and
``seed``; the other space kinds exist for that buffer's ``isinstance`` checks."""

from typing import Any

import numpy as np


class Space:
    shape: tuple[int, ...] = ()
    dtype: Any = np.float32

    def __init__(self) -> None:
        self._rng = np.random.default_rng()

    def seed(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)


class Discrete(Space):
    dtype = np.int64

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def sample(self) -> int:
        return int(self._rng.integers(self.n))

    def __repr__(self) -> str:
        return f"Discrete({self.n})"


class Box(Space):
    def __init__(self, shape: tuple[int, ...], dtype: Any = np.float32) -> None:
        super().__init__()
        self.shape, self.dtype = shape, dtype

    def __repr__(self) -> str:
        return f"Box(shape={self.shape})"


class MultiDiscrete(Space):
    pass


class MultiBinary(Space):
    pass


class Dict(Space):
    pass
