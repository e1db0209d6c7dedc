"""TorchLearner (and single-rank DeepSpeed) steps: direction, DeepSpeed non-finite skips, checkpoints.
(TorchLearner's NaN/inf skips: tests/faults/test_numerics.py.)"""


import pytest
import torch

from async_vla.batching import collate
from learner.checkpoint_files import tensors_digest
from learner.torch_engine import TorchLearner
from tests.learner_helpers import StandInPolicy, finite_params, make_groups, small_cfg


def _logp_rows(policy, groups, cfg):
    b = collate(groups, cfg)
    with torch.no_grad():
        lp = b.layout(policy.token_logprobs(b.images, b.proprio, b.instructions, b.action_tokens, 1.0))
    return (lp * b.mask).sum(dim=1), b.advantages


def test_step_raises_logprob_of_positive_advantage_trajectories():
    cfg = small_cfg("learner.lr=0.01", "learner.micro_batch_trajectories=2")
    policy = StandInPolicy(seed=1)
    groups = make_groups(policy=policy)  # on-policy behaviour log-probs, rewards (1,0 | 0,1)
    before, adv = _logp_rows(policy, groups, cfg)
    learner = TorchLearner(cfg, policy)
    m = learner.train_step(groups)
    after, _ = _logp_rows(policy, groups, cfg)
    assert learner.version == 1 and m["learner/version"] == 1 and m["learner/skipped_steps"] == 0
    assert ((after - before) * adv > 0).all(), (before, after, adv)  # up for A > 0, down for A < 0
    # on-policy first step: ratios 1, importance weights 1, nothing clipped
    assert m["offpolicy/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["loss/clip_frac_low"] == 0 and m["loss/clip_frac_high"] == 0
    for tag in ("loss/policy", "loss/kl", "loss/nsr_rescued_frac", "offpolicy/is_weight_max",
                "offpolicy/mis_masked_frac", "offpolicy/behav_kl", "perf/learner_step_s", "learner/lag_mean"):
        assert tag in m
    assert m["learner/trajectories"] == 4 and m["learner/micro_batches"] == 2


def test_steps_per_batch_takes_several_steps_in_one_version():
    cfg = small_cfg("learner.steps_per_batch=3")
    policy = StandInPolicy(seed=1)
    learner = TorchLearner(cfg, policy)
    m = learner.train_step(make_groups(policy=policy))
    # one version per batch (docs/LEARNER.md "Versions"), three optimizer steps inside it
    assert learner.version == 1 and m["learner/steps_applied"] == 3 and m["learner/optimizer_steps"] == 3
    assert learner.optimizer_steps == 3 and m["learner/lag_mean"] == 0


def _one_step_weights(cfg, rewards):
    policy = StandInPolicy(seed=1)
    groups = make_groups(policy=StandInPolicy(seed=1), rewards=rewards)
    TorchLearner(cfg, policy).train_step(groups)
    return torch.cat([p.detach().reshape(-1) for p in policy.parameters()])


def test_shuffled_outcomes_train_on_a_within_group_reshuffle_of_the_rewards():
    # loss.outcomes=shuffled (the noise-only control) takes the step a real-outcome learner takes on the same
    # trajectories with each group's rewards reassigned among its members; which reassignment depends on run.seed
    real = (1.0, 0.0, 0.0, 1.0)
    reassigned = {r: _one_step_weights(small_cfg(), r)
                  for r in [(a, 1 - a, b, 1 - b) for a in (0.0, 1.0) for b in (0.0, 1.0)]}
    assert not torch.equal(reassigned[real], reassigned[(0.0, 1.0, 0.0, 1.0)])
    seen = set()
    for seed in range(8):
        w = _one_step_weights(small_cfg(f"run.seed={seed}", "loss.outcomes=shuffled"), real)
        match = [r for r, ref in reassigned.items() if torch.equal(w, ref)]
        assert len(match) == 1, f"seed {seed}: the step matches no within-group reassignment of the rewards"
        seen.add(match[0])
    assert len(seen) > 1, "every seed drew the same reassignment: the outcomes are not being shuffled"


def test_checkpoint_round_trip_is_bit_equal(tmp_path):
    cfg = small_cfg("loss.nsr=band", "loss.nsr_prob=0.5", "learner.keep_checkpoints=2", "loss.outcomes=shuffled")
    batches = [make_groups(seed=s, behav_noise=0.3) for s in range(4)]
    a = TorchLearner(cfg, StandInPolicy(seed=1))
    for b in batches[:2]:
        a.train_step(b)
    path = a.save_checkpoint(tmp_path, extra={"buffer_ledger": {"trained": 8}})
    assert path.name == "v00000002" and (tmp_path / "latest").read_text() == "v00000002"
    b_ = TorchLearner(cfg, StandInPolicy(seed=99))  # different weights until loaded
    assert tensors_digest(b_.full_state_items()) != tensors_digest(a.full_state_items())
    extra = b_.load_checkpoint(tmp_path)
    assert extra == {"buffer_ledger": {"trained": 8}} and b_.version == 2
    assert tensors_digest(b_.full_state_items()) == tensors_digest(a.full_state_items())
    assert b_.optimizer_digest() == a.optimizer_digest()
    # continuing gives bit-equal results (optimizer moments, NSR generator, the outcome shuffles and RNG restored)
    for b in batches[2:] + batches[:2]:
        a.train_step(b)
        b_.train_step(b)
        assert tensors_digest(b_.full_state_items()) == tensors_digest(a.full_state_items())
    for k in (3, 4):  # pruning keeps the newest two
        a.train_step(batches[3])
        a.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000007", "v00000008"]


# ------------------------------------------------------------------------- single-rank DeepSpeed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_single_rank_matches_torch_and_skips_nan(dist_env, stage, tmp_path):
    from learner.deepspeed_engine import DeepSpeedLearner, make_ds_config

    cfg = small_cfg(f"learner.zero_stage={stage}", "learner.micro_batch_trajectories=3")
    ds_cfg = make_ds_config(cfg, 1, on_gpu=False)
    assert ds_cfg["zero_optimization"]["stage"] == stage and not ds_cfg["bf16"]["enabled"]
    assert ds_cfg["gradient_clipping"] == cfg.learner.grad_clip
    ref_policy = StandInPolicy(seed=1)
    groups = make_groups(policy=ref_policy, behav_noise=0.1)
    ref = TorchLearner(cfg, ref_policy)
    ds = DeepSpeedLearner(cfg, StandInPolicy(seed=1))
    assert ds.stage == stage and ds.world == 1
    m_ref, m_ds = ref.train_step(groups), ds.train_step(groups)
    assert ds.version == 1 and m_ds["learner/micro_batches"] == 2
    assert m_ds["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-5, abs=1e-7)
    for (n1, t1), (n2, t2) in zip(ref.full_state_items(), ds.full_state_items()):
        assert n1 == n2 and t1.shape == t2.shape
        torch.testing.assert_close(t2, t1, rtol=1e-5, atol=1e-6)  # same AdamW step, same clipping
    digest = tensors_digest(ds.full_state_items())
    ds.policy.poison = "grad"
    m = ds.train_step(groups)
    assert m["learner/skipped_steps"] == 1 and ds.version == 2            # consumed, weights untouched
    assert tensors_digest(ds.full_state_items()) == digest
    ds.policy.poison = "logp"
    ds.train_step(groups)
    assert ds.skipped_steps == 2 and ds.version == 3 and tensors_digest(ds.full_state_items()) == digest
    ds.policy.poison = None
    ds.train_step(groups)
    assert ds.version == 4 and finite_params(ds.full_state_items())
    out = ds.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == out.name


def test_bin_learner_rejects_bad_config_before_importing_torch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "ok.yaml").write_text("run: {name: t}\n")
    code = ("import sys; from learner.__main__ import main; "
            f"rc = main(['{tmp_path / 'missing.yaml'}', '--run-dir', '{tmp_path}']); "
            f"rc2 = main(['{tmp_path / 'ok.yaml'}', 'learner.zero_stage=7', '--run-dir', '{tmp_path}']); "
            "print(rc, rc2, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).resolve().parent.parent))
    assert out.stdout.split() == ["2", "2", "False"], out.stderr
    assert "does not exist" in out.stderr and "learner.zero_stage" in out.stderr


@pytest.mark.parametrize("stage", [3, 2, 1, 0])
def test_real_tiny_policy_zero_step_and_export(dist_env, tmp_path, stage):
    """The real tiny policy (tied LM-head rows read outside their module) under each ZeRO stage, then the HF
    export (ZeRO 1-3 keep parameters as views of one flat buffer, which safetensors refuses to save as they are)."""
    import async_vla.policy as policy_mod
    from learner.deepspeed_engine import DeepSpeedLearner

    cfg = small_cfg(f"learner.zero_stage={stage}", "policy.proprio_dim=3", "env.image_size=8", "policy.patch_size=4",
                    "policy.hidden_size=32", "policy.num_heads=2", "policy.num_layers=1",
                    "policy.intermediate_size=64")
    ref = TorchLearner(cfg, policy_mod.build_policy(cfg))
    ds = DeepSpeedLearner(cfg, policy_mod.build_policy(cfg))
    groups = make_groups(policy=ref.policy)
    m_ref, m_ds = ref.train_step(groups), ds.train_step(groups)
    assert ds.version == 1 and m_ds["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-4, abs=1e-6)
    full = dict(ds.full_state_items())
    # Adam's first step moves every element by exactly +-lr (m/sqrt(v) = sign(g)), so an element whose
    # gradient is rounding noise (e.g. keypoint temperatures on random inputs) may move the other way under
    # ZeRO-3's different summation order. Require agreement on all but a tiny fraction of elements.
    total = mismatched = 0
    for name, t in ref.full_state_items():
        close = torch.isclose(full[name], t, rtol=1e-4, atol=1e-5)
        total += close.numel()
        mismatched += int((~close).sum())
    assert mismatched <= 0.01 * total, f"{mismatched} of {total} parameter elements differ"
    out = ds.export_policy(tmp_path / "policy")
    loaded = policy_mod.load_policy(out)
    assert tensors_digest(loaded.named_parameters()) == tensors_digest(full.items())
    assert tensors_digest(ds.full_state_items()) == tensors_digest(full.items())  # shards untouched by export
    ds.train_step(groups)
    assert ds.version == 2 and finite_params(ds.full_state_items())


def test_latest_tag_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    """A kill between removing a re-saved checkpoint and renaming its replacement leaves 'latest' naming a missing
    directory: resume takes the newest complete one (learner.pt present), never a half-written DeepSpeed dir."""
    from learner.checkpoint_names import latest_tag

    assert latest_tag(tmp_path) is None
    for tag in ("v00000010", "v00000020"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "learner.pt").write_bytes(b"x")
    (tmp_path / "v00000030").mkdir()                                   # partial: no learner.pt
    (tmp_path / "v00000040.tmp").mkdir()
    (tmp_path / "latest").write_text("v00000010")
    assert latest_tag(tmp_path) == "v00000010"                         # a valid pointer wins
    (tmp_path / "latest").write_text("v00000050")
    assert latest_tag(tmp_path) == "v00000020"


# ------------------------------------------------------------------------------- KL to a reference
def _two_steps(learner, groups) -> list[dict]:
    return [learner.train_step(groups) for _ in range(2)]


def test_kl_reference_is_the_frozen_starting_policy_and_enters_the_update_once_the_policy_moved():
    groups = make_groups(policy=StandInPolicy(seed=1), behav_noise=0.1)
    plain = TorchLearner(small_cfg(), StandInPolicy(seed=1))
    kl = TorchLearner(small_cfg("loss.kl_beta=1.0"), StandInPolicy(seed=1))
    start = tensors_digest(kl.full_state_items())
    m_plain, m_kl = plain.train_step(groups), kl.train_step(groups)
    assert "loss/kl_ref" not in m_plain and "loss/kl_ref" in m_kl
    # step 1: the policy is the reference (k3 = 0 and so is its gradient): the same update as without KL
    assert m_kl["loss/kl_ref"] == 0.0 and m_kl["loss/kl"] == m_kl["loss/kl_ref"]
    assert tensors_digest(kl.full_state_items()) == tensors_digest(plain.full_state_items())
    # step 2: the policy has moved, KL to the reference is positive and changes the update
    m_plain, m_kl = plain.train_step(groups), kl.train_step(groups)
    assert m_kl["loss/kl_ref"] > 1e-6
    assert tensors_digest(kl.full_state_items()) != tensors_digest(plain.full_state_items())
    assert tensors_digest(kl.ref_policy.named_parameters()) == start          # the reference never trains
    assert not any(p.requires_grad for p in kl.ref_policy.parameters())


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_kl_reference_matches_torch(dist_env, stage):
    from learner.deepspeed_engine import DeepSpeedLearner

    cfg = small_cfg(f"learner.zero_stage={stage}", "learner.micro_batch_trajectories=3", "loss.kl_beta=0.5")
    groups = make_groups(policy=StandInPolicy(seed=1), behav_noise=0.1)
    ref, ds = TorchLearner(cfg, StandInPolicy(seed=1)), DeepSpeedLearner(cfg, StandInPolicy(seed=1))
    assert (ds.ref_engine is not None) == (stage == 3) and (ds.ref_module is not None) == (stage != 3)
    for m_ref, m_ds in zip(_two_steps(ref, groups), _two_steps(ds, groups)):
        assert m_ds["loss/kl_ref"] == pytest.approx(m_ref["loss/kl_ref"], rel=1e-4, abs=1e-7)
        assert m_ds["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-4, abs=1e-7)
    assert m_ds["loss/kl_ref"] > 1e-6
    for (n1, t1), (n2, t2) in zip(ref.full_state_items(), ds.full_state_items()):
        assert n1 == n2
        torch.testing.assert_close(t2, t1, rtol=1e-4, atol=1e-5)


def test_openvla_checkpoint_under_zero3_exports_a_checkpoint_that_reloads(dist_env, tmp_path):
    """An HF-format policy (the OpenVLA path, on the stand-in checkpoint of tests/openvla_standin.py) gathered from
    ZeRO-3 shards and written with save_pretrained: it reloads as policy.path with the learner's weights."""
    from async_vla.config import load_config
    from async_vla.policy import build_policy
    from learner.deepspeed_engine import DeepSpeedLearner
    from tests.openvla_standin import write_standin_checkpoint

    write_standin_checkpoint(tmp_path / "ckpt", oft=True)
    base = ["policy.arch=openvla_oft", "policy.decoding=parallel", "learner.zero_stage=3",
            "learner.zero3_persistence_threshold=0"]
    ds = DeepSpeedLearner(load_config(None, base + [f"policy.path={tmp_path / 'ckpt'}"]),
                          build_policy(load_config(None, base + [f"policy.path={tmp_path / 'ckpt'}"])))
    full = dict(ds.full_state_items())
    ds.export_policy(tmp_path / "out")
    reloaded = build_policy(load_config(None, base + [f"policy.path={tmp_path / 'out'}"])).state_dict()
    assert reloaded.keys() == full.keys() and all(torch.equal(reloaded[k], full[k]) for k in full)
    assert tensors_digest(ds.full_state_items()) == tensors_digest(full.items())   # shards untouched


def test_resuming_ranks_must_find_the_same_checkpoint(tmp_path):
    """Ranks on several nodes read the run directory on their own node: one that finds another checkpoint (or
    none) stops every rank with the reason, before any loads (a rank alone at v0 would hang the others)."""
    from learner.__main__ import check_ranks_agree_on_checkpoint

    def all_reduce_over(*tags):   # what the ranks' all-reduce (max) returns when they found these tags
        versions = [float(t[1:]) if t else -1.0 for t in tags]
        return lambda flags, op: [max(versions), -min(versions)]

    check_ranks_agree_on_checkpoint("v00000004", tmp_path, all_reduce_over("v00000004", "v00000004"))
    check_ranks_agree_on_checkpoint(None, tmp_path, all_reduce_over(None, None))   # none anywhere: start at 0
    with pytest.raises(SystemExit, match=r"newest v4, oldest none; this rank v4\).*shared filesystem"):
        check_ranks_agree_on_checkpoint("v00000004", tmp_path, all_reduce_over("v00000004", None))
