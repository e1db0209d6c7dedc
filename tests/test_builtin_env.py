"""Built-in tabletop env: interface, splits, determinism, mechanics, scripted expert, make_env."""

import copy

import numpy as np
import pytest

from async_vla.config import load_config
from async_vla.envs import builtin
from async_vla.envs.base import Env, Observation, make_env
from async_vla.envs.builtin import TASKS, TabletopEnv
from async_vla.envs.expert import ScriptedExpert, expert_episode


@pytest.fixture
def env() -> TabletopEnv:
    return TabletopEnv(num_train_init_states=40, num_eval_init_states=10)


def test_interface_and_observation(env):
    assert isinstance(env, Env)
    assert env.task_ids == list(range(len(TASKS))) and len(TASKS) >= 4
    assert {t.kind for t in TASKS} == {"pick", "place", "push", "press"}
    obs = env.reset(0, 0)
    assert isinstance(obs, Observation)
    assert obs.image.shape == (32, 32, 3) and obs.image.dtype == np.uint8
    assert obs.proprio.shape == (env.proprio_dim,) == (8,) and obs.proprio.dtype == np.float32
    assert obs.wrist_image is None
    assert env.obs_image_size == 32 and env.max_steps(0) == builtin.DEFAULT_MAX_STEPS
    for t in env.task_ids:
        assert isinstance(env.instruction(t), str) and len(env.instruction(t).split()) >= 4
    assert len({env.instruction(t) for t in env.task_ids}) == len(env.task_ids)


def test_splits_disjoint_and_sized(env):
    for t in env.task_ids:
        train, ev = env.init_state_ids(t, "train"), env.init_state_ids(t, "eval")
        assert len(train) == 40 and len(ev) == 10 and not set(train) & set(ev)
    # the held-out set does not move when the train split grows
    big = TabletopEnv(num_train_init_states=500, num_eval_init_states=10)
    assert big.init_state_ids(0, "eval") == env.init_state_ids(0, "eval")
    assert not set(big.init_state_ids(0, "train")) & set(big.init_state_ids(0, "eval"))
    with pytest.raises(ValueError):
        env.init_state_ids(0, "test")


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


def test_mechanics_grasp_carry_release():
    env = TabletopEnv()
    env.reset(1, 0)  # place task: things[0] block, things[1] pad
    block = env.things[0].pos.copy()
    env.grip = block + np.array([0.05, 0.0])
    _, _, success = env.step(np.r_[np.zeros(6), 1.0])
    assert env.held == 0 and env.closed and not success
    _, _, _ = env.step(np.r_[0.0, -1.0, np.zeros(4), 0.0])  # 0 = keep closed (hysteresis)
    assert env.held == 0 and np.allclose(env.things[0].pos, env.grip)
    env.grip = env.things[1].pos.copy()
    env.things[0].pos = env.grip.copy()
    _, done, success = env.step(np.r_[np.zeros(6), -1.0])
    assert success and done and env.held is None


def test_push_moves_block_and_open_gripper_passes_over():
    env = TabletopEnv()
    env.reset(2, 0)  # push left
    start = env.things[0].pos.copy()
    env.grip = start + np.array([0.35, 0.1])
    env.step(np.r_[np.zeros(6), -1.0])
    for _ in range(2):  # open gripper sweeping left passes over the block
        env.step(np.r_[-1.0, 0, 0, 0, 0, 0, -1.0])
    assert np.allclose(env.things[0].pos, start)
    env.grip = start + np.array([0.35, 0.1])
    env.step(np.r_[np.zeros(6), 1.0])  # close beside it: too far to grasp
    assert env.held is None
    success = False
    for _ in range(4):
        _, done, success = env.step(np.r_[-1.0, 0, 0, 0, 0, 0, 1.0])
        if done:
            break
    assert success and env.things[0].pos[0] <= start[0] - builtin.PUSH_DIST


def test_expert_solves_every_train_and_eval_state(env):
    for t in env.task_ids:
        for i in env.init_state_ids(t, "train") + env.init_state_ids(t, "eval"):
            obs, acts, success = expert_episode(env, t, i)
            assert success, (t, i)
            assert len(acts) <= 4  # a single policy call of 8 steps
            assert all(np.all(np.abs(a) <= 1.0) for a in acts)


def test_layouts_alternate_spots_and_one_demo_replays_on_half(env):
    for t in env.task_ids:
        spec, offs = TASKS[t], set()
        for i in range(40):
            env.reset(t, i)
            shift = float(env.things[0].pos[spec.axis] - spec.target_at[spec.axis])
            nearest = min(builtin.OFFSETS, key=lambda o: abs(o - shift))
            assert abs(shift - nearest) <= builtin.JITTER + 1e-9
            offs.add(nearest)
        assert offs == set(builtin.OFFSETS)
    # blind replay of one expert demo: succeeds where the target sits at the demo's spot (half the states)
    for t in env.task_ids:
        _, acts, _ = expert_episode(env, t, 0)
        wins = 0
        for i in env.init_state_ids(t, "train"):
            env.reset(t, i)
            done, k, success = False, 0, False
            while not done:
                a = acts[k] if k < len(acts) else np.r_[np.zeros(6), acts[-1][6]]
                _, done, success = env.step(a)
                k += 1
            wins += success
        assert 0.4 <= wins / 40 <= 0.6, (t, wins)


def test_expert_object_reads_state_only_after_reset(env):
    ex = ScriptedExpert()
    env.reset(3, 5)
    ex.reset(env)
    a = ex.act(env)
    assert a.shape == (7,) and a[6] == -1.0


def test_image_shows_objects_and_gripper_state(env):
    obs = env.reset(0, 3)
    red = np.array(builtin.COLOURS["red"], dtype=np.uint8)
    assert (obs.image == red).all(-1).sum() >= 9  # a visible red block
    assert (obs.image == 255).all(-1).sum() >= 4  # the open (white) gripper
    env.grip = np.array([0.9, -0.9])
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
    assert env.max_steps(0) == 24
    env2 = copy.deepcopy(env)  # batched evaluation copies envs
    assert np.array_equal(env2.reset(0, 1).image, env.reset(0, 1).image)

