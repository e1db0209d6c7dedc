"""GroupRollout and SerialActor in one process: lock-step groups, versions per chunk, swap modes, crashes, spread.

Stand-ins (a scripted policy and env) live here only; the real built-in env and tiny policy are used where the
behaviour under test does not need scripted episode lengths.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

# actors.actor (torch) is imported inside tests: env worker children re-import this module and stay light.
from actors.rollout import GroupRollout, GroupSpec
from actors.status import parse_connect
from async_vla.config import load_config
from async_vla.envs.base import Env, Observation
from async_vla.messages import ROOT, AdmissionGrant, PolicyTag, Trajectory, decode, encode
from async_vla.tokenizer import ActionTokenizer

CHUNK, DOF = 8, 7


class ScriptedPolicy:
    """Uniform random action tokens with their exact log-prob; counts calls and batch sizes."""

    def __init__(self):
        self.tokenizer = ActionTokenizer(chunk_size=CHUNK, action_dim=DOF)
        self.tokens_per_call = CHUNK * DOF
        self.batches: list[int] = []

    def act(self, images, proprio, instructions, temperature, generator=None, greedy=None):
        assert greedy is None
        assert images.dtype == np.uint8 and images.ndim == 4 and len(instructions) == len(images) == len(proprio)
        self.batches.append(len(images))
        rng = np.random.default_rng(len(self.batches))
        idx = rng.integers(0, 256, size=(len(images), self.tokens_per_call))
        return self.tokenizer.index_to_token(idx).astype(np.int64), np.full(idx.shape, -np.log(256), np.float32)

    def decode_actions(self, tokens):
        return self.tokenizer.decode_actions(tokens)


class Crash(RuntimeError):
    """Stand-in for actors.env_worker.EnvCrashed."""


class ScriptedEnv(Env):
    """Episode ends after ``length`` steps (success if ``success``); may crash at step ``crash_at``."""

    task_ids = [0, 1]
    obs_image_size = 8
    proprio_dim = 3

    def __init__(self, length=20, success=False, crash_at=None, limit=100, die_at=None):
        self.length, self.success, self.crash_at, self.limit = length, success, crash_at, limit
        self.die_at = die_at
        self.resets: list[tuple[int, int]] = []
        self.steps = 0

    def instruction(self, task_id):
        return f"task {task_id}"

    def init_state_ids(self, task_id, split):
        return list(range(5)) if split == "train" else [100, 101]

    def max_steps(self, task_id):
        return self.limit

    def _obs(self):
        return Observation(np.full((8, 8, 3), self.steps, np.uint8), np.full(3, self.steps, np.float32))

    def reset(self, task_id, init_state_id):
        self.resets.append((task_id, init_state_id))
        self.steps = 0
        return self._obs()

    def step(self, action):
        assert action.shape == (DOF,)
        if self.crash_at is not None and self.steps == self.crash_at:
            raise Crash("simulator died")
        if self.die_at is not None and self.steps == self.die_at:
            os._exit(3)  # a segfaulting simulator, as seen from outside
        self.steps += 1
        done = self.steps >= self.length
        return self._obs(), done, done and self.success

    def close(self):
        pass


def make_rollout(envs, policy=None, **kw):
    versions = kw.pop("versions", None)
    state = {"v": 0}
    swaps = []

    def maybe_swap():
        swaps.append(state["v"])
        if versions is not None:
            state["v"] = versions(len(swaps))

    ro = GroupRollout(policy or ScriptedPolicy(), envs, run_id="r", actor_id=3, temperature=1.6,
                      policy_tag=lambda: PolicyTag(ROOT, state["v"]), maybe_swap=maybe_swap, crash_types=(Crash,),
                      **kw)
    return ro, swaps


def roundtrip(traj: Trajectory) -> Trajectory:
    out = decode([bytes(f) for f in encode(traj)])
    assert isinstance(out, Trajectory)
    return out


# ------------------------------------------------------------------------------------------ scripted
def test_lockstep_mid_chunk_finish_masks_unexecuted_tokens():
    lengths = [3, 8, 13, 20]
    envs = [ScriptedEnv(length=n, success=(n % 2 == 1)) for n in lengths]
    policy = ScriptedPolicy()
    ro, _ = make_rollout(envs, policy)
    trajs = [roundtrip(t) for t in ro.run(GroupSpec("r-g7", 1, 4, group_size=4))]
    assert [t.env_steps for t in trajs] == lengths  # streamed in the order episodes finish
    assert policy.batches == [4, 2, 1]  # one batched call per chunk over the envs still running
    for t, n in zip(trajs, lengths):
        assert t.num_calls == -(-n // CHUNK)
        assert int(t.token_mask.sum()) == n * DOF
        flat = t.token_mask.reshape(-1)
        assert flat[:n * DOF].all() and not flat[n * DOF:].any()  # executed steps first, never the rest
        assert t.success == (n % 2 == 1) and t.reward == float(t.success)
        assert (t.group_id, t.task_id, t.init_state_id, t.group_size, t.actor_id) == ("r-g7", 1, 4, 4, 3)
        assert t.instruction == "task 1" and t.t_end >= t.t_start
    assert len({t.traj_id for t in trajs}) == 4
    assert all(e.resets == [(1, 4)] for e in envs)
    assert ro.stats.groups == 1 and ro.stats.env_steps == sum(lengths) and ro.stats.episodes == 4


def test_swap_between_chunks_records_each_chunk_version():
    envs = [ScriptedEnv(length=30), ScriptedEnv(length=12)]
    ro, swaps = make_rollout(envs, versions=lambda n: 5 + n)  # every swap point brings a new version
    trajs = list(ro.run(GroupSpec("g", 0, 0, group_size=2)))
    by_len = {t.env_steps: t for t in trajs}
    assert by_len[30].chunk_versions.tolist() == [6, 7, 8, 9]
    assert by_len[12].chunk_versions.tolist() == [6, 7]
    assert by_len[30].behaviour_version == 6  # the oldest chunk sets staleness
    assert roundtrip(by_len[30]).chunk_versions.tolist() == [6, 7, 8, 9]


def test_between_episodes_never_swaps_mid_episode():
    envs = [ScriptedEnv(length=30), ScriptedEnv(length=17)]
    ro, swaps = make_rollout(envs, versions=lambda n: n, swap="between_episodes")
    spec = GroupSpec("g", 0, 0, group_size=4)  # 4 members on 2 envs: two waves, a swap point before each
    trajs = list(ro.run(spec))
    assert len(trajs) == 4 and len(swaps) == 2
    for t in trajs:
        assert len(set(t.chunk_versions.tolist())) == 1
    assert sorted({int(t.behaviour_version) for t in trajs}) == [1, 2]
    assert sorted(int(t.traj_id.rsplit("m", 1)[1]) for t in trajs) == [0, 1, 2, 3]


def test_env_crash_abandons_only_that_episode():
    envs = [ScriptedEnv(length=10), ScriptedEnv(length=10, crash_at=4), ScriptedEnv(length=10)]
    ro, _ = make_rollout(envs)
    trajs = list(ro.run(GroupSpec("g", 0, 0, group_size=3)))
    assert sorted(t.traj_id for t in trajs) == ["g/m0", "g/m2"]
    assert ro.stats.env_crashes == 1 and ro.stats.episodes == 2


def test_parallel_env_calls_match_serial():
    runs = []
    for parallel in (False, True):
        envs = [ScriptedEnv(length=n) for n in (5, 9, 17)]
        ro, _ = make_rollout(envs, parallel=parallel)
        runs.append([(t.traj_id, t.env_steps, t.token_mask.sum()) for t in ro.run(GroupSpec("g", 0, 1, 3))])
        ro.close()
    assert runs[0] == runs[1]


def dying_env(cfg, seed):
    """Env factory for the isolated worker: member 1's simulator process dies at step 6."""
    return ScriptedEnv(length=12, die_at=6 if seed == 1 else None)


def test_isolated_env_process_death_costs_one_episode():
    from actors.env_worker import SubprocessEnv

    cfg = load_config(None, [])
    envs = [SubprocessEnv(cfg, seed, factory=dying_env) for seed in range(3)]
    try:
        ro = GroupRollout(ScriptedPolicy(), envs, run_id="r", actor_id=0, temperature=1.0,
                          policy_tag=lambda: PolicyTag(ROOT, 0))
        assert ro._pool is not None  # isolated workers are stepped concurrently
        trajs = list(ro.run(GroupSpec("g", 0, 0, 3)))
        assert sorted(t.traj_id for t in trajs) == ["g/m0", "g/m2"]
        assert ro.stats.env_crashes == 1 and envs[1].crashes == 1
        ro.close()
    finally:
        for e in envs:
            e.close()


def test_stop_abandons_group():
    envs = [ScriptedEnv(length=30) for _ in range(2)]
    calls = []
    ro, _ = make_rollout(envs, should_stop=lambda: len(calls) >= 2, tick=lambda: calls.append(1))
    assert list(ro.run(GroupSpec("g", 0, 0, group_size=2))) == []
    assert ro.stopped and ro.stats.groups == 0


def test_step_limit_ends_episode_without_success():
    ro, _ = make_rollout([ScriptedEnv(length=999, limit=10)] * 1)
    ts = list(ro.run(GroupSpec("g", 0, 0, group_size=2)))      # one env: the two members run one after the other
    assert [t.traj_id for t in ts] == ["g/m0", "g/m1"]
    assert all(t.env_steps == 10 and not t.success and t.group_size == 2 for t in ts)


def test_parse_connect():
    from actors.actor import stable_hash

    assert parse_connect("tcp://10.0.0.2:6000") == {"trajectory": "tcp://10.0.0.2:6000",
                                                   "control": "tcp://10.0.0.2:6001"}
    assert parse_connect("tcp://a:1,tcp://b:2") == {"trajectory": "tcp://a:1", "control": "tcp://b:2"}
    with pytest.raises(ValueError):
        parse_connect("localhost")
    assert stable_hash("x", 1) == stable_hash("x", 1) != stable_hash("x", 2)


# ------------------------------------------------------------------------------------------ real env + policy
@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["actor.group_size=4", "env.envs_per_actor=4", "policy.hidden_size=32",
                              "policy.intermediate_size=64", "policy.num_layers=1", "buffer.dynamic_sampling=false",
                              "run.name=rt"])


@pytest.fixture(scope="module")
def policy(cfg):
    from async_vla.policy import build_policy

    return build_policy(cfg).eval()


def builtin_envs(cfg, n):
    from async_vla.envs import make_env

    return [make_env(cfg, i) for i in range(n)]


def test_real_env_and_policy_group_roundtrip(cfg, policy):
    from actors.actor import SerialActor

    envs = builtin_envs(cfg, 4)
    actor = SerialActor(cfg, 1, policy, envs, tag=PolicyTag("l", 2))
    trajs = actor.run_one_group(AdmissionGrant(actor_id=1, group_ids=["rt-g5"], learner_version=2))
    assert len(trajs) == 4
    spec = actor.spec_for("rt-g5")
    assert spec.task_id == actor.task_ids[5 % len(actor.task_ids)]
    assert spec.init_state_id in envs[0].init_state_ids(spec.task_id, "train")
    for t in map(roundtrip, trajs):
        assert (t.group_id, t.group_size, t.run_id, t.actor_id) == ("rt-g5", 4, "rt", 1)
        assert t.task_id == spec.task_id and t.init_state_id == spec.init_state_id
        assert t.chunk_versions.tolist() == [2] * t.num_calls and t.tag == PolicyTag("l", 2)
        assert t.images.shape[1:] == (cfg.env.image_size, cfg.env.image_size, 3)
        assert t.action_tokens.shape[1] == cfg.tokens_per_call
        assert int(t.token_mask.sum()) == t.env_steps * cfg.policy.action_dim
        assert t.env_steps <= envs[0].max_steps(t.task_id)
        assert (t.behav_logprobs <= 0).all() and np.isfinite(t.behav_logprobs).all()


def test_actors_practise_only_their_tasks_and_first_init_states(cfg, policy):
    """actor.task_ids and actor.num_init_states narrow the groups' scenes to a subset of the env's train split;
    tasks still take turns by the group counter."""
    from actors.actor import SerialActor

    envs = builtin_envs(cfg, 1)
    tasks = list(envs[0].task_ids)
    narrow = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"task_ids": tasks[1:3],
                                                                           "num_init_states": 2})})
    actor = SerialActor(narrow, 0, policy, envs)
    specs = [actor.spec_for(f"rt-g{n}") for n in range(40)]
    assert [s.task_id for s in specs] == [tasks[1 + n % 2] for n in range(40)]
    for task in tasks[1:3]:
        first_two = envs[0].init_state_ids(task, "train")[:2]
        assert {s.init_state_id for s in specs if s.task_id == task} == set(first_two)


def test_actors_practise_the_chosen_init_states(cfg, policy):
    """actor.init_state_ids: every group's scene is one of the chosen train init states, and each is visited."""
    from actors.actor import SerialActor

    envs = builtin_envs(cfg, 1)
    task = list(envs[0].task_ids)[0]
    train = envs[0].init_state_ids(task, "train")
    chosen = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"task_ids": [task],
                                                                           "init_state_ids": [3, 0, 5]})})
    actor = SerialActor(chosen, 0, policy, envs)
    assert {actor.spec_for(f"rt-g{n}").init_state_id for n in range(60)} == {train[3], train[0], train[5]}


def test_sampled_dims_take_the_others_greedily_and_mask_them_out_of_the_loss(cfg, policy):
    """actor.sampled_dims=[0, 6]: dimensions 1-5 are the argmax (identical for every member on its first call,
    where all see one observation) and their tokens never enter the loss; dims 0 and 6 are sampled and trained."""
    from actors.actor import SerialActor

    import torch

    dims_cfg = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"sampled_dims": [0, 6]})})
    actor = SerialActor(dims_cfg, 0, policy, builtin_envs(cfg, 4), tag=PolicyTag("l", 0))
    trajs = list(map(roundtrip, actor.run_one_group("rt-g2")))
    dof = cfg.policy.action_dim
    dim = np.arange(cfg.tokens_per_call) % dof
    sampled = np.isin(dim, [0, 6])
    firsts = np.stack([t.action_tokens[0] for t in trajs])
    assert (firsts[:, ~sampled] == firsts[:1, ~sampled]).all()        # greedy: one value per position
    assert len({tuple(row) for row in firsts[:, sampled]}) > 1          # sampled at T = 1.6: members differ
    t = trajs[0]
    idx = policy.tokenizer.token_to_index(torch.tensor(np.array(t.action_tokens[:1])))
    with torch.no_grad():
        logits = policy.action_logits(t.images[:1], t.proprio[:1], [actor.envs[0].instruction(t.task_id)], idx)
    assert torch.equal(logits.argmax(-1)[0, ~torch.from_numpy(sampled)], idx[0, ~torch.from_numpy(sampled)])
    for t in trajs:
        assert not t.token_mask[:, ~sampled].any()                       # greedy tokens: never trained
        assert int(t.token_mask.sum()) == t.env_steps * 2                # two sampled dims per executed step
    with pytest.raises(ValueError, match="sampled_dims"):
        GroupRollout(policy, builtin_envs(cfg, 1), run_id="rt", actor_id=0, temperature=1.6,
                     policy_tag=lambda: PolicyTag("l", 0), sampled_dims=[7])


def test_real_swap_between_chunks_with_weights(cfg, policy):
    """A new state dict arrives between chunks: later calls carry the new version, behaviour_version the oldest."""
    from actors.actor import SerialActor

    import torch

    original = {k: v.clone() for k, v in policy.state_dict().items()}
    # Different weights, so "the policy holds them" can only be true if the swap happened.
    state = {k: v + 0.01 if v.is_floating_point() else v.clone() for k, v in original.items()}
    offers = iter([None, (PolicyTag("l", 7), state), None, None, None, None])
    actor = SerialActor(cfg, 0, policy, builtin_envs(cfg, 4), tag=PolicyTag("l", 6),
                        weights_source=lambda: next(offers, None))
    try:
        trajs = actor.run_one_group("rt-g1")
        for t in trajs:
            assert t.chunk_versions[0] == 6 and (t.chunk_versions[1:] == 7).all() and t.behaviour_version == 6
        assert actor.version == 7 and actor.totals.swaps == 1
        with torch.no_grad():
            assert all(torch.equal(policy.state_dict()[k], v) for k, v in state.items())
            assert not all(torch.equal(policy.state_dict()[k], v) for k, v in original.items())
        # A new learner's weights (another lineage) arriving mid-group wait for the group to end: every
        # trajectory of a group carries one lineage, and the next group starts with them.
        offers = iter([None, (PolicyTag("m", 3), original), None, None, None, None])
        first = actor.run_one_group("rt-g2")
        assert all(t.lineage == "l" and set(t.chunk_versions.tolist()) == {7} for t in first)
        assert actor.tag == PolicyTag("l", 7)
        second = actor.run_one_group("rt-g3")
        assert actor.tag == PolicyTag("m", 3) and all(t.tag == PolicyTag("m", 3) for t in second)
    finally:
        policy.load_state_dict(original)  # the policy fixture is shared with the module's other tests


def test_a_groups_scene_follows_the_run_seed_and_counter_not_the_random_token(cfg, policy):
    """Two buffers of one seed (a run and its repeat) issue different random ids; the n-th group of each gets the
    same task and init state, so a serial run draws the same scenes every time. Another seed draws others."""
    from actors.actor import SerialActor

    from async_vla.buffer import GroupBuffer

    def first_ids(buf):
        return [gid for actor_id in range(8) for gid in buf.grant(actor_id, 4)]

    ids_a, ids_b = first_ids(GroupBuffer.from_config(cfg, "rt")), first_ids(GroupBuffer.from_config(cfg, "rt"))
    assert len(ids_a) == len(ids_b) > 8 and set(ids_a).isdisjoint(ids_b)
    actor = SerialActor(cfg, 0, policy, builtin_envs(cfg, 1))
    scenes_a = [(s.task_id, s.init_state_id) for s in map(actor.spec_for, ids_a)]
    assert scenes_a == [(s.task_id, s.init_state_id) for s in map(actor.spec_for, ids_b)]
    other_seed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": cfg.run.seed + 1})})
    other = SerialActor(other_seed, 0, policy, builtin_envs(cfg, 1))
    assert [(s.task_id, s.init_state_id) for s in map(other.spec_for, ids_a)] != scenes_a


def test_a_granted_group_assembles_in_group_buffer(cfg, policy):
    """Any actor picks the same task and init state for a group id; one actor's group completes in the buffer."""
    from actors.actor import SerialActor

    from async_vla.buffer import GroupBuffer
    from async_vla.transport import LocalPipe

    pipe, buf = LocalPipe(), GroupBuffer.from_config(cfg, "rt")
    gid = buf.grant(1, 1)[0]                 # granted to actor 1: only its trajectories join
    a0 = SerialActor(cfg, 0, policy, builtin_envs(cfg, 2))
    a1 = SerialActor(cfg, 1, policy, builtin_envs(cfg, 2))
    assert a0.spec_for(gid) == a1.spec_for(gid)
    members = []
    for t in a1.run_one_group(gid):
        assert pipe.send(t, timeout_s=1.0)
        members.append(t.traj_id)
    while (msg := pipe.recv(0.0)) is not None:
        buf.add(msg)
    assert sorted(members) == [f"{gid}/m{i}" for i in range(4)]
    assert buf.ready_groups == 1 and buf.ledger["pending"] == 4
    buf.check_invariants()


def test_config_trajectory_bytes_is_what_a_full_length_episode_sends():
    # The start-up check (buffer.max_bytes >= groups_per_batch x G x cfg.trajectory_bytes) rests on this size.
    small = load_config(None, ["actor.group_size=4", "env.max_steps=20", "env.image_size=16", "run.name=tb"])
    envs = builtin_envs(small, 4)
    ro, _ = make_rollout(envs)
    sizes = {}
    for g in range(6):
        for t in ro.run(GroupSpec(f"tb-g{g}", g % 2, 0, group_size=4)):
            sizes[t.num_calls] = roundtrip(t).nbytes   # what the buffer holds after decoding
    assert small.policy_calls_per_episode == 3 and max(sizes) == 3, sizes   # 20 steps of 8-step chunks
    assert sizes[3] == small.trajectory_bytes
    assert all(n < small.trajectory_bytes for calls, n in sizes.items() if calls < 3)


def test_image_shift_stores_the_shifted_image_the_policy_acted_on(cfg, policy):
    """actor.image_shift=2: each stored image is a random shift (image_ops.random_shift's edge pad and crop) of the
    env's frame at that call, replayed from the stored actions on a fresh env; the policy's log-probs of the stored
    tokens on the stored images are the behaviour log-probs (ratio 1 at lag 0). actor.image_shift=0 stores the
    frames themselves."""
    from actors.actor import SerialActor

    import torch

    def raw_frames(t):
        env = builtin_envs(cfg, 1)[0]
        frames = [env.reset(t.task_id, t.init_state_id).image]
        for k in range(t.num_calls - 1):   # every call but the last ran its whole chunk
            frames.append(env.step_chunk(policy.decode_actions(t.action_tokens[k:k + 1])[0])[0].image)
        return frames

    def shifts(image, pad=2):
        h, w = image.shape[:2]
        padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
        return {(dy, dx): padded[dy:dy + h, dx:dx + w] for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)}

    shifted_cfg = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"image_shift": 2})})
    trajs = list(map(roundtrip, SerialActor(shifted_cfg, 0, policy, builtin_envs(cfg, 4)).run_one_group("rt-g3")))
    offsets = []
    for t in trajs:
        for stored, frame in zip(t.images, raw_frames(t), strict=True):
            offsets += [o for o, crop in shifts(frame).items() if np.array_equal(crop, stored)][:1]
        with torch.no_grad():
            logp = policy.token_logprobs(t.images, t.proprio, [t.instruction] * t.num_calls,
                                         torch.tensor(t.action_tokens), cfg.actor.temperature)
        torch.testing.assert_close(logp, torch.from_numpy(t.behav_logprobs), rtol=1e-4, atol=1e-4)
    assert len(offsets) == sum(t.num_calls for t in trajs)           # every stored image is a shift of its frame
    assert len(set(offsets)) > 1 and set(offsets) != {(2, 2)}         # ... at drawn offsets, not the identity

    plain = list(map(roundtrip, SerialActor(cfg, 0, policy, builtin_envs(cfg, 4)).run_one_group("rt-g3")))
    for t in plain:
        for stored, frame in zip(t.images, raw_frames(t), strict=True):
            np.testing.assert_array_equal(stored, frame)
    with pytest.raises(ValueError, match="actor.image_shift"):
        load_config(None, ["actor.image_shift=32", "env.image_size=32"])


class CameraEnv(ScriptedEnv):
    """ScriptedEnv with textured main and wrist images (a shift of a flat image would change nothing)."""

    @staticmethod
    def frames(steps):
        base = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
        return base + np.uint8(steps), base[::-1] * 3

    def _obs(self):
        image, wrist = self.frames(self.steps)
        return Observation(image, np.full(3, self.steps, np.float32), wrist_image=wrist)


def test_image_shift_moves_the_wrist_image_too_and_needs_a_generator():
    def is_shift(stored, frame, pad=1):
        padded = np.pad(frame, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
        return any(np.array_equal(padded[dy:dy + 8, dx:dx + 8], stored)
                   for dy in range(2 * pad + 1) for dx in range(2 * pad + 1))

    ro, _ = make_rollout([CameraEnv(length=20) for _ in range(2)], image_shift=1, shift_rng=np.random.default_rng(0))
    trajs = [roundtrip(t) for t in ro.run(GroupSpec("r-g1", 0, 0, group_size=2))]
    for t in trajs:
        for k in range(t.num_calls):
            image, wrist = CameraEnv.frames(k * CHUNK)    # the frames at call k
            assert is_shift(t.images[k], image) and is_shift(t.wrist_images[k], wrist)
    moved = [not np.array_equal(w, CameraEnv.frames(0)[1]) for t in trajs for w in t.wrist_images]
    assert any(moved)
    with pytest.raises(ValueError, match="image_shift"):
        make_rollout([CameraEnv()], image_shift=1)
