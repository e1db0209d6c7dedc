"""Scripted expert for libero_spatial's "pick up the black bowl ... and place it on the plate" tasks: from privileged
state (bowl, plate, gripper site) it drives the OSC_POSE controller to pinch the bowl's rim, lift, carry it over
the plate, lower and open, holding the reset orientation. The target bowl comes from the task's BDDL goal, so one
script serves all ten spatial tasks. Actions use the env's gripper convention."""

from __future__ import annotations

from typing import Optional

import numpy as np

from async_vla.envs.base import Observation

ARM_SCALE = 0.05  # metres of goal offset per unit action (robosuite OSC_POSE output_max)
ROT_SCALE = 0.5  # radians per unit action
RIM_RADIUS = 0.047  # the akita bowl's upper wall ring (collision boxes) around its body origin
GRASP_HEIGHT = 0.040  # gripper site above the bowl's body origin when pinching the wall
HOVER = 0.12  # approach / carry height above the grasp height
RELEASE_HEIGHT = 0.035  # bowl origin above the plate origin when the gripper opens
REACHED = 0.006
# A waypoint the hand cannot quite reach (a finger resting on the rim, the arm near the edge of its workspace
# when the bowl is far away) would stall the script: after PATIENCE steps in a phase, within LOOSE is enough.
PATIENCE = 12
LOOSE = 0.015
CLOSE_STEPS = 12
LIFT_CHECK_STEPS = 8  # lift this long, then the bowl must have risen LIFTED, else the pinch missed: re-grasp
LIFTED = 0.02
MAX_GRASPS = 3
SUPPORTED_SUITES = ("spatial",)


def _rotation_error(target: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Axis-angle (world frame) of the rotation that takes ``current`` to ``target`` (3x3 matrices)."""
    r = target @ current.T
    angle = float(np.arccos(np.clip((np.trace(r) - 1.0) / 2.0, -1.0, 1.0)))
    if angle < 1e-6:
        return np.zeros(3)
    axis = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]]) / (2.0 * np.sin(angle))
    return axis * angle


class BowlOnPlateExpert:
    """Stateful per-episode expert: ``reset(env)`` after ``env.reset``, then ``act(env)`` before every step."""

    def __init__(self, gripper_convention: str = "openvla"):
        self.open_value, self.close_value = (1.0, 0.0) if gripper_convention == "openvla" else (-1.0, 1.0)

    # ---- privileged state -------------------------------------------------------------------------
    @staticmethod
    def _sim_env(env):
        raw = env.raw_env
        if raw is None:
            raise RuntimeError("reset the env before asking the expert")
        return raw.env

    def _pose(self, env, name: str) -> np.ndarray:
        sim_env = self._sim_env(env)
        return sim_env.sim.data.body_xpos[sim_env.obj_body_id[name]].copy()

    def _eef(self, env) -> tuple[np.ndarray, np.ndarray]:
        sim_env = self._sim_env(env)
        robot = sim_env.robots[0]
        pos = sim_env.sim.data.site_xpos[robot.eef_site_id].copy()
        rot = sim_env.sim.data.site_xmat[robot.eef_site_id].reshape(3, 3).copy()
        return pos, rot

    @staticmethod
    def goal_objects(env) -> tuple[str, str]:
        """(bowl, plate) of the task's ``(On bowl plate)`` goal."""
        sim_env = BowlOnPlateExpert._sim_env(env)
        goal = sim_env.parsed_problem["goal_state"]
        if len(goal) != 1 or goal[0][0].lower() != "on":
            raise ValueError(f"the bowl-on-plate expert needs a single (On a b) goal, got {goal}")
        return goal[0][1], goal[0][2]

    # ---- plan -------------------------------------------------------------------------------------
    def reset(self, env) -> None:
        self.bowl, self.plate = self.goal_objects(env)
        pos, rot = self._eef(env)
        self.hold_rot = rot
        bowl = self._pose(env, self.bowl)
        # Pinch the wall on the side nearer the gripper's current y: a shorter path, and the hand never
        # reaches across the bowl.
        side = 1.0 if pos[1] > bowl[1] else -1.0
        self.offset = np.array([0.0, side * RIM_RADIUS, GRASP_HEIGHT])
        self.phase = 0
        self.timer = 0
        self.grasps = 0

    def _move(self, env, target: np.ndarray, gripper: float, speed: float = 1.0) -> tuple[np.ndarray, bool]:
        pos, rot = self._eef(env)
        action = np.zeros(7, dtype=np.float32)
        delta = target - pos
        action[:3] = np.clip(delta / ARM_SCALE, -speed, speed)
        action[3:6] = np.clip(_rotation_error(self.hold_rot, rot) / ROT_SCALE, -1.0, 1.0)
        action[6] = gripper
        err = float(np.max(np.abs(delta)))
        return action, bool(err < REACHED or (self.timer >= PATIENCE and err < LOOSE))

    def act(self, env) -> np.ndarray:
        bowl = self._pose(env, self.bowl)
        plate = self._pose(env, self.plate)
        grasp = bowl + self.offset
        above_grasp = grasp + np.array([0.0, 0.0, HOVER])
        place = plate + self.offset + np.array([0.0, 0.0, RELEASE_HEIGHT])
        above_place = place + np.array([0.0, 0.0, HOVER])
        o, c = self.open_value, self.close_value
        while True:
            if self.phase == 0:  # over the grasp point
                action, reached = self._move(env, above_grasp, o)
            elif self.phase == 1:  # down to the rim
                action, reached = self._move(env, grasp, o, speed=0.6)
            elif self.phase == 2:  # pinch
                action, _ = self._move(env, grasp, c)
                reached = self.timer >= CLOSE_STEPS
            elif self.phase == 3:  # lift (the target follows the lifted bowl's start point)
                action, reached = self._move(env, self._lift_to, c, speed=0.6)
                if (self.timer >= LIFT_CHECK_STEPS and bowl[2] - self._bowl_z < LIFTED
                        and self.grasps < MAX_GRASPS):
                    # The fingers closed beside or on top of the wall (seen when the far bowl sits at the edge
                    # of the arm's reach): open, go back up and pinch the opposite side of the rim.
                    self.offset[1] = -self.offset[1]
                    self.phase, self.timer = 0, 0
                    action[6] = o
                    return action
            elif self.phase == 4:  # carry over the plate
                action, reached = self._move(env, above_place, c, speed=0.8)
            elif self.phase == 5:  # lower
                action, reached = self._move(env, place, c, speed=0.5)
            else:  # release and back off upwards
                action, _ = self._move(env, place + np.array([0.0, 0.0, 0.05]), o, speed=0.3)
                return action
            if not reached:
                self.timer += 1
                return action
            self.phase += 1
            self.timer = 0
            if self.phase == 3:
                self._lift_to = self._eef(env)[0] + np.array([0.0, 0.0, HOVER])
                self._bowl_z = bowl[2]
                self.grasps += 1


def expert_episode(env, task_id: int, init_state_id: int, observe_every: Optional[int] = 8
                   ) -> tuple[list[Observation], list[np.ndarray], bool]:
    """Roll the expert out from ``(task_id, init_state_id)``: (observations, actions, success). The cameras render at the
    reset and before every ``observe_every``-th step (``observations[k]`` is the one before step
    ``k * observe_every``); ``observe_every=None``: physics only."""
    expert = BowlOnPlateExpert(env.cfg.gripper_convention)
    obs = env.reset(task_id, init_state_id)
    expert.reset(env)
    observations: list[Observation] = [obs]
    actions: list[np.ndarray] = []
    done = success = False
    while not done:
        # The expert is closed-loop (it re-reads the state every step), so it acts step by step.
        action = expert.act(env)
        actions.append(action)
        render = observe_every is not None and len(actions) % observe_every == 0
        obs, done, success = env.step(action, render=render)
        if render and not done:
            observations.append(obs)
    return observations, actions, success


__all__ = ["BowlOnPlateExpert", "SUPPORTED_SUITES", "expert_episode"]
