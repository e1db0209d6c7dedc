"""Message schema: round trip of every kind, and strict validation of hostile input."""

import dataclasses

import msgpack
import numpy as np
import pytest

from async_vla import messages as M


def make_traj(calls=3, side=16, tokens=56, version=2, seed=0, **kw):
    rng = np.random.default_rng(seed)
    fields = dict(
        run_id="r", actor_id=1, group_id="g1", traj_id=f"t{seed}", task_id=0, init_state_id=4,
        instruction="put the red block on the green pad", behaviour_version=version, success=True, reward=1.0,
        env_steps=calls * 8, t_start=1.0, t_end=2.0, group_size=8,
        chunk_versions=np.arange(version, version + calls, dtype=np.int64),
        images=rng.integers(0, 255, (calls, side, side, 3), dtype=np.uint8),
        proprio=rng.standard_normal((calls, 8)).astype(np.float32),
        action_tokens=rng.integers(31744, 32000, (calls, tokens)).astype(np.int64),
        behav_logprobs=-rng.random((calls, tokens)).astype(np.float32),
        token_mask=np.ones((calls, tokens), bool),
    )
    fields.update(kw)
    return M.Trajectory(**fields)


def assert_same(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


EXAMPLES = [
    make_traj(),
    make_traj(wrist_images=np.zeros((3, 16, 16, 3), np.uint8)),
    M.GrantRequest(actor_id=2, want=1, policy_version=3),
    M.AdmissionGrant(actor_id=2, group_ids=["r-g1", "r-g2"], learner_version=3, max_staleness=2),
    M.Heartbeat(actor_id=2, pid=123, policy_version=3, state="rollout"),
    M.ActorStats(actor_id=2, interval_s=1.0, env_steps=100, successes_by_task={"0": 3}, episodes_by_task={"0": 8}),
    M.BatchRequest(rank=1, world=2, version=7),
    M.BatchHeader(batch_id=3, group_sizes=[8, 8], version=7, ready=True),
    M.ControlCommand(command="set_max_staleness", value=4),
    M.Shutdown(reason="done"),
    M.WeightsFetch(name="v3.safetensors", offset=8, max_bytes=1024),
    M.WeightsChunk(name="v3.safetensors", version=3, offset=8, total=100, data=np.arange(16, dtype=np.uint8)),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip_every_kind(msg):
    assert_same(msg, M.decode(M.encode(msg)))


def test_every_kind_has_an_example():
    assert {m.KIND for m in EXAMPLES} == set(M.MESSAGE_TYPES)


def test_libero_sized_trajectory_round_trip():
    traj = make_traj(calls=64, side=224, tokens=56)
    frames = M.encode(traj)
    assert sum(memoryview(f).nbytes for f in frames) > 9_000_000
    assert_same(traj, M.decode([bytes(f) for f in frames], max_bytes=64 * 1024**2))


def test_bundle_round_trip():
    header = M.BatchHeader(batch_id=1, group_sizes=[2], version=0, ready=True)
    h, members = M.decode_bundle(M.encode_bundle(header, [make_traj(seed=1), make_traj(seed=2)]))
    assert_same(h, header)
    assert [m.traj_id for m in members] == ["t1", "t2"]


def test_a_relay_forwards_the_frames_it_received_and_re_encodes_a_changed_copy():
    sent = [bytes(f) for f in M.encode(make_traj(seed=1))]
    got = M.decode(sent)
    forwarded = M.frames_of(got)
    assert len(forwarded) == len(sent) and all(a is b for a, b in zip(forwarded, sent))   # as received
    changed = dataclasses.replace(got, reward=0.5)
    assert M.decode([bytes(f) for f in M.frames_of(changed)]).reward == 0.5
    assert M.frames_of(make_traj(seed=2))[0] == M.encode(make_traj(seed=2))[0]   # never received: encoded
    header = M.BatchHeader(batch_id=1, group_sizes=[1], version=0, ready=True)
    _, members = M.decode_bundle([bytes(f) for f in M.encode_bundle(header, [got])])
    assert_same(members[0], got)


def _header(frames):
    return msgpack.unpackb(bytes(frames[0]))


def _with_header(frames, header):
    return [msgpack.packb(header)] + [bytes(f) for f in frames[1:]]


def mutate(case):
    frames = M.encode(make_traj())
    h = _header(frames)
    if case == "schema_version":
        h["v"] = 99
    elif case == "unknown_kind":
        h["k"] = "pickle"
    elif case == "dtype":
        h["a"][1][1] = "float64"
    elif case == "shape_lie":
        h["a"][1][2] = [3, 16, 16, 4]
    elif case == "negative_version":
        h["f"]["behaviour_version"] = -1
    elif case == "type":
        h["f"]["task_id"] = "zero"
    elif case == "bool_as_int":
        h["f"]["task_id"] = True
    elif case == "unknown_field":
        h["f"]["__reduce__"] = "os.system"
    elif case == "missing_field":
        del h["f"]["traj_id"]
    elif case == "frame_count":
        return _with_header(frames, h)[:-1]
    elif case == "object_dtype":
        h["a"][1][1] = "object"
    elif case == "huge_shape":
        h["a"][1][2] = [2**30, 2**30, 2**30, 3]
    if case == "nan_logprob":
        t = make_traj()
        t.behav_logprobs[0, 0] = np.nan
        return [bytes(f) for f in M.encode(t)]
    if case == "inf_proprio":
        t = make_traj()
        t.proprio[0, 0] = np.inf
        return [bytes(f) for f in M.encode(t)]
    return _with_header(frames, h)


@pytest.mark.parametrize("case, reason", [
    ("schema_version", "schema_version"), ("unknown_kind", "unknown_kind"), ("dtype", "dtype"),
    ("shape_lie", "size_mismatch"), ("negative_version", "negative_version"), ("type", "type"),
    ("bool_as_int", "type"), ("unknown_field", "unknown_field"), ("missing_field", "missing_field"),
    ("frame_count", "frame_count"), ("object_dtype", "dtype"), ("huge_shape", "size_mismatch"),
    ("nan_logprob", "bad_logprob"), ("inf_proprio", "bad_proprio"),
])
def test_malformed_inputs_raise_one_error_type_with_reason(case, reason):
    with pytest.raises(M.MalformedMessage) as err:
        M.decode(mutate(case))
    assert err.value.reason == reason


def test_oversize_rejected_before_allocation():
    frames = M.encode(make_traj(calls=8, side=64))
    with pytest.raises(M.MalformedMessage) as err:
        M.decode(frames, max_bytes=1000)
    assert err.value.reason == "oversize"


def test_version_mismatch_and_padding_rules():
    with pytest.raises(M.MalformedMessage, match="version_mismatch"):
        M.decode(M.encode(make_traj(version=2, chunk_versions=np.array([3, 3, 4]))))
    # NaN in a padded (masked) position is fine: it is never trained on.
    t = make_traj()
    t.token_mask[0, :5] = False
    t.behav_logprobs[0, :5] = np.nan
    assert M.decode(M.encode(t)).traj_id == t.traj_id


def test_garbage_never_raises_anything_but_malformed():
    rng = np.random.default_rng(0)
    for i in range(2000):
        frames = [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 4)))]
        with pytest.raises(M.MalformedMessage):
            M.decode(frames)
