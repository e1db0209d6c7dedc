"""``OpenVLAPolicy`` (the loader's side of a real OpenVLA / OpenVLA-OFT checkpoint) on a tiny stand-in for
Prismatic's forward contract (tests/openvla_standin.py): sampling with the KV cache and the learner's
teacher-forced recomputation agree, per-instruction batching, OFT's parallel positions, the checkpoint's action
statistics; and the checkpoint flavours a user may bring (stand-ins of each): SimpleVLA-RL's and openvla-oft's own
OFT remote code run, every flavour GRPO cannot train is refused before anything starts. Loading a real checkpoint
from disk: tests/test_policy.py (needs ASYNC_VLA_OPENVLA_PATH)."""

import re

import numpy as np
import pytest
import torch

from async_vla.config import load_config
from async_vla.policy.openvla_loader import OpenVLAPolicy
from tests.openvla_standin import StandInPrismatic, standin_processor, write_standin_checkpoint

STATS = {"libero_spatial_no_noops": {"action": {"q01": [-0.5, -1.0, -2.0, -0.1, -0.2, -0.3, 0.0],
                                                "q99": [0.5, 1.0, 2.0, 0.1, 0.2, 0.3, 1.0],
                                                "mask": [True] * 6 + [False]}}}
INSTR = ["Pick up the black bowl", "put it on the plate", "Pick up the black bowl"]


def _policy(arch: str, stats=None) -> OpenVLAPolicy:
    oft = arch == "openvla_oft"
    cfg = load_config(None, [f"policy.arch={arch}", "policy.path=standin", f"policy.chunk_size={8 if oft else 1}",
                             f"policy.decoding={'parallel' if oft else 'autoregressive'}"])
    model = StandInPrismatic(action_positions=56 if oft else 0, norm_stats=stats or STATS).eval()
    return OpenVLAPolicy(model, standin_processor(), cfg.policy)


def _obs(n: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 16, 16, 3), dtype=np.uint8), np.zeros((n, 8), dtype=np.float32)


@pytest.mark.parametrize("arch,tokens", [("openvla", 7), ("openvla_oft", 56)])
@pytest.mark.parametrize("temperature", [1.6, 1.0])
def test_sampled_logprobs_equal_the_learners_recomputation(arch, tokens, temperature):
    pol = _policy(arch)
    images, proprio = _obs()
    toks, logp = pol.act(images, proprio, INSTR, temperature, torch.Generator().manual_seed(1))
    assert toks.shape == (3, tokens) and toks.min() >= 31744 and toks.max() <= 31999 and logp.shape == (3, tokens)
    assert np.all(logp <= 0) and np.all(np.isfinite(logp))
    # one teacher-forced pass (autoregressive) or the same parallel pass, rows of both instructions mixed
    re = pol.token_logprobs(images, proprio, INSTR, torch.from_numpy(toks), temperature)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    # and row by row, alone: batching rows by instruction changes nothing
    for i in range(3):
        alone = pol.token_logprobs(images[i:i + 1], proprio[i:i + 1], INSTR[i:i + 1], torch.from_numpy(toks[i:i + 1]),
                                   temperature)
        np.testing.assert_allclose(alone.detach().numpy()[0], logp[i], atol=1e-5, rtol=0)


def test_autoregressive_tokens_condition_on_the_earlier_ones_and_greedy_is_the_argmax():
    pol = _policy("openvla")
    images, proprio = _obs(1)
    toks, _ = pol.act(images, proprio, INSTR[:1], 0.0)
    again, _ = pol.act(images, proprio, INSTR[:1], 0.0)
    assert np.array_equal(toks, again)
    idx = pol.tokenizer.token_to_index(torch.from_numpy(toks))
    logits = pol.action_logits(images, proprio, INSTR[:1], idx)
    assert torch.equal(logits.argmax(-1), idx)                 # greedy = argmax at every teacher-forced position
    other = idx.clone()
    other[0, 0] = (other[0, 0] + 1) % 256                      # change the first token: later positions see it
    assert not torch.allclose(pol.action_logits(images, proprio, INSTR[:1], other)[0, 1:], logits[0, 1:])


def test_gradients_reach_the_language_model_and_the_image_projection():
    pol = _policy("openvla_oft")
    images, proprio = _obs(2)
    toks, _ = pol.act(images, proprio, INSTR[:2], 1.6, torch.Generator().manual_seed(0))
    pol.token_logprobs(images, proprio, INSTR[:2], torch.from_numpy(toks), 1.6).sum().backward()
    for name in ("model.vision_backbone.proj.weight", "model.projector.0.weight",
                 "model.language_model.model.layers.0.self_attn.q_proj.weight"):
        grad = dict(pol.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_actions_are_unnormalised_with_the_checkpoints_statistics():
    pol = _policy("openvla")
    lo, hi = np.array(STATS["libero_spatial_no_noops"]["action"]["q01"]), np.array(
        STATS["libero_spatial_no_noops"]["action"]["q99"])
    tokens = np.array([[31744, 31999, 31744 + 128, 31744, 31999, 31744 + 128, 31999]])
    norm = pol.tokenizer.decode(tokens)[0]                     # bin centres in [-1, 1]
    actions = pol.decode_actions(tokens)
    assert actions.shape == (1, 1, 7)
    expected = np.where(np.arange(7) < 6, 0.5 * (norm + 1) * (hi - lo) + lo, norm)   # BOUNDS_Q99; gripper as is
    np.testing.assert_allclose(actions[0, 0], expected, rtol=1e-5, atol=1e-6)


def test_an_ambiguous_or_unknown_unnorm_key_is_refused():
    two = dict(STATS, other={"action": STATS["libero_spatial_no_noops"]["action"]})
    cfg = load_config(None, ["policy.arch=openvla", "policy.path=standin", "policy.chunk_size=1",
                             "policy.decoding=autoregressive"])
    with pytest.raises(ValueError, match="policy.unnorm_key"):
        OpenVLAPolicy(StandInPrismatic(norm_stats=two), standin_processor(), cfg.policy)
    cfg = load_config(None, ["policy.arch=openvla", "policy.path=standin", "policy.chunk_size=1",
                             "policy.decoding=autoregressive", "policy.unnorm_key=nope"])
    with pytest.raises(ValueError, match="nope"):
        OpenVLAPolicy(StandInPrismatic(norm_stats=STATS), standin_processor(), cfg.policy)


# ------------------------------------------------------------------- a checkpoint directory, through transformers
@pytest.mark.parametrize("arch", ["openvla", "openvla_oft"])
def test_a_checkpoint_directory_loads_through_transformers_remote_code(tmp_path, arch):
    """config.json + auto_map to remote code + safetensors + AutoProcessor, as a real checkpoint ships them:
    bin/train's preflight accepts it, build_policy loads it (load_openvla_policy), sampling and recomputation agree."""
    from async_vla.policy import build_policy
    from runner.preflight import preflight

    write_standin_checkpoint(tmp_path / f"ckpt_{arch}", oft=arch == "openvla_oft", norm_stats=STATS)
    oft = arch == "openvla_oft"
    cfg = load_config(None, [f"policy.arch={arch}", f"policy.path={tmp_path / f'ckpt_{arch}'}", "transport.weights_port=0",
                             f"policy.chunk_size={8 if oft else 1}", "transport.trajectory_port=0",
                             f"policy.decoding={'parallel' if oft else 'autoregressive'}", "transport.control_port=0",
                             "transport.batch_port=0"])
    assert preflight(cfg, tmp_path / "run", False)[0] == []
    pol = build_policy(cfg)
    assert isinstance(pol, OpenVLAPolicy)
    images, proprio = _obs()
    toks, logp = pol.act(images, proprio, INSTR, 1.6, torch.Generator().manual_seed(0))
    re = pol.token_logprobs(images, proprio, INSTR, torch.from_numpy(toks), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    assert pol.decode_actions(toks).shape == (3, 8 if oft else 1, 7)


@pytest.mark.timeout(300)
def test_serial_rl_from_an_openvla_oft_checkpoint_exports_one_that_loads_and_evaluates(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from async_vla.policy import build_policy
    from runner.serial import run_serial

    stats = {"builtin": STATS["libero_spatial_no_noops"]}
    write_standin_checkpoint(tmp_path / "ckpt_oft", oft=True, norm_stats=stats)
    overrides = ["policy.arch=openvla_oft", f"policy.path={tmp_path / 'ckpt_oft'}", "policy.decoding=parallel",
                 "run.mode=serial", "learner.backend=torch", "learner.lr=1e-3", "buffer.dynamic_sampling=false",
                 "actor.group_size=2", "env.envs_per_actor=2", "buffer.groups_per_batch=1", "run.max_versions=2",
                 "learner.micro_batch_trajectories=2", "env.num_train_init_states=2", "env.num_eval_init_states=1",
                 "env.task_ids=[0]", "logging.tensorboard=false", "run.eval_every=0"]
    summary = run_serial(load_config(None, overrides), tmp_path / "run")
    assert summary["final_version"] == 2
    # The exported checkpoint loads as a policy.path and holds the learner's final weights (its checkpoint's).
    exported = build_policy(load_config(None, overrides + [f"policy.path={tmp_path / 'run' / 'policy'}"]))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    final = torch.load(ckpt_dir / (ckpt_dir / "latest").read_text().strip() / "learner.pt", weights_only=False)
    assert final["learner"]["version"] == 2
    got = exported.state_dict()
    assert got.keys() == final["policy"].keys() and all(torch.equal(got[k], final["policy"][k]) for k in got)
    assert (tmp_path / "run" / "config.yaml").is_file()      # bin/eval <run> takes the run's config and policy/
    ev = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "bin" / "eval"),
                         str(tmp_path / "run"), "--json"], capture_output=True, text=True, timeout=240)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads(ev.stdout)["episodes"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["openvla", "openvla_oft"])
def test_gpu_bf16_sampled_logprobs_stay_close_to_the_learners(tmp_path, arch):
    """On a GPU the loader runs a checkpoint in bf16 (load_openvla_policy). The actor's sampled log-probs (KV cache
    for openvla, one parallel pass for OFT) and the learner's teacher-forced recomputation then go through different
    kernels and shapes; their gap is where every importance ratio starts, so it must stay far inside the clip
    (0.2): here the ratio is within 5% of 1 for every token, and the tokens are what the checkpoint decodes."""
    from async_vla.policy import build_policy

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    oft = arch == "openvla_oft"
    write_standin_checkpoint(tmp_path / f"ckpt_{arch}", oft=oft, norm_stats=STATS)
    cfg = load_config(None, [f"policy.arch={arch}", f"policy.path={tmp_path / f'ckpt_{arch}'}",
                             f"policy.chunk_size={8 if oft else 1}",
                             f"policy.decoding={'parallel' if oft else 'autoregressive'}"])
    pol = build_policy(cfg)
    assert pol.device.type == "cuda" and next(pol.model.parameters()).dtype == torch.bfloat16
    images, proprio = _obs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    toks, logp = pol.act(images, proprio, INSTR, 1.6, gen)
    assert toks.shape == (3, 56 if oft else 7) and np.all(np.isfinite(logp)) and np.all(logp <= 0)
    with torch.no_grad():
        re = pol.token_logprobs(images, proprio, INSTR, torch.from_numpy(toks), 1.6).float().cpu().numpy()
    gap = np.abs(re - logp)
    print(f"[gpu] {arch} bf16 behaviour vs learner log-probs: |gap| mean {gap.mean():.2e}, max {gap.max():.2e} "
          f"over {gap.size} tokens")
    assert np.abs(np.exp(re - logp) - 1).max() < 0.05, gap.max()
    greedy, _ = pol.act(images, proprio, INSTR, 0.0)
    assert np.array_equal(greedy, pol.act(images, proprio, INSTR, 0.0)[0])   # greedy is deterministic on the GPU


# ------------------------------------------------------------------- checkpoint flavours (async_vla/vla_checkpoint.py)
def _oft_cfg(path, *more):
    return load_config(None, ["policy.arch=openvla_oft", f"policy.path={path}", "policy.chunk_size=8",
                              "policy.decoding=parallel", "transport.trajectory_port=0", "transport.control_port=0",
                              "transport.batch_port=0", "transport.weights_port=0", *more])


def test_openvla_ofts_own_remote_code_runs_as_its_predict_action_does(tmp_path):
    """An OFT checkpoint that carries openvla-oft's modeling_prismatic.py (whose forward needs labels marking the
    placeholders) runs too: the loader builds them with the model's own helpers and takes the action positions of
    the whole sequence's logits; with the same weights, the action logits are SimpleVLA-RL's forward's exactly."""
    from async_vla.policy import build_policy
    from runner.preflight import preflight

    write_standin_checkpoint(tmp_path / "oft_labels", flavour="oft_labels", norm_stats=STATS, seed=4)
    write_standin_checkpoint(tmp_path / "oft", flavour="oft", norm_stats=STATS, seed=4)
    cfg = _oft_cfg(tmp_path / "oft_labels")
    assert preflight(cfg, tmp_path / "run", False)[0] == []
    pol = build_policy(cfg)
    assert pol.forward_contract == "oft_labels"
    images, proprio = _obs()
    with pytest.raises(TypeError):             # why it needs the loader's help: upstream fails the same way
        pol.model(input_ids=pol._prompt_ids(INSTR[0])[None], attention_mask=None, pixel_values=pol._pixels(images[:1]))
    toks, logp = pol.act(images, proprio, INSTR, 1.6, torch.Generator().manual_seed(0))
    re = pol.token_logprobs(images, proprio, INSTR, torch.from_numpy(toks), 1.6)
    np.testing.assert_allclose(re.detach().numpy(), logp, atol=1e-5, rtol=0)
    ref = build_policy(_oft_cfg(tmp_path / "oft"))
    assert ref.forward_contract == "oft_logits"
    idx = pol.tokenizer.token_to_index(torch.from_numpy(toks))
    torch.testing.assert_close(pol.action_logits(images, proprio, INSTR, idx),
                               ref.action_logits(images, proprio, INSTR, idx), atol=1e-5, rtol=0)


def _component(path, name: str) -> None:
    torch.save({"weight": torch.zeros(2, 2)}, path / f"{name}--150000_checkpoint.pt")   # openvla-oft finetune.py's names


def _edit_config(path, **changes) -> None:
    import json

    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _l1_with_proprio(path):     # openvla-oft's published LIBERO checkpoints: L1 head and proprio projector
    _component(path, "action_head")
    _component(path, "proprio_projector")


def _diffusion(path):
    _component(path, "action_head")
    _component(path, "noisy_action_projector")


def _lora_adapter_only(path):
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "lora_adapter").mkdir()


def _without_its_package(path):     # openvla-oft's remote code imports its prismatic package
    modeling = path / "standin_vla_remote.py"
    modeling.write_text("from prismatic.vla.constants import IGNORE_INDEX\n" + modeling.read_text())


@pytest.mark.parametrize("flavour,change,arch,why", [
    ("oft", _l1_with_proprio, "openvla_oft", r"continuous l1-regression action head.*--use_l1_regression False.*"
                                             r"proprioception.*use_proprio=False"),
    ("oft", _diffusion, "openvla_oft", r"continuous diffusion action head"),
    ("oft", lambda p: _component(p, "vision_backbone"), "openvla_oft", r"FiLM.*--use_film False"),
    ("oft", lambda p: _edit_config(p, use_proprio=True), "openvla_oft", r"proprioception"),
    ("oft", _lora_adapter_only, "openvla_oft", r"LoRA adapter.*merge_lora_weights_and_save"),
    ("oft", lambda p: _edit_config(p, auto_map=None), "openvla_oft", r"no remote code.*overwrite_vla_ckpt_utils.sh"),
    ("oft_labels", _without_its_package, "openvla_oft", r"imports prismatic.*moojink/openvla-oft.*"
                                                        r"overwrite_vla_ckpt_utils.sh"),
    ("oft", lambda p: None, "openvla", r"OpenVLA-OFT forward.*set policy.arch=openvla_oft"),
    ("openvla", lambda p: None, "openvla_oft", r"autoregressive OpenVLA forward.*set policy.arch=openvla "),
])
def test_a_checkpoint_grpo_cannot_train_is_refused_before_anything_starts(tmp_path, flavour, change, arch, why):
    """Each flavour async_vla cannot train is refused by bin/train's preflight (before any process starts) and by
    the loader (before loading), naming why and the fix."""
    from async_vla.policy import build_policy
    from runner.preflight import preflight

    path = tmp_path / "ckpt"
    write_standin_checkpoint(path, flavour=flavour, norm_stats=STATS)
    change(path)
    openvla = arch == "openvla"
    cfg = load_config(None, [f"policy.arch={arch}", f"policy.path={path}", f"policy.chunk_size={1 if openvla else 8}",
                             f"policy.decoding={'autoregressive' if openvla else 'parallel'}",
                             "transport.trajectory_port=0", "transport.control_port=0", "transport.batch_port=0",
                             "transport.weights_port=0"])
    errors = [e for e in preflight(cfg, tmp_path / "run", False)[0] if e.startswith("policy.path")]
    assert len(errors) >= 1 and re.search(why, " ".join(errors), re.S), errors
    with pytest.raises(ValueError, match=f"cannot be trained as policy.arch={arch}") as refused:
        build_policy(cfg)
    assert re.search(why, str(refused.value), re.S)
