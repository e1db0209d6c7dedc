"""Built-in tabletop task family (v2): a top-down 2-D table rendered with numpy, no assets, fast. Two blocks and two
pads at continuous positions, 7-DoF LIBERO-layout actions (only dx, dy and the gripper act), 8 tasks (place, pick,
touch) whose instructions name the colours. Layouts are split by the cells their blocks lie in (held-out cells
``eval`` / ``confirm``, ``val``, train), a pure function of (task, split, i); init state ids encode the split.
World, tasks and splits in full: docs/ARCHITECTURE.md "The built-in task family"."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from async_vla.envs.base import Env, Observation, Split
from async_vla.envs.limits import BUILTIN_MAX_STEPS

MAX_DELTA = 2.0  # gripper travel per step at |action| = 1: one step can cross the whole (2-wide) table
GRASP_R = 0.2  # closing within this distance of a block's centre grasps it (blocks are drawn 0.2 wide)
PAD_R = 0.25  # a released block / a touch counts as on a pad within this distance of its centre
GRIP_CLOSE, GRIP_OPEN = 0.5, -0.5  # hysteresis: commands in between keep the gripper as it is
START = (0.0, -0.3)  # between the block region (above) and the pad region (below)
BLOCK_REGION = ((-0.75, 0.75), (-0.25, 0.75))  # x range, y range: 6 x 4 cells of CELL
PAD_REGION = ((-0.75, 0.75), (-0.85, -0.5))
CELL = 0.25
NUM_CLASSES = 5  # cell class (i + 2 j) mod 5: 0 held out, 1 val, 2-4 train
HELD_OUT_CLASS, VAL_CLASS = 0, 1
MARGIN = 0.04  # a block sits at least this far inside its cell: held-out blocks are >= 2 * MARGIN from train ones
MIN_BLOCK_GAP = 0.45  # blocks are at least this far apart (grasping is never ambiguous)
MIN_PAD_GAP = 0.5
VAL_ID_OFFSET = 100_000
EVAL_ID_OFFSET = 200_000
CONFIRM_ID_OFFSET = 300_000
SPLIT_OFFSETS = {"train": 0, "val": VAL_ID_OFFSET, "eval": EVAL_ID_OFFSET, "confirm": CONFIRM_ID_OFFSET}
LAYOUT_SEED = 20261125  # fixed: layouts must not depend on the run seed (stable held-out set)
PROPRIO_DIM = 8  # LIBERO-like: eef xyz, eef axis-angle (3), gripper (2)
BLOCKS = ("red", "blue")
PADS = ("green", "yellow")

COLOURS = {
    "red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (235, 210, 40),
}
TABLE = (120, 100, 80)


@dataclass(frozen=True)
class TaskSpec:
    """One task: its kind and the colours it names."""

    kind: str  # place | pick | touch
    block: str = ""  # the block to grasp (place, pick)
    pad: str = ""  # the pad to place on / touch (place, touch)

    @property
    def instruction(self) -> str:
        if self.kind == "place":
            return f"put the {self.block} block on the {self.pad} pad"
        if self.kind == "pick":
            return f"pick up the {self.block} block"
        return f"touch the {self.pad} pad"


TASKS: tuple[TaskSpec, ...] = (
    TaskSpec("place", "red", "green"), TaskSpec("place", "red", "yellow"),
    TaskSpec("place", "blue", "green"), TaskSpec("place", "blue", "yellow"),
    TaskSpec("pick", "red"), TaskSpec("pick", "blue"),
    TaskSpec("touch", pad="green"), TaskSpec("touch", pad="yellow"),
)


@dataclass
class Thing:
    kind: str  # block | pad
    colour: str
    pos: np.ndarray


def split_of(init_state_id: int) -> str:
    """The split an init state id belongs to (ids encode it: docs/ARCHITECTURE.md "The built-in task family")."""
    for name in ("confirm", "eval", "val"):
        if init_state_id >= SPLIT_OFFSETS[name]:
            return name
    if init_state_id < 0:
        raise ValueError(f"init state ids are >= 0, got {init_state_id}")
    return "train"


def _cell_coords(pos) -> np.ndarray:
    """Positions ``[..., 2]`` in units of CELL from the block region's near-left corner (floor = column, row)."""
    return (np.asarray(pos, dtype=np.float64) - np.array([BLOCK_REGION[0][0], BLOCK_REGION[1][0]])) / CELL


def cell_class(pos: np.ndarray) -> np.ndarray:
    """Class of the block-region cell each position ``[..., 2]`` lies in; -1 within MARGIN of a cell edge."""
    f = _cell_coords(pos)
    ij = np.floor(f)
    frac = f - ij
    inside = (np.minimum(frac, 1.0 - frac) >= MARGIN / CELL).all(-1)
    cls = (ij[..., 0] + 2 * ij[..., 1]).astype(np.int64) % NUM_CLASSES
    return np.where(inside, cls, -1)


def split_accepts(split: str, cls: np.ndarray) -> np.ndarray:
    """Whether blocks of cell class ``cls`` may appear in a layout of ``split``."""
    if split in ("eval", "confirm"):
        return cls == HELD_OUT_CLASS
    if split == "val":
        return cls == VAL_CLASS
    return (cls != HELD_OUT_CLASS) & (cls != VAL_CLASS) & (cls >= 0)


@lru_cache(maxsize=65536)
def layout_positions(task_id: int, init_state_id: int) -> tuple[tuple[float, float], ...]:
    """(red, blue, green pad, yellow pad) positions of one numbered init state (pure; rejection-sampled)."""
    split = split_of(init_state_id)
    rng = np.random.default_rng((LAYOUT_SEED, task_id, init_state_id))
    (bx0, bx1), (by0, by1) = BLOCK_REGION
    (px0, px1), (py0, py1) = PAD_REGION
    for _ in range(100):  # batches of candidates; a held-out layout is accepted ~1 in 50
        blocks = rng.uniform((bx0, by0), (bx1, by1), size=(256, 2, 2))
        pads = rng.uniform((px0, py0), (px1, py1), size=(256, 2, 2))
        ok = (split_accepts(split, cell_class(blocks)).all(-1)
              & (np.hypot(*(blocks[:, 0] - blocks[:, 1]).T) >= MIN_BLOCK_GAP)
              & (np.hypot(*(pads[:, 0] - pads[:, 1]).T) >= MIN_PAD_GAP))
        if ok.any():
            k = int(np.argmax(ok))
            return tuple((float(p[0]), float(p[1])) for p in (*blocks[k], *pads[k]))
    raise RuntimeError(f"no layout found for task {task_id} init state {init_state_id}")  # pragma: no cover


def named_block_cell(task_id: int, init_state_id: int) -> Optional[tuple[int, int]]:
    """(column, row) of the block-region cell holding the block a task names (place and pick tasks; None for touch):
    columns 0-5 left to right, rows 0-3 from the pads' side. Where held-out failures lie: ``success_by_cell``."""
    spec = TASKS[task_id]
    if not spec.block:
        return None
    col, row = np.floor(_cell_coords(layout_positions(task_id, init_state_id)[BLOCKS.index(spec.block)]))
    return int(col), int(row)


def success_by_cell(outcomes: list) -> dict[str, dict[str, int]]:
    """``(task, init state, success)`` outcomes -> ``{"col,row": {"successes", "episodes"}}`` by the cell of the block
    each task names (touch tasks left out), in cell order."""
    out: dict[tuple[int, int], list[int]] = {}
    for task_id, init_state_id, success in outcomes:
        cell = named_block_cell(int(task_id), int(init_state_id))
        if cell is not None:
            n = out.setdefault(cell, [0, 0])
            n[0] += bool(success)
            n[1] += 1
    return {f"{c},{r}": {"successes": k, "episodes": n} for (c, r), (k, n) in sorted(out.items())}


def layout(task_id: int, init_state_id: int) -> tuple[list[Thing], np.ndarray]:
    """Objects (red block, blue block, green pad, yellow pad) and the gripper start of one init state."""
    pos = layout_positions(task_id, init_state_id)
    things = [Thing("block", c, np.array(p)) for c, p in zip(BLOCKS, pos[:2])]
    things += [Thing("pad", c, np.array(p)) for c, p in zip(PADS, pos[2:])]
    return things, np.array(START, dtype=np.float64)


class TabletopEnv(Env):
    """The built-in task family (docs/ARCHITECTURE.md "The built-in task family")."""

    def __init__(self, task_ids: Optional[list[int]] = None, image_size: int = 32, num_train_init_states: int = 40,
                 num_eval_init_states: int = 10, max_steps: Optional[int] = None, seed: int = 0,
                 num_val_init_states: int = 10):
        self.task_ids = list(range(len(TASKS))) if task_ids is None else list(task_ids)
        for t in self.task_ids:
            if not 0 <= t < len(TASKS):
                raise ValueError(f"builtin env has tasks 0..{len(TASKS) - 1}, got task id {t}")
        self.obs_image_size = image_size
        self.proprio_dim = PROPRIO_DIM
        self.split_sizes = {"train": num_train_init_states, "val": num_val_init_states,
                            "eval": num_eval_init_states, "confirm": num_eval_init_states}
        if max(self.split_sizes.values()) > VAL_ID_OFFSET:
            raise ValueError(f"at most {VAL_ID_OFFSET} init states per split")
        self._max_steps = max_steps or BUILTIN_MAX_STEPS
        self.seed = seed  # the dynamics are deterministic; kept for the interface
        self._scale = image_size / 2.0
        self._background = np.empty((image_size, image_size, 3), dtype=np.uint8)
        self._background[:] = TABLE
        self._task: Optional[TaskSpec] = None

    @classmethod
    def from_config(cls, env_cfg, seed: int = 0) -> "TabletopEnv":
        return cls(task_ids=env_cfg.task_ids, image_size=env_cfg.image_size,
                   num_train_init_states=env_cfg.num_train_init_states,
                   num_eval_init_states=env_cfg.num_eval_init_states, max_steps=env_cfg.max_steps, seed=seed,
                   num_val_init_states=env_cfg.num_val_init_states)

    # ---- interface --------------------------------------------------------------------------------
    def instruction(self, task_id: int) -> str:
        return TASKS[task_id].instruction

    def init_state_ids(self, task_id: int, split: Split) -> list[int]:
        if split not in SPLIT_OFFSETS:
            raise ValueError(f"split must be one of {sorted(SPLIT_OFFSETS)}, got {split!r}")
        return [SPLIT_OFFSETS[split] + i for i in range(self.split_sizes[split])]

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
        return self._observe()

    def step(self, action: np.ndarray) -> tuple[Observation, bool, bool]:
        if self._task is None or self.done:
            raise RuntimeError("step() before reset() or after the episode ended")
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
        if a.shape[0] < 7:
            raise ValueError(f"action must have 7 entries, got {a.shape[0]}")
        touched = self._grip(a[6])
        self.grip = np.clip(self.grip + a[:2] * MAX_DELTA, -1.0, 1.0)
        if self.held is not None:
            self.things[self.held].pos = self.grip.copy()
        self.steps += 1
        success = self._success(touched)
        self.done = success or self.steps >= self._max_steps
        return self._observe(), self.done, success

    # ---- dynamics ---------------------------------------------------------------------------------
    def _grip(self, command: float) -> Optional[int]:
        """Apply a gripper command where the gripper is; returns the pad an empty close touched, if any."""
        if command > GRIP_CLOSE and not self.closed:
            self.closed = True
            best, best_d = None, GRASP_R
            for i, th in enumerate(self.things[:2]):
                d = float(np.hypot(*(th.pos - self.grip)))
                if d < best_d:
                    best, best_d = i, d
            self.held = best
            if best is None:
                for i, th in enumerate(self.things[2:], start=2):
                    if float(np.hypot(*(th.pos - self.grip))) < PAD_R:
                        return i
        elif command < GRIP_OPEN and self.closed:
            self.closed = False
            self.held = None  # the held block stays where it is (put down)
        return None

    def _index(self, colour: str) -> int:
        return next(i for i, th in enumerate(self.things) if th.colour == colour)

    def _success(self, touched: Optional[int]) -> bool:
        spec = self._task
        if spec.kind == "pick":
            return self.held == self._index(spec.block)
        if spec.kind == "touch":
            return touched == self._index(spec.pad)
        block, pad = self.things[self._index(spec.block)], self.things[self._index(spec.pad)]
        return self.held is None and float(np.hypot(*(block.pos - pad.pos))) < PAD_R

    # ---- observation ------------------------------------------------------------------------------
    def _px(self, pos: np.ndarray) -> tuple[int, int]:
        """World (x, y) -> pixel (row, col); row 0 is the far edge of the table (y = +1)."""
        n = self.obs_image_size
        col = int(min(max((pos[0] + 1.0) * self._scale, 0), n - 1))
        row = int(min(max((1.0 - pos[1]) * self._scale, 0), n - 1))
        return row, col

    def _square(self, img: np.ndarray, pos: np.ndarray, half: float, colour, hollow: bool = False) -> None:
        r, c = self._px(pos)
        h = max(1, int(round(half * self._scale)))
        r0, r1, c0, c1 = max(r - h, 0), min(r + h, img.shape[0]), max(c - h, 0), min(c + h, img.shape[1])
        if not hollow:
            img[r0:r1, c0:c1] = colour
            return
        # Outline only: what lies under a pad or the open gripper stays visible.
        img[r0, c0:c1] = colour
        img[r1 - 1, c0:c1] = colour
        img[r0:r1, c0] = colour
        img[r0:r1, c1 - 1] = colour

    def _observe(self) -> Observation:
        img = self._background.copy()
        for th in self.things[2:]:  # pads under blocks
            self._square(img, th.pos, PAD_R, COLOURS[th.colour], hollow=True)
        for th in self.things[:2]:
            self._square(img, th.pos, 0.1, COLOURS[th.colour])
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
