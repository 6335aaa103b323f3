"""A stand-in for ``gymnasium.make("CartPole-v1")``, the one environment the trials use.

The cart-pole of Barto, Sutton and Anderson (1983), with gymnasium's published constants:
g 9.8, cart 1.0 kg, pole 0.1 kg and half-length 0.5 m, force 10 N, 0.02 s Euler steps; the
episode ends when the pole leans past 12 degrees or the cart leaves +-2.4 m, and is cut at
500 steps; a reward of 1 per step; v1's solved threshold is 475.

CleanRL's ``ppo.py`` also uses ``gymnasium.spaces``, ``wrappers.RecordEpisodeStatistics``
and ``vector.SyncVectorEnv``, in gymnasium 0.29's shapes (the version CleanRL pins): the
submodules of the same names.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gymnasium import spaces, vector, wrappers

__all__ = ["CartPole", "make", "spaces", "vector", "wrappers"]

GRAVITY, CART, POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
THETA_LIMIT, X_LIMIT, MAX_STEPS = 12 * 2 * math.pi / 360, 2.4, 500


@dataclass(frozen=True)
class Spec:
    id: str = "CartPole-v1"
    reward_threshold: float = 475.0
    max_episode_steps: int = MAX_STEPS


class CartPole:
    spec = Spec()

    def __init__(self) -> None:
        self.observation_space = spaces.Box(shape=(4,))
        self.action_space = spaces.Discrete(2)
        self._rng = np.random.default_rng()
        self.state = np.zeros(4)
        self.steps = 0

    def reset(self, seed: int | None = None, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.state = self._rng.uniform(-0.05, 0.05, size=4)
        self.steps = 0
        return self.state.astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        x, x_dot, theta, theta_dot = self.state
        force = FORCE if action == 1 else -FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        total = CART + POLE
        temp = (force + POLE * HALF_LENGTH * theta_dot**2 * sin) / total
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - POLE * cos**2 / total)
        )
        x_acc = temp - POLE * HALF_LENGTH * theta_acc * cos / total
        x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
        theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.steps += 1
        terminated = abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT
        truncated = self.steps >= MAX_STEPS
        return self.state.astype(np.float32), 1.0, bool(terminated), truncated, {}

    def render(self) -> None:
        pass


def make(name: str, render_mode: str | None = None, **kwargs: Any) -> CartPole:
    if name != "CartPole-v1":
        raise ValueError(f"this stand-in knows only CartPole-v1, not {name!r} (README.md)")
    return CartPole()
