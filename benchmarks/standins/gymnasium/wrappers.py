"""``gymnasium.wrappers.RecordEpisodeStatistics``: the episode's return and length in the
info of its last step, as gymnasium 0.29 puts them (``info["episode"]["r"]``, ``["l"]``)."""

from typing import Any

import numpy as np


class RecordEpisodeStatistics:
    def __init__(self, env: Any) -> None:
        self.env = env
        self.observation_space, self.action_space = env.observation_space, env.action_space
        self._return, self._length = 0.0, 0

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        self._return, self._length = 0.0, 0
        return self.env.reset(**kwargs)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._return += reward
        self._length += 1
        if terminated or truncated:
            info = {
                **info,
                "episode": {"r": np.array([self._return]), "l": np.array([self._length])},
            }
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        pass
