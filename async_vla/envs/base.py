"""The simulator interface every env family implements (see docs/CONTRACTS.md); ``async_vla.envs.make_env`` builds
one."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

Split = Literal["train", "val", "eval", "confirm"]
"""train: rollouts and demos; val: tuning; eval: the held-out set reported; confirm: a second, disjoint held-out
set (an independent check before a run stops on a target). Families without val / confirm raise ValueError."""


@dataclass
class Observation:
    """What the policy sees after a reset or a step."""

    image: np.ndarray
    """uint8 [H, W, 3], upright."""
    proprio: np.ndarray
    """float32 [P] robot state."""
    wrist_image: Optional[np.ndarray] = None
    """uint8 [H, W, 3] wrist camera, when the env has one and it is enabled."""


class Env(abc.ABC):
    """One simulator instance. Episodes are selected by (task_id, init_state_id)."""

    task_ids: list[int]
    obs_image_size: int
    proprio_dim: int

    @abc.abstractmethod
    def instruction(self, task_id: int) -> str:
        """The language instruction of a task."""

    @abc.abstractmethod
    def init_state_ids(self, task_id: int, split: Split) -> list[int]:
        """Init states of a task; the splits are disjoint."""

    @abc.abstractmethod
    def max_steps(self, task_id: int) -> int:
        """Episode step limit of a task."""

    @abc.abstractmethod
    def reset(self, task_id: int, init_state_id: int) -> Observation:
        """Start an episode from a numbered init state."""

    @abc.abstractmethod
    def step(self, action: np.ndarray) -> tuple[Observation, bool, bool]:
        """Apply one float action [7]; returns (obs, done, success). done is True on success or time-out."""

    def step_chunk(self, actions: np.ndarray) -> tuple[Observation, bool, bool, int]:
        """Apply actions ``[k, 7]`` until the episode ends: (obs after the last executed step, done, success, steps).
        Only that observation is read, so an env may skip rendering the steps between; this default steps one by one."""
        obs, done, success, n = None, False, False, 0
        for action in np.asarray(actions):
            obs, done, success = self.step(action)
            n += 1
            if done:
                break
        if obs is None:
            raise ValueError("step_chunk needs at least one action")
        return obs, done, success, n

    def close(self) -> None:
        """Release simulator resources (no-op by default)."""
