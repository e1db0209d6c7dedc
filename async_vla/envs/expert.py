"""Scripted expert for the built-in tasks (reads the simulator state, not the image): reach the named block or pad
with the gripper open; close (for place, carry in the same step); for place, open. Used for SFT demos and as a
solvability check."""

from __future__ import annotations

import numpy as np

from async_vla.envs.builtin import MAX_DELTA, TabletopEnv


class ScriptedExpert:
    """Stateful per-episode expert: call ``reset(env)`` after ``env.reset`` and ``act(env)`` every step."""

    def reset(self, env: TabletopEnv) -> None:
        spec = env._task
        pos = {th.colour: th.pos.copy() for th in env.things}
        if spec.kind == "place":
            self._plan = [(pos[spec.block], -1.0), (pos[spec.pad], 1.0), (None, -1.0)]
        elif spec.kind == "pick":
            self._plan = [(pos[spec.block], -1.0), (None, 1.0)]
        else:
            self._plan = [(pos[spec.pad], -1.0), (None, 1.0)]
        self._i = 0

    def act(self, env: TabletopEnv) -> np.ndarray:
        """Phase i: the gripper command, then a jump to the phase's waypoint (None: stay)."""
        action = np.zeros(7, dtype=np.float32)
        waypoint, grip = self._plan[min(self._i, len(self._plan) - 1)]
        self._i += 1
        action[6] = grip
        if waypoint is not None:
            action[:2] = np.clip((waypoint - env.grip) / MAX_DELTA, -1.0, 1.0)
        return action


def expert_episode(env: TabletopEnv, task_id: int, init_state_id: int) -> tuple[list, list, bool]:
    """Roll the expert out: (observations before each step, actions, success)."""
    expert = ScriptedExpert()
    obs = env.reset(task_id, init_state_id)
    expert.reset(env)
    observations, actions = [], []
    done = success = False
    while not done:
        a = expert.act(env)
        observations.append(obs)
        actions.append(a)
        obs, done, success = env.step(a)
    return observations, actions, success
