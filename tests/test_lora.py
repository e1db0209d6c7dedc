"""LoRA (learner.lora_rank, peft) and gradient checkpointing (learner.gradient_checkpointing), learner/adapt.py:
only the adapters train, actors and exports get the policy's own names with merged weights that compute what the
adapted policy computes, checkpoints resume, on the tiny policy and the OpenVLA-OFT stand-in under the torch learner
and DeepSpeed ZeRO 0 and 3."""


import numpy as np
import pytest
import torch

from async_vla.config import load_config
from async_vla.messages import Trajectory
from learner.adapt import apply_lora, enable_checkpointing, merge_lora_items
from learner.checkpoint_files import tensors_digest
from learner.torch_engine import TorchLearner

TINY = ["policy.hidden_size=32", "policy.intermediate_size=64", "policy.num_heads=2", "policy.patch_size=8",
        "policy.keypoints=4", "policy.word_buckets=64", "env.image_size=16"]
COMMON = ["learner.lr=0.01", "actor.temperature=1.0", "run.seed=3", "learner.zero3_persistence_threshold=0",
          "buffer.groups_per_batch=2", "learner.micro_batch_trajectories=2"]
LORA = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.gradient_checkpointing=true"]


def _setup(kind: str, tmp_path, extra=()):
    """(config overrides, a fresh plain policy factory) for the tiny policy or the OFT stand-in checkpoint."""
    from async_vla.policy import build_policy

    if kind == "tiny":
        overrides = TINY + COMMON + list(extra)
        return overrides, lambda: build_policy(load_config(None, overrides))
    from tests.openvla_standin import write_standin_checkpoint

    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        write_standin_checkpoint(ckpt, oft=True, norm_stats={"builtin": {"action": {
            "q01": [-1.0] * 7, "q99": [1.0] * 7, "mask": [True] * 6 + [False]}}})
    overrides = ["policy.arch=openvla_oft", f"policy.path={ckpt}", "policy.decoding=parallel"] + COMMON + list(extra)
    return overrides, lambda: build_policy(load_config(None, overrides))


def _groups(policy, seed: int = 0, size: int = 16, proprio_dim: int = 8):
    """Two groups of two on-policy trajectories (1-2 calls each) sampled from ``policy``."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, rewards in enumerate(((1.0, 0.0), (0.0, 1.0))):
        trajs = []
        for j, r in enumerate(rewards):
            n = 1 + j
            images = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
            proprio = rng.standard_normal((n, proprio_dim)).astype(np.float32)
            instr = "pick up the black bowl"
            tokens, behav = policy.act(images, proprio, [instr] * n, 1.0, torch.Generator().manual_seed(seed + g + j))
            trajs.append(Trajectory(
                run_id="t", actor_id=0, group_id=f"g{g}", traj_id=f"g{g}-{j}", task_id=0, init_state_id=0,
                instruction=instr, behaviour_version=0, success=r > 0.5, reward=r, env_steps=n, t_start=0.0,
                t_end=1.0, group_size=2, chunk_versions=np.zeros(n, dtype=np.int64), images=images, proprio=proprio,
                action_tokens=tokens, behav_logprobs=behav, token_mask=np.ones(tokens.shape, dtype=bool)))
        groups.append(trajs)
    return groups


def test_merged_weights_compute_what_the_adapters_compute(tmp_path):
    overrides, fresh = _setup("tiny", tmp_path)
    adapted = apply_lora(fresh(), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)                   # B = 0 at init would make merging trivially right
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    plain = fresh()
    merged = dict(merge_lora_items(adapted.named_parameters(), 8 / 4))
    assert merged.keys() == dict(plain.named_parameters()).keys()
    plain.load_state_dict(merged, strict=False)
    groups = _groups(plain, proprio_dim=8)
    t = groups[0][1]
    args = (t.images, t.proprio, [t.instruction] * len(t.images), torch.from_numpy(t.action_tokens), 1.0)
    with torch.no_grad():
        torch.testing.assert_close(plain.token_logprobs(*args), adapted.token_logprobs(*args), rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_changes_nothing_but_memory(tmp_path):
    overrides, fresh = _setup("tiny", tmp_path)
    groups = _groups(fresh())
    plain = TorchLearner(load_config(None, overrides), fresh())
    ckpt = TorchLearner(load_config(None, overrides + ["learner.gradient_checkpointing=true"]), fresh())
    m1, m2 = plain.train_step(groups), ckpt.train_step(groups)
    assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], rel=1e-6, abs=1e-8)
    for (n1, t1), (n2, t2) in zip(plain.full_state_items(), ckpt.full_state_items()):
        assert n1 == n2
        torch.testing.assert_close(t2, t1, rtol=1e-5, atol=1e-6)


def _learner(backend: str, cfg, policy):
    if backend == "torch":
        return TorchLearner(cfg, policy)
    from learner.deepspeed_engine import DeepSpeedLearner

    return DeepSpeedLearner(cfg, policy)


@pytest.mark.slow   # ~20-60 s per case on 2 loaded cores (DeepSpeed start-up, two learners, an export)
@pytest.mark.parametrize("kind,backend", [("tiny", "torch"), ("tiny", "zero0"), ("tiny", "zero3"),
                                          ("standin", "zero0"), ("standin", "zero3")])
def test_lora_learner_trains_adapters_publishes_merged_weights_exports_and_resumes(dist_env, tmp_path, kind, backend):
    stage = {"torch": [], "zero0": ["learner.zero_stage=0"], "zero3": ["learner.zero_stage=3"]}[backend]
    overrides, fresh = _setup(kind, tmp_path, LORA + stage + (["learner.backend=torch"] if backend == "torch" else []))
    cfg = load_config(None, overrides)
    start = dict(fresh().named_parameters())
    groups = _groups(fresh())
    learner = _learner(backend, cfg, fresh())
    learner.train_step(groups)
    assert learner.version == 1
    state = dict(learner.full_state_items())
    assert state.keys() == start.keys()                                  # the policy's own names, merged
    moved = {n for n in state if not torch.equal(state[n], start[n].detach())}
    assert moved and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                     "gate_proj.weight", "up_proj.weight", "down_proj.weight")) for n in moved)
    # what an actor does with them: a plain policy loaded with the merged weights computes the learner's log-probs
    from actors.weight_loading import load_weights

    actor = fresh()
    load_weights(actor, state)
    t = groups[1][1]
    args = (t.images, t.proprio, [t.instruction] * len(t.images), torch.from_numpy(t.action_tokens), 1.0)
    with torch.no_grad():
        # the learner's own pass (ZeRO-3: through the engine, which gathers the partitioned weights)
        own = learner.policy.token_logprobs(*args) if backend == "torch" else learner.engine(*args)
        torch.testing.assert_close(actor.token_logprobs(*args), own, rtol=1e-4, atol=1e-5)
    # the export is the plain architecture with the merged weights
    learner.export_policy(tmp_path / "export")
    from async_vla.policy import build_policy, load_policy

    exported = (load_policy(tmp_path / "export") if kind == "tiny" else
                build_policy(load_config(None, [o for o in overrides if not o.startswith("policy.path")]
                                         + [f"policy.path={tmp_path / 'export'}"])))
    got = dict(exported.named_parameters())
    assert got.keys() == state.keys() and all(torch.equal(got[n].detach(), state[n]) for n in state)
    # checkpoint and resume: a new learner (adapters rebuilt from the config) continues from the same state
    learner.save_checkpoint(tmp_path / "ckpts")
    resumed = _learner(backend, cfg, fresh())
    resumed.load_checkpoint(tmp_path / "ckpts")
    assert resumed.version == 1 and tensors_digest(resumed.full_state_items()) == tensors_digest(state.items())
    resumed.train_step(groups)
    learner.train_step(groups)
    assert tensors_digest(resumed.full_state_items()) == tensors_digest(learner.full_state_items())


def test_checkpointing_needs_decoder_layers():
    with pytest.raises(ValueError, match="no language model"):
        enable_checkpointing(torch.nn.Linear(2, 2))
