"""Built-in tabletop task family: a top-down 2-D table rendered with numpy, no assets, >10k steps/s.

World: the table is the square [-1, 1]^2 (x right, y up), seen from above (image row 0 = far edge, y = +1).
A gripper moves over it; blocks, pads and buttons lie on it. Action (the LIBERO / OpenVLA 7-DoF layout):
``[dx, dy, dz, droll, dpitch, dyaw, gripper]`` in [-1, 1]; dx, dy move the gripper by up to ``MAX_DELTA`` = 2
per step (one step can cross the table: every decision is one coarse jump), dz and the rotations are accepted
and ignored (the policy still emits them); gripper > 0.5 closes, < -0.5 opens, anything in between keeps the
current state (hysteresis: a stray sampled token rarely drops a block).
Proprio (8, LIBERO-like): ``[x, y, 0, 0, 0, 0, closed (+1 / -1), holding (1 / 0)]``.

Mechanics: closing within ``GRASP_R`` of a block grasps the nearest one, which follows the gripper until it
opens; a closed, empty gripper is a square paddle that shoves blocks ahead of it (an open one passes over
them); closing within ``PRESS_R`` of a button presses it.

Task types (8 tasks, two of each): pick ("pick up the red block", distractor block of another colour), place
("put the blue block on the green pad"), push ("push the yellow block to the left") and press ("press the
green button", distractor button). The target (and distractor) of an init state sits at one of two spots,
``OFFSETS`` = -0.15 / +0.15 from its nominal spot along the task's axis, plus a small jitter: the spot is the
coarse decision the image shows (about 5 pixels apart at 32x32). The target's spot alternates with the init
id, so each split holds both spots in equal shares. Expert episodes take 2-4 steps (one policy
call of 8); replaying one demo blindly succeeds on about half of the layouts, which is where one-demo SFT
lands (a little lower), and a policy that reads the spot from the image solves them all. Pads are big (``PAD_R``), so for
place only the grasp is a decision. The default step limit is 16 (2 calls: one retry).

Init states are numbered per task: train ids ``0 .. num_train - 1``, eval ids ``EVAL_ID_OFFSET + i``; the
layout of an id depends only on (task, id), never on the run seed, so the held-out set is the same in every
run and disjoint from the train set by construction (the same two spots recur with other jitter and
distractor placements, as LIBERO's init states perturb one scene).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from async_vla.envs.base import Env, Observation, Split

MAX_DELTA = 2.0  # gripper travel per step at |action| = 1: one step can cross the whole (2-wide) table
GRASP_R = 0.2
PUSH_R = 0.2  # half-width of the closed gripper's paddle
PRESS_R = 0.2
PAD_R = 0.4  # a block counts as on a pad within this distance of its centre (big pads: only the grasp is a
# decision, carrying it along the demo's path from either block spot still lands on the pad)
PUSH_DIST = 0.35  # push tasks succeed once the block has moved this far in the instructed direction
GRIP_CLOSE, GRIP_OPEN = 0.5, -0.5  # hysteresis: commands in between keep the gripper as it is
OFFSETS = (-0.15, 0.15)  # an object sits this far from its nominal spot along its task's axis: the coarse
# decision (one demo covers one of the two spots; T=1.6 rollouts reach the other one in ~1/4 of the samples,
# while a third spot 0.6 away was almost never explored and stalled GRPO, measured)
JITTER = 0.04  # plus a small visual jitter, well inside every tolerance
SUBSTEP = 0.1  # motion is swept in sub-steps this long so a closed gripper cannot jump over a block
START = (0.0, -0.75)
EVAL_ID_OFFSET = 100_000
LAYOUT_SEED = 20240517  # fixed: layouts must not depend on the run seed (stable held-out set)
DEFAULT_MAX_STEPS = 16  # 2 policy calls of 8-step chunks; every expert episode needs <= 4 steps
PROPRIO_DIM = 8  # LIBERO-like: eef xyz, eef axis-angle (3), gripper (2)

COLOURS = {
    "red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (235, 210, 40),
}
TABLE = (120, 100, 80)


@dataclass(frozen=True)
class TaskSpec:
    """One task: its type, the colours involved and the nominal spots of its objects."""

    kind: str  # pick | place | push | press
    target: str  # colour of the manipulated block / pressed button
    other: str  # pick/press: distractor colour; place: pad colour; push: direction (left/right)
    target_at: tuple  # nominal (x, y) of the target
    other_at: tuple = ()  # nominal (x, y) of the distractor / pad (none for push)
    axis: int = 0  # the target and distractor shift by OFFSETS along x (0) or y (1); the pad does not shift

    @property
    def instruction(self) -> str:
        if self.kind == "pick":
            return f"pick up the {self.target} block"
        if self.kind == "place":
            return f"put the {self.target} block on the {self.other} pad"
        if self.kind == "push":
            return f"push the {self.target} block to the {self.other}"
        return f"press the {self.target} button"


TASKS: tuple[TaskSpec, ...] = (
    TaskSpec("pick", "red", "blue", (-0.5, 0.5), (0.5, 0.5)),
    TaskSpec("place", "blue", "green", (-0.5, 0.5), (0.5, -0.25)),
    TaskSpec("push", "yellow", "left", (0.25, 0.2), axis=1),
    TaskSpec("press", "green", "red", (0.5, 0.5), (-0.5, 0.5)),
    TaskSpec("pick", "green", "yellow", (0.5, 0.0), (-0.5, 0.0)),
    TaskSpec("place", "red", "yellow", (0.5, 0.5), (-0.5, -0.25)),
    TaskSpec("push", "blue", "right", (-0.25, 0.2), axis=1),
    TaskSpec("press", "blue", "yellow", (-0.5, 0.0), (0.5, 0.0)),
)


@dataclass
class Thing:
    kind: str  # block | pad | button
    colour: str
    pos: np.ndarray


def layout(task_id: int, init_state_id: int) -> tuple[list[Thing], np.ndarray]:
    """Objects and gripper start of one numbered init state (pure function of its arguments)."""
    spec = TASKS[task_id]
    rng = np.random.default_rng((LAYOUT_SEED, task_id, init_state_id))

    def spot(nominal, offset: float) -> np.ndarray:
        pos = np.array(nominal, dtype=np.float64) + rng.uniform(-JITTER, JITTER, size=2)
        pos[spec.axis] += offset
        return pos

    # The target's spot alternates with the id, so every split holds both spots in equal shares (a demo's spot
    # is then always half of the held-out set); the distractor's spot is random.
    kind = "button" if spec.kind == "press" else "block"
    things = [Thing(kind, spec.target, spot(spec.target_at, OFFSETS[init_state_id % len(OFFSETS)]))]
    if spec.kind in ("pick", "press"):
        things.append(Thing(kind, spec.other, spot(spec.other_at, OFFSETS[rng.integers(len(OFFSETS))])))
    elif spec.kind == "place":
        things.append(Thing("pad", spec.other, spot(spec.other_at, 0.0)))
    return things, np.array(START, dtype=np.float64)


class TabletopEnv(Env):
    """The built-in task family (see the module docstring)."""

    def __init__(self, task_ids: Optional[list[int]] = None, image_size: int = 32, num_train_init_states: int = 40,
                 num_eval_init_states: int = 10, max_steps: Optional[int] = None, seed: int = 0):
        self.task_ids = list(range(len(TASKS))) if task_ids is None else list(task_ids)
        for t in self.task_ids:
            if not 0 <= t < len(TASKS):
                raise ValueError(f"builtin env has tasks 0..{len(TASKS) - 1}, got task id {t}")
        self.obs_image_size = image_size
        self.proprio_dim = PROPRIO_DIM
        self.num_train = num_train_init_states
        self.num_eval = num_eval_init_states
        if max(num_train_init_states, num_eval_init_states) > EVAL_ID_OFFSET:
            raise ValueError(f"at most {EVAL_ID_OFFSET} init states per split")
        self._max_steps = max_steps or DEFAULT_MAX_STEPS
        self.seed = seed  # the dynamics are deterministic; kept for the interface
        self._scale = image_size / 2.0
        self._background = np.empty((image_size, image_size, 3), dtype=np.uint8)
        self._background[:] = TABLE
        self._task: Optional[TaskSpec] = None

    @classmethod
    def from_config(cls, env_cfg, seed: int = 0) -> "TabletopEnv":
        return cls(task_ids=env_cfg.task_ids, image_size=env_cfg.image_size,
                   num_train_init_states=env_cfg.num_train_init_states,
                   num_eval_init_states=env_cfg.num_eval_init_states, max_steps=env_cfg.max_steps, seed=seed)

    # ---- interface --------------------------------------------------------------------------------
    def instruction(self, task_id: int) -> str:
        return TASKS[task_id].instruction

    def init_state_ids(self, task_id: int, split: Split) -> list[int]:
        if split == "train":
            return list(range(self.num_train))
        if split == "eval":
            return [EVAL_ID_OFFSET + i for i in range(self.num_eval)]
        raise ValueError(f"split must be train or eval, got {split!r}")

    def max_steps(self, task_id: int) -> int:
        return self._max_steps

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        self._task = TASKS[task_id]
        self._task_id = task_id
        self.things, self.grip = layout(task_id, init_state_id)
        self.closed = False
        self.held: Optional[int] = None
        self.steps = 0
        self.done = False
        self._start_pos = self.things[0].pos.copy()
        return self._observe()

    def step(self, action: np.ndarray) -> tuple[Observation, bool, bool]:
        if self._task is None or self.done:
            raise RuntimeError("step() before reset() or after the episode ended")
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
        if a.shape[0] < 7:
            raise ValueError(f"action must have 7 entries, got {a.shape[0]}")
        close = self.closed
        if a[6] > GRIP_CLOSE:
            close = True
        elif a[6] < GRIP_OPEN:
            close = False
        pressed = self._move_and_grip(a[:2] * MAX_DELTA, close)
        self.steps += 1
        success = self._success(pressed)
        self.done = success or self.steps >= self._max_steps
        return self._observe(), self.done, success

    # ---- dynamics ---------------------------------------------------------------------------------
    def _move_and_grip(self, delta: np.ndarray, close: bool) -> Optional[int]:
        n = max(1, int(np.ceil(float(np.max(np.abs(delta))) / SUBSTEP)))
        for _ in range(n):
            self.grip = np.clip(self.grip + delta / n, -1.0, 1.0)
            if self.held is not None:
                self.things[self.held].pos = self.grip.copy()
            elif self.closed and delta.any():
                self._push(delta)
        pressed = None
        if close and not self.closed:
            self.closed = True
            best, best_d = None, np.inf
            for i, th in enumerate(self.things):
                d = float(np.hypot(*(th.pos - self.grip)))
                if th.kind == "block" and d < GRASP_R and d < best_d:
                    best, best_d = i, d
                if th.kind == "button" and d < PRESS_R:
                    pressed = i
            self.held = best
        elif not close and self.closed:
            self.closed = False
            self.held = None  # the held block stays where it is (put down)
        return pressed

    def _push(self, delta: np.ndarray) -> None:
        # A closed gripper is a square paddle of half-width PUSH_R: a block in contact ahead of it along the
        # main axis of motion is shoved to the paddle's edge (no sliding off, so pushes tolerate offsets).
        axis = 0 if abs(delta[0]) >= abs(delta[1]) else 1
        sign = 1.0 if delta[axis] > 0 else -1.0
        for th in self.things:
            if th.kind != "block":
                continue
            d = th.pos - self.grip
            if abs(d[0]) < PUSH_R and abs(d[1]) < PUSH_R and d[axis] * sign > 0:
                th.pos[axis] = float(np.clip(self.grip[axis] + sign * PUSH_R, -1.0, 1.0))

    def _success(self, pressed: Optional[int]) -> bool:
        spec = self._task
        if spec.kind == "pick":
            return self.held == 0
        if spec.kind == "press":
            return pressed == 0
        block = self.things[0]
        if spec.kind == "place":
            return self.held is None and float(np.hypot(*(block.pos - self.things[1].pos))) < PAD_R
        sign = -1.0 if spec.other == "left" else 1.0
        return self.held is None and sign * (block.pos[0] - self._start_pos[0]) >= PUSH_DIST

    # ---- observation ------------------------------------------------------------------------------
    def _px(self, pos: np.ndarray) -> tuple[int, int]:
        """World (x, y) -> pixel (row, col); row 0 is the far edge of the table (y = +1)."""
        n = self.obs_image_size
        col = int(np.clip((pos[0] + 1.0) * self._scale, 0, n - 1))
        row = int(np.clip((1.0 - pos[1]) * self._scale, 0, n - 1))
        return row, col

    def _square(self, img: np.ndarray, pos: np.ndarray, half: float, colour, hollow: bool = False) -> None:
        r, c = self._px(pos)
        h = max(1, int(round(half * self._scale)))
        r0, r1, c0, c1 = max(r - h, 0), r + h, max(c - h, 0), c + h
        if not hollow:
            img[r0:r1, c0:c1] = colour
            return
        # Outline only: what lies under a pad or the open gripper stays visible.
        img[r0, c0:c1] = colour
        img[r1 - 1 if r1 <= img.shape[0] else img.shape[0] - 1, c0:c1] = colour
        img[r0:r1, c0] = colour
        img[r0:r1, min(c1, img.shape[1]) - 1] = colour

    def _observe(self) -> Observation:
        img = self._background.copy()
        for th in self.things:  # pads under buttons under blocks
            if th.kind == "pad":
                self._square(img, th.pos, 0.3, COLOURS[th.colour], hollow=True)
        for th in self.things:
            if th.kind == "button":
                r, c = self._px(th.pos)
                h = max(1, int(round(0.12 * self._scale)))
                img[max(r - h, 0):r + h, c] = COLOURS[th.colour]  # a plus sign
                img[r, max(c - h, 0):c + h] = COLOURS[th.colour]
        for th in self.things:
            if th.kind == "block":
                self._square(img, th.pos, 0.12, COLOURS[th.colour])
        # Gripper: open = white hollow square, closed = black filled one.
        if self.closed:
            self._square(img, self.grip, 0.07, (0, 0, 0))
        else:
            self._square(img, self.grip, 0.1, (255, 255, 255), hollow=True)
        proprio = np.zeros(PROPRIO_DIM, dtype=np.float32)
        proprio[0:2] = self.grip
        proprio[6] = 1.0 if self.closed else -1.0
        proprio[7] = 0.0 if self.held is None else 1.0
        return Observation(image=img, proprio=proprio)
