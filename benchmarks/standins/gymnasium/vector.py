"""``gymnasium.vector.SyncVectorEnv`` with gymnasium 0.29's autoreset: an env whose
episode ended is reset within the same ``step``; its last info goes under
``infos["final_info"]`` (an object array, None for the others) with the mask
``infos["_final_info"]``, and its last observation under ``"final_observation"``."""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class SyncVectorEnv:
    def __init__(self, env_fns: Sequence[Callable[[], Any]]) -> None:
        self.envs = [fn() for fn in env_fns]
        self.num_envs = len(self.envs)
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space

    def reset(self, seed: int | None = None, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs = [
            env.reset(seed=None if seed is None else seed + i)[0] for i, env in enumerate(self.envs)
        ]
        return np.stack(obs), {}

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        n = self.num_envs
        obs, rewards = [], np.zeros(n)
        terminated, truncated = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        final_info = np.full(n, None, dtype=object)
        final_obs = np.full(n, None, dtype=object)
        for i, (env, action) in enumerate(zip(self.envs, actions, strict=True)):
            o, rewards[i], terminated[i], truncated[i], info = env.step(int(action))
            if terminated[i] or truncated[i]:
                final_obs[i], final_info[i] = o, info
                o, _ = env.reset()
            obs.append(o)
        infos: dict[str, Any] = {}
        if any(x is not None for x in final_info):
            done = np.array([x is not None for x in final_info])
            infos = {
                "final_info": final_info,
                "_final_info": done,
                "final_observation": final_obs,
                "_final_observation": done,
            }
        return np.stack(obs), rewards, terminated, truncated, infos

    def close(self) -> None:
        for env in self.envs:
            env.close() if hasattr(env, "close") else None
