"""SimpleVLA-RL / OpenVLA-OFT fidelity of ``policy.arch=openvla_oft`` (docs/FIDELITY.md), on the stand-in that follows
the published checkpoint layout and OFT forward contract (tests/openvla_standin.py, tests/standin_vla_remote.py):
the ROBOT_PLATFORM / ALOHA-fallback trap, bidirectional attention, the prompt, the image pipeline, the action
statistics and the log-probs over the 256 action logits."""

import json

import numpy as np
import pytest
import torch

from async_vla.config import load_config
from async_vla.image_ops import center_crop_resize, jpeg_roundtrip
from async_vla.policy.openvla_loader import EMPTY_TOKEN, OpenVLAPolicy
from async_vla.policy.prismatic import ensure_robot_platform, resolve_unnorm_key, robot_platform
from tests.openvla_standin import StandInPrismatic, set_platform_constants, standin_processor, write_standin_checkpoint

ACTION = {"q01": [-0.5, -1.0, -2.0, -0.1, -0.2, -0.3, 0.0], "q99": [0.5, 1.0, 2.0, 0.1, 0.2, 0.3, 1.0],
          "mask": [True] * 6 + [False]}
STATS = {"libero_spatial_no_noops": {"action": ACTION}}
INSTR = ["pick up the black bowl", "put it on the plate"]
OFT = ["policy.arch=openvla_oft", "policy.path=standin", "policy.chunk_size=8", "policy.decoding=parallel"]


def _oft(seed: int = 0, extra=()) -> OpenVLAPolicy:
    cfg = load_config(None, OFT + list(extra))
    return OpenVLAPolicy(StandInPrismatic(action_positions=1, seed=seed, norm_stats=STATS).eval(), standin_processor(),
                         cfg.policy)


def _obs(n: int = 2, size: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8), np.zeros((n, 8), dtype=np.float32)


# ------------------------------------------------------------------------------------------- platform constants
def test_robot_platform_is_set_for_libero_and_a_conflicting_one_is_refused(monkeypatch):
    monkeypatch.delenv("ROBOT_PLATFORM", raising=False)
    assert ensure_robot_platform(8, 7) == "LIBERO"
    import os

    assert os.environ["ROBOT_PLATFORM"] == "LIBERO"
    monkeypatch.setenv("ROBOT_PLATFORM", "aloha")
    with pytest.raises(ValueError, match="ROBOT_PLATFORM=LIBERO"):
        ensure_robot_platform(8, 7)
    with pytest.raises(ValueError, match="matches no platform"):
        robot_platform(3, 7)


def test_a_forward_with_the_aloha_fallbacks_350_positions_is_an_error_naming_56():
    pol = _oft()
    images, proprio = _obs()
    set_platform_constants("ALOHA")     # the remote code imported without ROBOT_PLATFORM: constants.py's fallback
    try:
        with pytest.raises(ValueError, match=r"\[batch, 56, vocab\].*350 = 25 x 14 is the ALOHA platform"):
            pol.act(images, proprio, INSTR, 1.6)
        with pytest.raises(ValueError, match="56"):
            pol.token_logprobs(images, proprio, INSTR, torch.full((2, 56), 31800), 1.6)
    finally:
        set_platform_constants("LIBERO")
    assert pol.act(images, proprio, INSTR, 1.6)[0].shape == (2, 56)


def test_loading_a_checkpoint_sets_robot_platform_before_the_remote_code_reads_it(tmp_path, monkeypatch):
    """Through transformers: the checkpoint's own copy of the remote code is imported after the loader set
    ROBOT_PLATFORM, so its forward returns 8 x 7 positions (without it: ALOHA's 25 x 14)."""
    from async_vla.policy import build_policy

    monkeypatch.delenv("ROBOT_PLATFORM", raising=False)
    write_standin_checkpoint(tmp_path / "ckpt", oft=True, norm_stats=STATS)
    cfg = load_config(None, [o for o in OFT if not o.startswith("policy.path")] + [f"policy.path={tmp_path / 'ckpt'}"])
    pol = build_policy(cfg)
    images, proprio = _obs()
    assert pol.act(images, proprio, INSTR, 1.6)[0].shape == (2, 56)
    remote = __import__(type(pol.model).__module__, fromlist=["NUM_ACTIONS_CHUNK"])
    assert (remote.NUM_ACTIONS_CHUNK, remote.ACTION_DIM) == (8, 7) and remote.__name__.startswith("transformers_modules")


def test_prismatic_models_are_built_eager_then_run_sdpa(tmp_path):
    """Prismatic's `_supports_sdpa` asks its language model, which transformers wants to know before the remote
    __init__ has built it: a plain from_pretrained fails (as SimpleVLA-RL's modeling_prismatic.py does under
    transformers 4.57.6); the loader builds it eager and switches the language model to SDPA."""
    from async_vla.policy import build_policy
    from async_vla.policy.openvla_loader import _auto_model_class

    write_standin_checkpoint(tmp_path / "ckpt", oft=True, norm_stats=STATS)
    with pytest.raises(AttributeError, match="_supports_sdpa"):
        _auto_model_class().from_pretrained(tmp_path / "ckpt", trust_remote_code=True)
    cfg = load_config(None, [o for o in OFT if not o.startswith("policy.path")] + [f"policy.path={tmp_path / 'ckpt'}"])
    assert build_policy(cfg).model.language_model.config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------------- attention
def test_oft_attention_is_bidirectional_and_the_stock_model_is_not():
    """Action position 0 sees the stop token appended after the 56 placeholders only with bidirectional attention:
    perturbing the stop token's embedding moves its logits under the loaded policy, not under the raw causal LM."""
    images, proprio = _obs(1)
    pol = _oft(seed=3)
    raw = StandInPrismatic(action_positions=1, seed=3, norm_stats=STATS).eval()    # same weights, stock causal Llama
    ids = pol._prompt_ids(INSTR[0]).unsqueeze(0)
    pixels = pol._pixels(images)

    def first_position(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels)[0, 0].clone()

    before_bi, before_causal = first_position(pol.model), first_position(raw)
    for m in (pol.model, raw):
        with torch.no_grad():
            m.get_input_embeddings().weight[2] += 1.0          # the stop token (id 2), last in the sequence
    assert not torch.allclose(first_position(pol.model), before_bi, atol=1e-4)
    torch.testing.assert_close(first_position(raw), before_causal)


# ----------------------------------------------------------------------------------------- prompt and logits
def test_oft_prompt_ends_with_29871_and_logprobs_are_the_256_action_logits_at_temperature():
    pol = _oft()
    seen = []
    pol.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    images, proprio = _obs()
    toks, logp = pol.act(images, proprio, INSTR, 1.6, torch.Generator().manual_seed(0))
    assert all(int(ids[0, -1]) == EMPTY_TOKEN for ids in seen) and len(seen) == 2
    # upstream: logits[..., -256-64:-64] / T of a 32064-row head, softmax over those 256 only
    with torch.no_grad():
        for i, instr in enumerate(INSTR):
            ids = pol._prompt_ids(instr).unsqueeze(0)
            logits = pol.model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pol._pixels(images[i:i + 1]))
            assert logits.shape == (1, 56, 32064)
            ref = torch.log_softmax(logits[..., -256 - 64:-64].float() / 1.6, dim=-1)[0]
            idx = torch.from_numpy(toks[i]) - (32000 - 256)
            np.testing.assert_allclose(logp[i], ref.gather(-1, idx[:, None])[:, 0].numpy(), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ statistics
def test_dataset_statistics_json_wins_and_libero_keys_fall_back_to_no_noops(tmp_path):
    from async_vla.policy import build_policy

    file_action = dict(ACTION, q99=[1.0, 2.0, 3.0, 0.2, 0.4, 0.6, 1.0])
    write_standin_checkpoint(tmp_path / "ckpt", oft=True, norm_stats={"libero_spatial": {"action": ACTION}},
                             dataset_statistics={"libero_spatial_no_noops": {"action": file_action}})
    overrides = [o for o in OFT if not o.startswith("policy.path")] + ["policy.unnorm_key=libero_spatial"]
    pol = build_policy(load_config(None, overrides + [f"policy.path={tmp_path / 'ckpt'}"]))
    assert pol.tokenizer.unnorm_key == "libero_spatial_no_noops"            # the file replaced the config's stats
    tokens = np.full((1, 56), 31744)                                       # the bin nearest +1 on every dim
    actions = pol.decode_actions(tokens)[0, 0]
    norm = pol.tokenizer.decode(tokens)[0, 0]
    expected = 0.5 * (norm + 1) * (np.array(file_action["q99"]) - file_action["q01"] + 1e-8) + file_action["q01"]
    np.testing.assert_allclose(actions[:6], expected[:6], rtol=1e-6)
    # an export keeps the file, so the reloaded checkpoint decodes with the same statistics
    pol.save_pretrained(tmp_path / "out")
    again = build_policy(load_config(None, overrides + [f"policy.path={tmp_path / 'out'}"]))
    np.testing.assert_allclose(again.decode_actions(tokens), pol.decode_actions(tokens))
    assert json.loads((tmp_path / "out" / "dataset_statistics.json").read_text()).keys() == {"libero_spatial_no_noops"}


def test_unnorm_key_fallback_is_only_for_a_missing_libero_key():
    stats = {"libero_10_no_noops": 1, "bridge": 2}
    assert resolve_unnorm_key("libero_10", stats) == "libero_10_no_noops"
    assert resolve_unnorm_key("libero_10_no_noops", stats) == "libero_10_no_noops"
    assert resolve_unnorm_key("bridge_orig", stats) == "bridge_orig"       # left for the caller to refuse
    assert resolve_unnorm_key(None, stats) is None


# ------------------------------------------------------------------------------------------------------ images
def _crop_reference(img: np.ndarray, area: float, size: int) -> np.ndarray:
    """tf.image.crop_and_resize (bilinear) of the centred box of side sqrt(area), pixel by pixel, then
    convert_image_dtype back to uint8 (x * 255.5, truncated)."""
    h, w = img.shape[:2]
    side = np.float32(np.sqrt(np.float32(area)))
    y1 = x1 = (np.float32(1) - side) / np.float32(2)
    y2 = x2 = y1 + side
    x = img.astype(np.float32) * np.float32(1 / 255)
    out = np.zeros((size, size, 3), dtype=np.uint8)
    for i in range(size):
        in_y = y1 * np.float32(h - 1) + np.float32(i) * ((y2 - y1) * np.float32(h - 1) / np.float32(size - 1))
        t, b = int(np.floor(in_y)), int(np.ceil(in_y))
        ly = in_y - np.floor(in_y)
        for j in range(size):
            in_x = x1 * np.float32(w - 1) + np.float32(j) * ((x2 - x1) * np.float32(w - 1) / np.float32(size - 1))
            le, r = int(np.floor(in_x)), int(np.ceil(in_x))
            lx = in_x - np.floor(in_x)
            top = x[t, le] + (x[t, r] - x[t, le]) * lx
            bottom = x[b, le] + (x[b, r] - x[b, le]) * lx
            out[i, j] = (np.clip(top + (bottom - top) * ly, 0, 1) * np.float32(255.5)).astype(np.uint8)
    return out


def test_center_crop_follows_tf_crop_and_resize_pixel_for_pixel():
    img = np.random.default_rng(0).integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    got = center_crop_resize(img)
    assert got.shape == (24, 24, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, _crop_reference(img, 0.9, 24))
    np.testing.assert_array_equal(center_crop_resize(img, 0.5, 10), _crop_reference(img, 0.5, 10))
    np.testing.assert_array_equal(center_crop_resize(img, 1.0), img)       # the full box samples the pixels back


def test_policy_center_crop_feeds_the_cropped_frame_to_the_processor():
    images, proprio = _obs(2)
    pol = _oft(extra=["policy.center_crop=true"])
    plain = _oft()
    expected = plain._pixels(np.stack([center_crop_resize(a) for a in images]))
    torch.testing.assert_close(pol._pixels(images), expected)
    assert not torch.allclose(plain._pixels(images), expected)


def test_jpeg_roundtrip_is_lossy_but_close_on_a_smooth_frame():
    yy, xx = np.mgrid[0:64, 0:64]
    img = np.stack([yy * 4, xx * 4, (yy + xx) * 2], axis=-1).astype(np.uint8)
    out = jpeg_roundtrip(img)
    assert out.shape == img.shape and out.dtype == np.uint8 and not np.array_equal(out, img)
    assert np.abs(out.astype(int) - img).mean() < 2.0


# ----------------------------------------------------------------------------------------------- the configs
@pytest.mark.parametrize("name", ["spatial", "object", "goal", "10", "spatial_lora"])
def test_shipped_libero_configs_follow_simplevla_rl(name):
    cfg = load_config(f"configs/libero_{name}.yaml", [])
    suite = name.split("_")[0]
    assert cfg.policy.arch == "openvla_oft" and (cfg.policy.chunk_size, cfg.policy.action_dim) == (8, 7)
    assert cfg.env.max_steps == 512 and cfg.env.settle_steps == 10          # rob_rollout.py max_steps, wait steps
    assert cfg.env.render_size == 256 and cfg.env.image_size == 224 and cfg.env.image_orientation == "rot180"
    assert cfg.env.jpeg_roundtrip and cfg.policy.center_crop and not cfg.env.wrist_camera
    assert cfg.actor.temperature == 1.6 and cfg.actor.group_size == 8 and cfg.buffer.groups_per_batch == 64
    assert cfg.policy.unnorm_key == f"libero_{suite}_no_noops" and cfg.actor.backend == "torch"
    assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.kl_beta) == (0.2, 0.28, 0.0)
    assert cfg.loss.aggregation == "seq_mean_token_mean" and cfg.learner.weight_decay == 0.01
    assert cfg.learner.grad_clip == 1.0 and cfg.learner.gradient_checkpointing and cfg.learner.micro_batch_trajectories == 1
    # run_openvla_oft_rl_libero.sh: 64 x 8 = 512 trajectories per batch, ppo_mini_batch_size 128, one epoch: 4 steps
    assert cfg.learner.minibatches * cfg.learner.steps_per_batch == 4
    if not cfg.learner.lora_rank:
        assert cfg.learner.lr == 5e-6 and cfg.learner.num_ranks == 4 and cfg.learner.zero_stage == 3
    p = cfg.placement                   # every process placed; learner ranks never share a GPU with an actor
    assert len(p.gpus_learner) == cfg.learner.num_ranks and p.gpus_actors and p.gpu_evaluator is not None
    assert not set(p.gpus_learner) & set(p.gpus_actors)
