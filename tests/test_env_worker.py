"""SubprocessEnv: a hung step and a crashing simulator are survived, counted and the env keeps working."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from async_vla.config import load_config
from async_vla.envs.base import Env, Observation
from actors.env_worker import EnvCrashed, RemoteEnvError, SubprocessEnv, make_isolated_env, step_many
from timing import slack

HANG, SEGFAULT, EXIT, RAISE = 1.0, 2.0, 3.0, 4.0  # action[0] values that make the dummy env misbehave


class DummyEnv(Env):
    """A tiny deterministic env whose step misbehaves on command (runs inside the worker child)."""

    def __init__(self, seed: int):
        self.task_ids = [0, 1]
        self.obs_image_size = 8
        self.proprio_dim = 3
        self.seed = seed
        self.t = 0

    def instruction(self, task_id):
        if task_id not in self.task_ids:
            raise ValueError(f"no task {task_id}")
        return f"task {task_id}"

    def init_state_ids(self, task_id, split):
        return [0, 1] if split == "train" else [2]

    def max_steps(self, task_id):
        return 5

    def _obs(self):
        img = np.full((8, 8, 3), self.t, dtype=np.uint8)
        return Observation(image=img, proprio=np.array([self.t, os.getpid(), self.seed], dtype=np.float32))

    def reset(self, task_id, init_state_id):
        self.t = 0
        return self._obs()

    def step(self, action):
        kind = float(action[0])
        if kind == HANG:
            time.sleep(60)
        elif kind == SEGFAULT:
            os.kill(os.getpid(), signal.SIGSEGV)
        elif kind == EXIT:
            os._exit(3)
        elif kind == RAISE:
            raise FloatingPointError("simulator unstable")
        self.t += 1
        return self._obs(), self.t >= 5, False


def dummy_factory(cfg, seed):
    return DummyEnv(seed)


def broken_factory(cfg, seed):
    raise ImportError("no simulator here")


def _act(kind: float = 0.0) -> np.ndarray:
    a = np.zeros(7, dtype=np.float32)
    a[0] = kind
    return a


@pytest.fixture
def env():
    cfg = load_config(overrides=["env.step_timeout_s=1.0", "env.worker_start_timeout_s=60"])
    e = SubprocessEnv(cfg, seed=7, factory=dummy_factory)
    yield e
    e.close()


def test_forwards_the_interface(env):
    assert env.task_ids == [0, 1] and env.obs_image_size == 8 and env.proprio_dim == 3
    assert env.instruction(1) == "task 1"
    assert env.init_state_ids(0, "train") == [0, 1] and env.init_state_ids(0, "eval") == [2]
    assert env.max_steps(0) == 5
    obs = env.reset(0, 0)
    assert obs.image.shape == (8, 8, 3) and obs.image.dtype == np.uint8
    assert obs.proprio[1] == env.pid != os.getpid() and obs.proprio[2] == 7
    obs, done, success = env.step(_act())
    assert obs.proprio[0] == 1 and not done and not success


def test_hung_step_times_out_and_restarts(env):
    env.reset(0, 0)
    old_pid = env.pid
    t0 = time.monotonic()
    with pytest.raises(EnvCrashed) as info:
        env.step(_act(HANG))
    assert info.value.reason == "timeout"
    assert time.monotonic() - t0 < min(slack(15), 55)  # the 1 s budget, plus the kill; never the 60 s sleep
    assert (env.timeouts, env.crashes, env.restarts) == (1, 0, 1)
    assert env.pid != old_pid
    obs = env.reset(0, 1)  # the new worker serves the next episode
    assert obs.proprio[1] == env.pid
    assert env.step(_act())[0].proprio[0] == 1


@pytest.mark.parametrize("kind, expect", [(SEGFAULT, "SIGSEGV"), (EXIT, "exit code 3")])
def test_crashing_worker_is_survived_and_counted(env, kind, expect):
    env.reset(0, 0)
    old_pid = env.pid
    with pytest.raises(EnvCrashed) as info:
        env.step(_act(kind))
    assert info.value.reason == "crash" and expect in str(info.value)
    assert (env.crashes, env.timeouts, env.restarts) == (1, 0, 1)
    assert env.pid != old_pid
    env.reset(0, 0)
    assert env.step(_act())[0].proprio[0] == 1
    # a second crash is counted too
    with pytest.raises(EnvCrashed):
        env.step(_act(kind))
    assert (env.crashes, env.restarts) == (2, 2)


def test_exception_in_step_restarts_but_query_errors_do_not(env):
    env.reset(0, 0)
    with pytest.raises(EnvCrashed) as info:
        env.step(_act(RAISE))
    assert info.value.reason == "error" and "FloatingPointError" in info.value.detail
    assert (env.errors, env.restarts) == (1, 1)
    pid = env.pid
    with pytest.raises(RemoteEnvError, match="no task 9"):
        env.instruction(9)
    assert env.pid == pid and env.restarts == 1


def test_broken_factory_fails_at_construction():
    cfg = load_config()
    with pytest.raises(RuntimeError, match="no simulator here"):
        SubprocessEnv(cfg, seed=0, factory=broken_factory)


def test_builtin_env_through_worker_matches_inline():
    cfg = load_config(overrides=["env.kind=builtin", "env.worker=subprocess"])
    inline = make_isolated_env(load_config(overrides=["env.kind=builtin"]), seed=3)
    isolated = make_isolated_env(cfg, seed=3)
    try:
        assert isinstance(isolated, SubprocessEnv) and not isinstance(inline, SubprocessEnv)
        assert isolated.task_ids == inline.task_ids
        task = inline.task_ids[0]
        state = inline.init_state_ids(task, "train")[0]
        a, b = inline.reset(task, state), isolated.reset(task, state)
        np.testing.assert_array_equal(a.image, b.image)
        rng = np.random.default_rng(0)
        for _ in range(5):
            act = rng.uniform(-1, 1, 7).astype(np.float32)
            (oa, da, sa), (ob, db, sb) = inline.step(act), isolated.step(act)
            np.testing.assert_array_equal(oa.image, ob.image)
            np.testing.assert_allclose(oa.proprio, ob.proprio)
            assert (da, sa) == (db, sb)
            if da:
                break
    finally:
        isolated.close()
        inline.close()


def test_step_many_isolates_one_crash():
    cfg = load_config(overrides=["env.step_timeout_s=1.0", "env.worker_start_timeout_s=60"])
    envs = [SubprocessEnv(cfg, seed=s, factory=dummy_factory) for s in range(3)]
    try:
        for e in envs:
            e.reset(0, 0)
        results = step_many(envs, [_act(), _act(SEGFAULT), _act(HANG)])
        assert results[0][0].proprio[0] == 1
        assert isinstance(results[1], EnvCrashed) and results[1].reason == "crash"
        assert isinstance(results[2], EnvCrashed) and results[2].reason == "timeout"
        assert [(e.crashes, e.timeouts) for e in envs] == [(0, 0), (1, 0), (0, 1)]
        envs[1].reset(0, 0)
        envs[2].reset(0, 0)
        results = step_many(envs, [_act()] * 3)
        assert [r[0].proprio[0] for r in results] == [2, 1, 1]
    finally:
        for e in envs:
            e.close()
