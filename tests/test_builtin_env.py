"""Built-in tabletop env: interface, splits, determinism, mechanics, scripted expert, make_env."""

import copy

import numpy as np
import pytest

from async_vla.config import load_config
from async_vla.envs import builtin, make_env
from async_vla.envs.base import Env, Observation
from async_vla.envs.builtin import TASKS, TabletopEnv
from async_vla.envs.expert import ScriptedExpert, expert_episode
from async_vla.envs.limits import BUILTIN_MAX_STEPS


@pytest.fixture
def env() -> TabletopEnv:
    return TabletopEnv(num_train_init_states=40, num_eval_init_states=10)


def test_interface_and_observation(env):
    assert isinstance(env, Env)
    assert env.task_ids == list(range(len(TASKS))) and len(TASKS) >= 4
    assert {t.kind for t in TASKS} == {"pick", "place", "touch"}
    obs = env.reset(0, 0)
    assert isinstance(obs, Observation)
    assert obs.image.shape == (32, 32, 3) and obs.image.dtype == np.uint8
    assert obs.proprio.shape == (env.proprio_dim,) == (8,) and obs.proprio.dtype == np.float32
    assert obs.wrist_image is None
    assert env.obs_image_size == 32 and env.max_steps(0) == BUILTIN_MAX_STEPS
    for t in env.task_ids:
        assert isinstance(env.instruction(t), str) and len(env.instruction(t).split()) >= 4
    assert len({env.instruction(t) for t in env.task_ids}) == len(env.task_ids)


def test_splits_disjoint_and_sized(env):
    for t in env.task_ids:
        ids = {sp: env.init_state_ids(t, sp) for sp in ("train", "val", "eval", "confirm")}
        assert [len(ids[sp]) for sp in ("train", "val", "eval", "confirm")] == [40, 10, 10, 10]
        assert len(set().union(*ids.values())) == 70  # disjoint ids
        assert all(builtin.split_of(i) == sp for sp, v in ids.items() for i in v)
    # the held-out set does not move when the train split grows
    big = TabletopEnv(num_train_init_states=500, num_eval_init_states=10)
    assert big.init_state_ids(0, "eval") == env.init_state_ids(0, "eval")
    assert not set(big.init_state_ids(0, "train")) & set(big.init_state_ids(0, "eval"))
    with pytest.raises(ValueError):
        env.init_state_ids(0, "test")


def _blocks(task, ids):
    return np.array([builtin.layout_positions(task, i)[:2] for i in ids])  # [N, 2 blocks, 2]


def test_held_out_layouts_are_far_from_every_train_layout():
    """The generalisation contract: no block of a held-out (or val) layout is within 2 * MARGIN of any block
    position of any train layout, so no held-out layout equals or nearly equals a train one."""
    env = TabletopEnv(num_train_init_states=2000, num_eval_init_states=200, num_val_init_states=200)
    for t in (0, 3):
        train = _blocks(t, env.init_state_ids(t, "train")).reshape(-1, 2)
        for split in ("eval", "confirm", "val"):
            held = _blocks(t, env.init_state_ids(t, split))
            gaps = np.linalg.norm(held.reshape(-1, 1, 2) - train[None], axis=-1).min(1)
            assert gaps.min() >= 2 * builtin.MARGIN - 1e-9, (t, split, gaps.min())
            # the full layout vectors (both blocks and both pads) are at least as far apart
            assert np.all(builtin.cell_class(held) == (builtin.VAL_CLASS if split == "val" else builtin.HELD_OUT_CLASS))
        # continuous: the train blocks cover the train cells, not a few spots
        assert len(np.unique(train, axis=0)) == len(train)
        assert len(np.unique(np.round(train / 0.05), axis=0)) > 150  # ~200 of the train cells' 0.05 bins, not a few
        assert set(np.unique(builtin.cell_class(train))) == {2, 3, 4}
    # eval and confirm are two different held-out sets
    ev, cf = _blocks(0, env.init_state_ids(0, "eval")), _blocks(0, env.init_state_ids(0, "confirm"))
    assert not any(np.allclose(a, b) for a in ev for b in cf)


def test_cell_classes_interleave():
    """Held-out cells are spread over the block region, each with train / val cells beside it."""
    (x0, x1), (y0, y1) = builtin.BLOCK_REGION
    nx, ny = round((x1 - x0) / builtin.CELL), round((y1 - y0) / builtin.CELL)
    centres = np.array([[x0 + (i + 0.5) * builtin.CELL, y0 + (j + 0.5) * builtin.CELL]
                        for j in range(ny) for i in range(nx)])
    cls = builtin.cell_class(centres).reshape(ny, nx)
    assert (cls == builtin.HELD_OUT_CLASS).sum() >= 4 and (cls == builtin.VAL_CLASS).sum() >= 4
    for j, i in zip(*np.nonzero(cls == builtin.HELD_OUT_CLASS)):
        for dj, di in ((0, 1), (0, -1), (1, 0), (-1, 0)):
            if 0 <= j + dj < ny and 0 <= i + di < nx:
                assert cls[j + dj, i + di] != builtin.HELD_OUT_CLASS
    assert builtin.cell_class(np.array([x0 + builtin.CELL - 0.01, 0.1])) == -1  # within MARGIN of an edge


def test_deterministic_and_seed_independent_layouts(env):
    other = TabletopEnv(seed=123)
    a, b = env.reset(2, 7), other.reset(2, 7)
    assert np.array_equal(a.image, b.image) and np.array_equal(a.proprio, b.proprio)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(20, 7))
    for act in actions:
        (oa, da, sa), (ob, db, sb) = env.step(act), other.step(act)
        assert np.array_equal(oa.image, ob.image) and (da, sa) == (db, sb)
        if da:
            break
    # different init states give different layouts
    assert not np.array_equal(env.reset(0, 0).image, env.reset(0, 1).image)


def test_step_limit_and_errors():
    env = TabletopEnv(max_steps=5)
    env.reset(0, 0)
    with pytest.raises(ValueError):
        env.step(np.zeros(3))
    done = False
    for k in range(5):
        _, done, success = env.step(np.zeros(7))
        assert done == (k == 4) and not success
    with pytest.raises(RuntimeError):
        env.step(np.zeros(7))
    with pytest.raises(ValueError):
        TabletopEnv(task_ids=[99])


def _go(env, target, grip):
    """One step: the gripper command acts first, then the jump to ``target``."""
    return env.step(np.r_[(np.asarray(target) - env.grip) / builtin.MAX_DELTA, np.zeros(4), grip])


def test_place_grasps_first_then_carries_and_the_distractors_matter():
    env = TabletopEnv()
    env.reset(0, 3)  # put the red block on the green pad
    red, blue, green, yellow = (th.pos.copy() for th in env.things)
    _go(env, red + 0.05, -1.0)  # reach, open
    assert env.held is None and np.allclose(env.grip, red + 0.05)
    _, done, success = _go(env, green, 1.0)  # close where it is (grasp), then carry
    assert env.held == 0 and np.allclose(env.things[0].pos, green) and not success
    _, done, success = _go(env, green, -1.0)
    assert success and done
    # the same motions with the blue block (a distractor for this task) fail
    env.reset(0, 3)
    _go(env, blue, -1.0)
    _go(env, green, 1.0)
    _, done, success = _go(env, green, -1.0)
    assert env.held is None and not success and np.allclose(env.things[1].pos, green)
    # the red block on the yellow pad (the other pad) fails too; on task 1 it succeeds
    for task, ok in ((0, False), (1, True)):
        env.reset(task, 3)
        red, yellow = env.things[0].pos.copy(), env.things[3].pos.copy()
        _go(env, red, -1.0)
        _go(env, yellow, 1.0)
        assert _go(env, yellow, -1.0)[2] == ok
    # closing away from every block grasps nothing
    env.reset(0, 3)
    red = env.things[0].pos.copy()
    _go(env, red + np.array([builtin.GRASP_R + 0.02, 0.0]), -1.0)
    _go(env, green, 1.0)
    assert env.held is None and np.allclose(env.things[0].pos, red)


def test_pick_and_touch():
    env = TabletopEnv()
    env.reset(5, 1)  # pick up the blue block
    _go(env, env.things[0].pos, -1.0)
    assert not _go(env, env.grip, 1.0)[2] and env.held == 0  # the red one: no success, and the episode goes on
    env.reset(5, 1)
    _go(env, env.things[1].pos, -1.0)
    assert _go(env, env.grip, 1.0)[2]
    env.reset(7, 1)  # touch the yellow pad
    _go(env, env.things[2].pos, -1.0)
    assert not _go(env, env.grip, 1.0)[2]
    env.reset(7, 1)
    _go(env, env.things[3].pos + 0.1, -1.0)
    assert _go(env, env.grip, 1.0)[2]


def test_expert_solves_every_split_in_two_policy_calls_of_two_steps(env):
    for t in env.task_ids:
        for sp in ("train", "val", "eval", "confirm"):
            for i in env.init_state_ids(t, sp):
                obs, acts, success = expert_episode(env, t, i)
                assert success, (t, i)
                assert len(acts) == (3 if TASKS[t].kind == "place" else 2)
                assert all(np.all(np.abs(a) <= 1.0) for a in acts)


def test_one_demo_replayed_blindly_rarely_succeeds(env):
    """Continuous layouts: replaying another layout's demo (what a policy that ignores the image does) fails."""
    for t in env.task_ids:
        _, acts, _ = expert_episode(env, t, 0)
        wins = 0
        for i in env.init_state_ids(t, "eval"):
            env.reset(t, i)
            done, k, success = False, 0, False
            while not done:
                a = acts[k] if k < len(acts) else np.r_[np.zeros(6), acts[-1][6]]
                _, done, success = env.step(a)
                k += 1
            wins += success
        assert wins <= (1 if TASKS[t].kind == "place" else 4), (t, wins)  # pads are big: touch is easier


def test_expert_object_reads_state_only_after_reset(env):
    ex = ScriptedExpert()
    env.reset(3, 5)
    ex.reset(env)
    a = ex.act(env)
    assert a.shape == (7,) and a[6] == -1.0


def test_image_shows_objects_and_gripper_state(env):
    obs = env.reset(0, 3)
    for colour in ("red", "blue"):
        assert (obs.image == np.array(builtin.COLOURS[colour], dtype=np.uint8)).all(-1).sum() >= 9  # visible blocks
    for colour in ("green", "yellow"):
        assert (obs.image == np.array(builtin.COLOURS[colour], dtype=np.uint8)).all(-1).sum() >= 8  # pad outlines
    assert (obs.image == 255).all(-1).sum() >= 4  # the open (white) gripper
    env.grip = np.array([0.9, 0.9])  # away from every block and pad
    obs, _, _ = env.step(np.r_[np.zeros(6), 1.0])
    assert (obs.image == 255).all(-1).sum() == 0 and (obs.image == 0).all(-1).sum() >= 4  # closed (black)
    assert obs.proprio[6] == 1.0


def test_image_size_config():
    env = TabletopEnv(image_size=64)
    assert env.reset(0, 0).image.shape == (64, 64, 3)


def test_make_env_dispatch():
    cfg = load_config(None, ["env.task_ids=[0,3]", "env.num_eval_init_states=4", "env.max_steps=24"])
    env = make_env(cfg, seed=1)
    assert isinstance(env, TabletopEnv) and env.task_ids == [0, 3]
    assert env.init_state_ids(3, "eval") == [builtin.EVAL_ID_OFFSET + i for i in range(4)]
    assert len(env.init_state_ids(3, "val")) == cfg.env.num_val_init_states
    assert env.max_steps(0) == 24
    env2 = copy.deepcopy(env)  # batched evaluation copies envs
    assert np.array_equal(env2.reset(0, 1).image, env.reset(0, 1).image)


def test_the_named_blocks_cell_lies_in_its_splits_cells_and_success_is_counted_by_it():
    env = TabletopEnv(task_ids=list(range(len(TASKS))), num_train_init_states=30, num_eval_init_states=30,
                      num_val_init_states=30)
    want = {"train": {2, 3, 4}, "val": {builtin.VAL_CLASS}, "eval": {builtin.HELD_OUT_CLASS}}
    for split, classes in want.items():
        for task_id, spec in enumerate(TASKS):
            for sid in env.init_state_ids(task_id, split):
                cell = builtin.named_block_cell(task_id, sid)
                if spec.kind == "touch":
                    assert cell is None
                    continue
                col, row = cell
                assert 0 <= col < 6 and 0 <= row < 4 and (col + 2 * row) % 5 in classes, (split, task_id, sid)
                env.reset(task_id, sid)
                block = env.things[builtin.BLOCKS.index(spec.block)].pos
                assert (np.floor((block - (-0.75, -0.25)) / builtin.CELL) == (col, row)).all()
    outcomes = [(0, 200_000, True), (0, 200_001, False), (6, 200_000, True)]
    cells = [builtin.named_block_cell(0, 200_000), builtin.named_block_cell(0, 200_001)]
    got = builtin.success_by_cell(outcomes)
    assert sum(c["episodes"] for c in got.values()) == 2   # the touch task's episode has no named block
    if cells[0] != cells[1]:
        assert got[f"{cells[0][0]},{cells[0][1]}"] == {"successes": 1, "episodes": 1}
        assert got[f"{cells[1][0]},{cells[1][1]}"] == {"successes": 0, "episodes": 1}
    else:
        assert got[f"{cells[0][0]},{cells[0][1]}"] == {"successes": 1, "episodes": 2}
