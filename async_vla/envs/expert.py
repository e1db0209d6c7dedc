"""Scripted expert for the built-in tabletop tasks (reads the simulator state, not the image).

It jumps the gripper to a waypoint (one step when within MAX_DELTA per axis, as in the built-in tasks), then
opens or closes the gripper. dz and the rotations are always 0. Used for SFT demos and as a solvability check.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from async_vla.envs.builtin import MAX_DELTA, TabletopEnv

REACHED = 1e-3
PUSH_OFFSET = 0.35  # stand this far beside a block before pushing (closing then neither grasps nor pushes)


class ScriptedExpert:
    """Stateful per-episode expert: call ``reset(env)`` after ``env.reset`` and ``act(env)`` every step."""

    def reset(self, env: TabletopEnv) -> None:
        spec = env._task
        block = env.things[0].pos.copy()
        plan: list[tuple[Optional[np.ndarray], bool]] = []  # (waypoint or None, gripper closed)
        if spec.kind in ("pick", "press"):
            plan = [(block, False), (None, True)]
        elif spec.kind == "place":
            plan = [(block, False), (None, True), (env.things[1].pos.copy(), True), (None, False)]
        else:  # push: stand beside the block on the far side, close (too far to grasp), sweep through
            sign = -1.0 if spec.other == "left" else 1.0
            side = block - np.array([sign * PUSH_OFFSET, 0.0])
            goal = block + np.array([sign * PUSH_OFFSET, 0.0])  # the block ends PUSH_R beyond this
            plan = [(side, False), (None, True), (goal, True)]
        self._plan = plan
        self._i = 0

    def act(self, env: TabletopEnv) -> np.ndarray:
        action = np.zeros(7, dtype=np.float32)
        while self._i < len(self._plan):
            waypoint, closed = self._plan[self._i]
            action[6] = 1.0 if closed else -1.0
            if waypoint is None:
                if env.closed == closed:  # already in the wanted state: next phase
                    self._i += 1
                    continue
                return action  # one step that only toggles the gripper
            d = waypoint - env.grip
            if float(np.max(np.abs(d))) <= REACHED:
                self._i += 1
                continue
            action[:2] = np.clip(d / MAX_DELTA, -1.0, 1.0)
            return action
        action[6] = 1.0 if env.closed else -1.0
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
