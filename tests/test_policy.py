"""Policy interface: shapes, behaviour/learner log-prob agreement, greedy, causality, save/load, OpenVLA."""

import json
import os

import numpy as np
import pytest
import torch

from async_vla.config import load_config
from async_vla.policy import VLAPolicy, build_policy, load_policy, save_policy
from async_vla.policy.build import CONFIG_FILE
from async_vla.policy.interface import sample_tokens
from async_vla.policy.model import sincos_2d, word_ids

B = 3
INSTR = ["pick up the red block", "push the yellow block to the left", "press the green button"]


def make(decoding: str, **over) -> VLAPolicy:
    cfg = load_config(None, [f"policy.decoding={decoding}"] + [f"{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    return build_policy(cfg)


def batch(seed: int = 0, b: int = B):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(b, 32, 32, 3), dtype=np.uint8)
    proprio = rng.normal(size=(b, 8)).astype(np.float32)
    return images, proprio, (INSTR * b)[:b]


@pytest.fixture(scope="module", params=["parallel", "autoregressive"])
def policy(request) -> VLAPolicy:
    return make(request.param)


def test_act_shapes_and_ranges(policy):
    images, proprio, instr = batch()
    for temp in (1.6, 1.0, 0.0):
        tokens, logp = policy.act(images, proprio, instr, temp, torch.Generator().manual_seed(1))
        assert tokens.shape == (B, 56) and tokens.dtype == np.int64
        assert logp.shape == (B, 56) and logp.dtype == np.float32
        assert tokens.min() >= 31744 and tokens.max() <= 31999
        assert np.all(logp <= 0) and np.all(np.isfinite(logp))
    assert policy.tokens_per_call == 56
    actions = policy.decode_actions(tokens)
    assert actions.shape == (B, 8, 7) and actions.dtype == np.float32 and np.all(np.abs(actions) <= 1)


@pytest.mark.parametrize("temp", [1.6, 1.0, 0.0])
def test_behaviour_logprobs_equal_learner_recomputation(policy, temp):
    images, proprio, instr = batch(1)
    tokens, logp = policy.act(images, proprio, instr, temp, torch.Generator().manual_seed(2))
    re = policy.token_logprobs(torch.from_numpy(images), torch.from_numpy(proprio), instr,
                               torch.from_numpy(tokens), temp)
    assert re.shape == (B, 56)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)


def test_logprobs_are_log_softmax_of_scaled_action_logits(policy):
    images, proprio, instr = batch(2)
    tokens, _ = policy.act(images, proprio, instr, 1.0, torch.Generator().manual_seed(3))
    idx = policy.tokenizer.token_to_index(torch.from_numpy(tokens))
    logits = policy.action_logits(images, proprio, instr, idx)
    assert logits.shape == (B, 56, 256)
    for temp in (1.6, 1.0):
        want = torch.log_softmax(logits / temp, -1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        got = policy.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), temp)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # temperature 0 reports log-probs at T = 1
    torch.testing.assert_close(policy.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 0.0),
                               policy.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.0))


def test_token_entropy_is_that_of_the_scaled_action_distribution(policy):
    images, proprio, instr = batch(2)
    tokens, _ = policy.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(3))
    idx = policy.tokenizer.token_to_index(torch.from_numpy(tokens))
    p = torch.softmax(policy.action_logits(images, proprio, instr, idx) / 1.6, -1)
    logp, ent = policy.token_logprobs_entropy(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, policy.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6))
    assert ent.shape == (B, 56) and float(ent.max()) <= float(np.log(256)) + 1e-4
    # logged only: the log-probs carry the graph the loss needs, the entropy none (no [B, T, bins] kept for backward)
    assert logp.requires_grad and not ent.requires_grad


def test_greedy_is_argmax_and_deterministic(policy):
    images, proprio, instr = batch(3)
    t1, lp1 = policy.act(images, proprio, instr, 0.0)
    t2, lp2 = policy.act(images, proprio, instr, 0.0, torch.Generator().manual_seed(9))
    assert np.array_equal(t1, t2) and np.array_equal(lp1, lp2)
    idx = policy.tokenizer.token_to_index(torch.from_numpy(t1))
    logits = policy.action_logits(images, proprio, instr, idx)
    assert torch.equal(logits.argmax(-1), idx)


def test_greedy_positions_take_the_argmax_and_report_their_logprob_at_the_temperature(policy):
    images, proprio, instr = batch(6)
    greedy = np.zeros(policy.tokens_per_call, dtype=bool)
    greedy[3::7] = greedy[4::7] = True
    tokens, logp = policy.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(2), greedy=greedy)
    idx = policy.tokenizer.token_to_index(torch.from_numpy(tokens))
    logits = policy.action_logits(images, proprio, instr, idx)      # teacher-forced: the argmax each position saw
    g = torch.from_numpy(greedy)
    assert torch.equal(logits.argmax(-1)[:, g], idx[:, g])
    assert not torch.equal(logits.argmax(-1)[:, ~g], idx[:, ~g])    # the rest are sampled at T = 1.6
    re = policy.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="greedy must be a bool mask"):
        policy.act(images, proprio, instr, 1.6, greedy=greedy[:-1])


def test_sampling_reproducible_with_generator(policy):
    images, proprio, instr = batch(4)
    a, _ = policy.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(5))
    b, _ = policy.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(5))
    c, _ = policy.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_token_logprobs_differentiable(policy):
    images, proprio, instr = batch(5)
    tokens, _ = policy.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    policy.zero_grad(set_to_none=True)
    lp = policy.token_logprobs(torch.from_numpy(images), torch.from_numpy(proprio), instr,
                               torch.from_numpy(tokens), 1.6)
    lp.sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    for name in ["stem.0.weight", "patch.weight", "kp_maps.weight", "kp_log_temp", "lang_query.weight",
                 "word_embed.weight", "proprio_proj.weight", "action_queries", "action_proj",
                 "llm.model.layers.0.self_attn.q_proj.weight"]:
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert (grads["action_start"] is not None) == (policy.decoding == "autoregressive")
    policy.zero_grad(set_to_none=True)


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_free_head_without_keypoints(decoding):
    pol = make(decoding, **{"policy.action_head": "free", "policy.keypoints": 0, "policy.lang_keypoints": 0})
    assert pol.llm.lm_head.weight.shape[0] == 3 + 256  # specials + the action rows
    images, proprio, instr = batch(10)
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    re = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)


def test_rejects_non_action_tokens(policy):
    images, proprio, instr = batch()
    bad = torch.full((B, 56), 5, dtype=torch.long)
    with pytest.raises(ValueError, match="action-token range"):
        policy.token_logprobs(images, proprio, instr, bad, 1.0)


def test_autoregressive_is_causal_and_parallel_ignores_tokens():
    images, proprio, instr = batch(6)
    ar, par = make("autoregressive"), make("parallel")
    tokens = torch.from_numpy(ar.act(images, proprio, instr, 1.0, torch.Generator().manual_seed(0))[0])
    changed = tokens.clone()
    changed[:, 30:] = 31800
    idx, idx_changed = ar.tokenizer.token_to_index(tokens), ar.tokenizer.token_to_index(changed)
    lg_a = ar.action_logits(images, proprio, instr, idx)
    lg_b = ar.action_logits(images, proprio, instr, idx_changed)
    torch.testing.assert_close(lg_a[:, :31], lg_b[:, :31], atol=1e-5, rtol=0)  # position 30 sees tokens 0..29
    assert not torch.allclose(lg_a[:, 31:], lg_b[:, 31:])
    torch.testing.assert_close(par.action_logits(images, proprio, instr, idx),
                               par.action_logits(images, proprio, instr, par.tokenizer.token_to_index(changed)))


def test_batch_rows_are_independent(policy):
    images, proprio, instr = batch(7)
    tokens, logp = policy.act(images, proprio, instr, 1.0, torch.Generator().manual_seed(0))
    single = policy.token_logprobs(images[1:2], proprio[1:2], instr[1:2], torch.from_numpy(tokens[1:2]), 1.0)
    np.testing.assert_allclose(single.detach().numpy()[0], logp[1], atol=1e-5, rtol=0)


def test_inputs_condition_the_output():
    pol = make("parallel")
    images, proprio, instr = batch(8)
    idx = None
    base = pol.action_logits(images, proprio, instr, idx)
    other_img = pol.action_logits(images[::-1].copy(), proprio, instr, idx)
    other_instr = pol.action_logits(images, proprio, instr[::-1], idx)
    other_prop = pol.action_logits(images, proprio + 1, instr, idx)
    for o in (other_img, other_instr, other_prop):
        assert not torch.allclose(base, o)


def test_word_ids_deterministic():
    a = word_ids("Pick up the RED block!", 8, 2048)
    assert a == word_ids("pick up the red block", 8, 2048)
    assert len(a[0]) == len(a[1]) == 8 and a[0][0] == 1 and a[0][-1] == 0
    assert a != word_ids("pick up the blue block", 8, 2048)
    long = word_ids(" ".join(["w"] * 50), 8, 2048)
    assert len(long[0]) == 8 and 0 not in long[0]
    # two hashes per word: no pair of words of the built-in family shares both rows
    words = {w for t in range(8) for w in __import__("async_vla.envs.builtin", fromlist=["TASKS"])
             .TASKS[t].instruction.split()}
    rows = {w: (word_ids(w, 2, 2048)[0][1], word_ids(w, 2, 2048)[1][1]) for w in words}
    assert len(set(rows.values())) == len(words)


def test_sample_tokens_matches_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    idx, logp = sample_tokens(logits.expand(20000, 4), 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(idx, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1, 0.0]), atol=0.015, rtol=0)
    assert torch.allclose(logp, torch.log(torch.tensor([0.7, 0.2, 0.1]))[idx])


def test_save_load_round_trip(tmp_path):
    pol = make("autoregressive", **{"policy.hidden_size": 64, "policy.num_heads": 2})
    images, proprio, instr = batch(9)
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    save_policy(pol, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / CONFIG_FILE).read_text())
    assert meta["policy"]["decoding"] == "autoregressive" and meta["policy"]["hidden_size"] == 64
    assert meta["tokenizer"]["unnorm_key"] == "builtin" and "builtin" in meta["tokenizer"]["stats"]
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    loaded = load_policy(tmp_path / "ckpt")
    re = loaded.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    cfg = load_config(None, [f"policy.path={tmp_path / 'ckpt'}", "policy.decoding=autoregressive",
                             "policy.hidden_size=64", "policy.num_heads=2"])
    built = build_policy(cfg)
    assert torch.equal(built.state_dict()["llm.lm_head.weight"], pol.state_dict()["llm.lm_head.weight"])
    with pytest.raises(FileNotFoundError):
        load_policy(tmp_path / "missing")


def test_a_checkpoint_keeps_its_own_architecture_and_says_which_config_fields_it_overrode(tmp_path):
    pol = make("parallel", **{"policy.patch_size": 4})
    save_policy(pol, tmp_path / "ckpt")
    cfg = load_config(None, [f"policy.path={tmp_path / 'ckpt'}", "policy.patch_size=8"])
    with pytest.warns(UserWarning, match=r"\['patch_size'\] differ from the config"):
        built = build_policy(cfg)
    assert built.policy_cfg.patch_size == 4
    images, proprio, instr = batch(2)
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    re = built.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)


def test_build_policy_is_seeded():
    a = build_policy(load_config(None, ["run.seed=3"]))
    b = build_policy(load_config(None, ["run.seed=3"]))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.openvla
@pytest.mark.skipif(not os.environ.get("ASYNC_VLA_OPENVLA_PATH"), reason="set ASYNC_VLA_OPENVLA_PATH to a local "
                    "OpenVLA / OpenVLA-OFT checkpoint directory")
def test_openvla_checkpoint_behind_the_interface():
    path = os.environ["ASYNC_VLA_OPENVLA_PATH"]
    arch = os.environ.get("ASYNC_VLA_OPENVLA_ARCH", "openvla")
    chunk = 8 if arch == "openvla_oft" else 1
    cfg = load_config(None, [f"policy.arch={arch}", f"policy.path={path}", f"policy.chunk_size={chunk}",
                             "env.image_size=224", "policy.patch_size=14",
                             f"policy.decoding={'parallel' if arch == 'openvla_oft' else 'autoregressive'}"])
    pol = build_policy(cfg)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(2, 224, 224, 3), dtype=np.uint8)
    proprio = np.zeros((2, 8), dtype=np.float32)
    instr = ["pick up the black bowl and place it on the plate"] * 2
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    assert tokens.shape == (2, pol.tokens_per_call) and tokens.min() >= 31744 and tokens.max() <= 31999
    re = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(re.detach().float().cpu().numpy(), logp, atol=1e-3, rtol=0)
    actions = pol.decode_actions(tokens)
    assert actions.shape == (2, chunk, 7) and np.all(np.isfinite(actions))


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_a_bf16_policy_takes_the_same_inputs(decoding):
    """DeepSpeed's bf16 engine (the learner on a GPU) casts the module's parameters to bf16 and leaves its buffers
    and inputs alone: uint8 images, float32 proprio, the keypoints' coordinate grids and the Fourier action basis
    must follow the parameters' dtype (found on an H200: `Input type (float) and bias type (c10::BFloat16) should be
    the same`, then `expected mat1 and mat2 to have the same dtype`). The bf16 copy then samples, recomputes and
    back-propagates, and its log-probs stay near the float32 policy's."""
    import copy

    pol = make(decoding, **{"policy.keypoints": 16, "policy.lang_keypoints": 2, "policy.action_head": "fourier"})
    half = copy.deepcopy(pol)
    for p in half.parameters():          # as DeepSpeed's bf16 engine: parameters only
        p.data = p.data.to(torch.bfloat16)
    assert any(b.dtype == torch.float32 for b in half.buffers())
    images, proprio, instr = batch(3)
    tokens, logp = half.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    assert np.all(np.isfinite(logp)) and tokens.min() >= 31744 and tokens.max() <= 31999
    re = half.token_logprobs(torch.from_numpy(images), torch.from_numpy(proprio), instr, torch.from_numpy(tokens), 1.6)
    re.sum().backward()
    assert half.stem[0].weight.grad is not None and torch.isfinite(half.stem[0].weight.grad.float()).all()
    full = pol.token_logprobs(torch.from_numpy(images), torch.from_numpy(proprio), instr, torch.from_numpy(tokens), 1.6)
    gap = (re.detach().float() - full.detach()).abs()
    assert gap.mean() < 0.05 and gap.max() < 0.5, (gap.mean(), gap.max())


def test_sincos_2d_matches_a_per_patch_reference():
    height, width, patch, dim = 32, 24, 4, 16
    code = sincos_2d(height, width, patch, dim)
    rows, cols, q = height // patch, width // patch, dim // 4
    assert code.shape == (rows * cols, dim)
    for r in range(rows):
        for c in range(cols):
            for i in range(q):
                w = 10000.0 ** (-i / q)
                want = (np.sin(c * w), np.cos(c * w), np.sin(r * w), np.cos(r * w))
                got = (code[r * cols + c, i], code[r * cols + c, q + i], code[r * cols + c, 2 * q + i],
                       code[r * cols + c, 3 * q + i])
                np.testing.assert_allclose([float(g) for g in got], want, atol=1e-6)


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_a_sincos_policy_has_no_learned_patch_code_and_keeps_its_choice_through_a_checkpoint(decoding, tmp_path):
    pol = make(decoding, **{"policy.patch_pos": "sincos", "policy.patch_size": 4})
    assert not any("patch_pos" in name for name, _ in pol.named_parameters())
    images, proprio, instr = batch(11)
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    re = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    save_policy(pol, tmp_path / "ckpt")
    loaded = load_policy(tmp_path / "ckpt")
    assert loaded.policy_cfg.patch_pos == "sincos"
    again = loaded.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(again.detach().numpy(), logp, atol=1e-5, rtol=0)


def test_a_sincos_code_needs_a_hidden_size_it_can_split_in_four():
    with pytest.raises(ValueError, match=r"policy.patch_pos=sincos .* policy.hidden_size \(18\): make it a multiple of 4"):
        load_config(None, ["policy.patch_pos=sincos", "policy.hidden_size=18", "policy.num_heads=1"])
    with pytest.raises(ValueError, match="multiple of 4"):
        sincos_2d(32, 32, 4, 18)


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_a_keypoint_only_policy_sees_the_image_through_its_keypoints_alone(decoding, tmp_path):
    pol = make(decoding, **{"policy.patch_tokens": "false", "policy.patch_size": 4})
    names = [name for name, _ in pol.named_parameters()]
    assert not any(n.startswith(("patch.", "patch_pos")) for n in names)
    images, proprio, instr = batch(12)
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    moved = images.copy()
    moved[:, 8:16, 8:16] = 255  # a white square: the keypoint maps, and so the action distribution, must see it
    lp = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(lp.detach().numpy(), logp, atol=1e-5, rtol=0)
    assert not torch.allclose(pol.token_logprobs(moved, proprio, instr, torch.from_numpy(tokens), 1.6), lp)
    pol.zero_grad(set_to_none=True)
    lp.sum().backward()
    assert pol.stem[0].weight.grad.abs().sum() > 0 and pol.kp_maps.weight.grad.abs().sum() > 0
    save_policy(pol, tmp_path / "ckpt")
    cfg = load_config(None, [f"policy.path={tmp_path / 'ckpt'}", "policy.patch_size=4", f"policy.decoding={decoding}"])
    with pytest.warns(UserWarning, match=r"\['patch_tokens'\] differ from the config"):
        loaded = build_policy(cfg)
    assert loaded.policy_cfg.patch_tokens is False
    again = loaded.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(again.detach().numpy(), logp, atol=1e-5, rtol=0)


def test_a_keypoint_only_policy_needs_keypoints():
    with pytest.raises(ValueError, match=r"policy.patch_tokens=false .* policy.keypoints is 0: set policy.keypoints"):
        load_config(None, ["policy.patch_tokens=false", "policy.keypoints=0", "policy.lang_keypoints=0"])


def test_shifted_fourier_logits_equal_the_series_evaluated_at_the_shifted_bin_coordinate():
    from async_vla.policy.model import shifted_fourier_logits
    rng = np.random.default_rng(3)
    bins, n = 64, 5
    u = np.arange(bins) / (bins - 1)
    f = np.arange(1, n + 1)
    coef = rng.normal(size=(4, 3, 1 + 2 * n))
    shift = rng.normal(size=(4, 3, 1))
    want = np.empty((4, 3, bins))
    for i in range(4):
        for j in range(3):
            for b in range(bins):
                x = u[b] - shift[i, j, 0]
                want[i, j, b] = coef[i, j, 0] + sum(coef[i, j, 1 + k] * np.cos(np.pi * f[k] * x)
                                                    + coef[i, j, 1 + n + k] * np.sin(np.pi * f[k] * x)
                                                    for k in range(n))
    basis = np.concatenate([np.ones((bins, 1)), np.cos(np.pi * u[:, None] * f), np.sin(np.pi * u[:, None] * f)], 1)
    got = shifted_fourier_logits(torch.tensor(coef), torch.tensor(shift), torch.tensor(basis),
                                 torch.tensor(f, dtype=torch.float64))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-9)


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_a_fourier_shift_head_starts_as_the_fourier_head_and_its_shift_moves_the_peak(decoding, tmp_path):
    plain = make(decoding)
    shifted = make(decoding, **{"policy.action_head": "fourier_shift"})
    missing, unexpected = shifted.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["action_shift.bias", "action_shift.weight"] and not unexpected
    images, proprio, instr = batch(13)
    tokens, logp = plain.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    for pol in (plain, shifted):
        re = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
        np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    greedy = shifted.act(images, proprio, instr, 0.0, None)[0]
    with torch.no_grad():
        shifted.action_shift.bias.fill_(0.25)  # a quarter of the bin range: the argmax moves up by ~64 of 256 bins
    moved = shifted.act(images, proprio, instr, 0.0, None)[0]
    assert np.median(moved - greedy) == pytest.approx(0.25 * 255, abs=4)
    save_policy(shifted, tmp_path / "ckpt")
    loaded = load_policy(tmp_path / "ckpt")
    assert loaded.policy_cfg.action_head == "fourier_shift"
    np.testing.assert_array_equal(loaded.act(images, proprio, instr, 0.0, None)[0], moved)


def test_a_keypoint_shift_needs_the_fourier_shift_head_and_keypoints():
    with pytest.raises(ValueError, match=r"policy.keypoint_shift=true .* set policy.action_head=fourier_shift"):
        load_config(None, ["policy.keypoint_shift=true"])
    with pytest.raises(ValueError, match=r"policy.keypoint_shift=true .* policy.keypoints > 0"):
        load_config(None, ["policy.keypoint_shift=true", "policy.action_head=fourier_shift", "policy.keypoints=0",
                           "policy.lang_keypoints=0"])


@pytest.mark.parametrize("decoding", ["parallel", "autoregressive"])
def test_a_keypoint_shift_starts_at_zero_and_moves_each_position_peak_with_the_keypoints(decoding, tmp_path):
    over = {"policy.action_head": "fourier_shift"}
    plain = make(decoding, **over)
    pol = make(decoding, **over, **{"policy.keypoint_shift": "true"})
    missing, unexpected = pol.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == ["point_shift.bias", "point_shift.weight"] and not unexpected
    images, proprio, instr = batch(14)
    tokens, logp = plain.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(0))
    again = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(again.detach().numpy(), logp, atol=1e-5, rtol=0)
    greedy = pol.act(images, proprio, instr, 0.0, None)[0]
    with torch.no_grad():
        pol.point_shift.bias.copy_(torch.linspace(0.0, 0.25, pol.tokens_per_call))  # its own shift per position
    moved = pol.act(images, proprio, instr, 0.0, None)[0]
    want = np.linspace(0.0, 0.25, pol.tokens_per_call) * 255
    assert np.median(np.abs(moved - greedy - want)) <= 4
    with torch.no_grad():
        pol.point_shift.weight.normal_(0.0, 0.05)
    tokens, logp = pol.act(images, proprio, instr, 1.6, torch.Generator().manual_seed(1))
    lp = pol.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
    np.testing.assert_allclose(lp.detach().numpy(), logp, atol=1e-5, rtol=0)  # sampling and scoring agree per position
    square = images.copy()
    square[:, 8:16, 8:16] = 255  # the keypoints move to it, and with them the shift
    with torch.no_grad():
        shift, moved_shift = (pol.prefix_embeds(x, proprio, instr)[2] for x in (images, square))
    assert shift.shape == (len(images), pol.tokens_per_call) and not torch.allclose(shift, moved_shift)
    pol.zero_grad(set_to_none=True)
    lp.sum().backward()
    assert pol.point_shift.weight.grad.abs().sum() > 0
    save_policy(pol, tmp_path / "ckpt")
    loaded = load_policy(tmp_path / "ckpt")
    assert loaded.policy_cfg.keypoint_shift is True
    np.testing.assert_allclose(loaded.token_logprobs(images, proprio, instr, torch.from_numpy(tokens), 1.6)
                               .detach().numpy(), logp, atol=1e-5, rtol=0)
