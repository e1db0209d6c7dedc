"""ActionTokenizer: OpenVLA bin layout, clipping, BOUNDS_Q99 normalisation with masks, round trips."""

import numpy as np
import pytest

from async_vla.tokenizer import ActionStats, ActionTokenizer


def tok(**kw) -> ActionTokenizer:
    return ActionTokenizer(**kw)


def test_worked_values_at_bin_edges():
    t = tok()
    # digitize(-1, bins) = 1 -> 31999; digitize(1, bins) = 256 -> 31744 (the OpenVLA extremes)
    assert t.encode(np.array([-1.0]))[0] == 31999
    assert t.encode(np.array([1.0]))[0] == 31744
    assert t.first_action_id == 31744
    width = 2.0 / 255
    # exactly on the k-th edge belongs to bin k (right-open intervals)
    for k in [1, 100, 200, 254]:
        edge = t.bins[k]
        assert t.encode(np.array([edge]))[0] == 32000 - (k + 1)
        assert t.encode(np.array([edge - 1e-9]))[0] == 32000 - k
    # 0.0 lies in bin 128 ([edge 127, edge 128)) -> token 31872 -> centre index 127
    assert t.encode(np.array([0.0]))[0] == 31872
    assert t.decode(np.array([31872]))[0] == pytest.approx(-1 + 127.5 * width)
    # decode of the extremes uses the first / last centre
    assert t.decode(np.array([31999]))[0] == pytest.approx(-1 + width / 2)
    assert t.decode(np.array([31744]))[0] == pytest.approx(1 - width / 2)


def test_clipping_and_range():
    t = tok()
    ids = t.encode(np.array([-5.0, -1.0000001, 1.0000001, 7.0]))
    assert ids.tolist() == [31999, 31999, 31744, 31744]
    ids = t.encode(np.random.default_rng(0).uniform(-3, 3, size=10_000))
    assert ids.min() >= 31744 and ids.max() <= 31999 and ids.dtype == np.int64
    # decode clips ids outside the action range onto the first / last centre
    assert t.decode(np.array([40000]))[0] == t.centres[0]
    assert t.decode(np.array([100]))[0] == t.centres[-1]


def test_round_trip_error_at_most_half_a_bin():
    t = tok()
    a = np.random.default_rng(1).uniform(-1, 1, size=20_000)
    a = np.concatenate([a, [-1.0, 1.0, 0.0], -1 + np.arange(256) * t.bin_width])
    err = np.abs(t.decode(t.encode(a)) - a)
    assert err.max() <= t.bin_width / 2 + 1e-12


def test_index_mapping():
    t = tok()
    ids = np.array([31744, 31999])
    assert t.token_to_index(ids).tolist() == [0, 255]
    assert t.index_to_token(t.token_to_index(ids)).tolist() == ids.tolist()


def test_q99_normalisation_with_mask():
    st = ActionStats(q01=[-0.5, 0.0, 1.0], q99=[0.5, 2.0, 3.0], mask=[True, True, False])
    t = tok(action_dim=3, chunk_size=1, stats={"ds": st})
    assert t.unnorm_key == "ds"
    raw = np.array([[0.0, 2.0, 0.7], [-0.5, 0.0, -3.0], [9.0, -9.0, 0.25]])
    n = t.normalize(raw)
    assert n[0].tolist() == pytest.approx([0.0, 1.0, 0.7], abs=1e-6)  # the 1e-8 guard shifts values by ~1e-8
    assert n[1].tolist() == pytest.approx([-1.0, -1.0, -3.0], abs=1e-6)  # masked dim passes through unclipped
    assert n[2].tolist() == pytest.approx([1.0, -1.0, 0.25], abs=1e-6)  # clipped on masked dims
    back = t.unnormalize(n[:1])
    assert back[0].tolist() == pytest.approx([0.0, 2.0, 0.7], abs=1e-6)
    # gripper passes through the whole chunk pipeline (then binarised by the bins like OpenVLA)
    chunk = np.array([[[0.1, 1.5, 1.0]]])
    out = t.decode_actions(t.encode_actions(chunk))
    assert out.shape == (1, 1, 3) and out.dtype == np.float32
    # masked dims: half a normalised bin, scaled back by (q99 - q01) / 2
    assert abs(out[0, 0, 0] - 0.1) <= t.bin_width / 2 * (0.5 - -0.5) / 2 + 1e-6
    assert abs(out[0, 0, 1] - 1.5) <= t.bin_width / 2 * (2.0 - 0.0) / 2 + 1e-6
    assert abs(out[0, 0, 2] - 1.0) <= t.bin_width / 2 + 1e-6


def test_stats_by_key_and_errors():
    a = ActionStats.identity(7)
    b = ActionStats(q01=np.zeros(7), q99=np.full(7, 2.0), mask=np.r_[np.ones(6, bool), False])
    t = tok(stats={"a": a, "b": b})
    assert t.unnorm_key is None
    with pytest.raises(KeyError, match="unnorm_key"):
        t.normalize(np.zeros(7))
    assert t.normalize(np.full(7, 1.0), "b")[:6] == pytest.approx(np.zeros(6), abs=1e-6)
    with pytest.raises(KeyError, match="nope"):
        t.normalize(np.zeros(7), "nope")
    with pytest.raises(ValueError):
        ActionStats([0, 0], [1], [True, True])


def test_chunk_shapes_and_layout_are_step_major():
    t = tok(stats={"x": ActionStats.identity(7)})
    assert t.tokens_per_call == 56
    chunk = np.zeros((2, 8, 7))
    chunk[0, 3, 6] = 1.0  # step 3, gripper
    ids = t.encode_actions(chunk)
    assert ids.shape == (2, 56)
    assert ids[0, 3 * 7 + 6] == 31744 and ids[1, 3 * 7 + 6] == 31872
    with pytest.raises(ValueError):
        t.encode_actions(np.zeros((2, 7, 8)))
    with pytest.raises(ValueError):
        t.decode_actions(np.zeros((2, 55), dtype=np.int64))


def test_from_actions_and_persistence():
    rng = np.random.default_rng(0)
    acts = rng.normal(size=(1000, 7))
    st = ActionStats.from_actions(acts)
    assert st.mask.tolist() == [True] * 6 + [False]
    assert np.all(st.q01 < st.q99)
    t = tok(num_bins=128, chunk_size=2, stats={"k": st})
    t2 = ActionTokenizer.from_dict(t.to_dict())
    assert t2.num_bins == 128 and t2.chunk_size == 2 and t2.unnorm_key == "k"
    x = rng.normal(size=(3, 2, 7))
    assert np.array_equal(t.encode_actions(x), t2.encode_actions(x))
    assert np.allclose(t.decode_actions(t.encode_actions(x)), t2.decode_actions(t2.encode_actions(x)))


def test_configurable_bins():
    t = tok(num_bins=16, vocab_size=100)
    assert t.encode(np.array([-1.0]))[0] == 99 and t.encode(np.array([1.0]))[0] == 84
    with pytest.raises(ValueError):
        tok(num_bins=1)
