"""PPO mini-batches (``learner.minibatches``): k optimizer steps per batch against a proximal policy fixed at the
batch start, one version per batch; the k-step update equals a slow plain-torch reference; the clip binds only
with k > 1 under tis / mis; ``loss.adv_norm=batch`` statistics over ranks. (Two DeepSpeed ranks:
tests/test_learner_deepspeed.py.)"""

import copy

import pytest
import torch

from async_vla import grpo
from async_vla.batching import collate, minibatch_rows
from async_vla.config import ConfigError
from async_vla.metrics import VERL_TAGS
from learner.torch_engine import TorchLearner
from tests.learner_helpers import StandInPolicy, make_groups, small_cfg

CALLS = (1, 3, 2, 2, 3, 1, 2, 1)          # 4 groups of 2 trajectories
REWARDS = (1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0)


def _groups(policy=None, seed=0, behav_noise=0.3):
    return make_groups(policy=policy, seed=seed, n_groups=4, calls=CALLS, rewards=REWARDS, behav_noise=behav_noise)


def _reference_update(cfg, policy, groups, k, epochs):
    """k x epochs plain AdamW steps, one per shard of consecutive whole groups, each on that shard's loss
    (grpo.policy_loss over all its trajectories at once, no micro-batches) against pi_prox = the start weights."""
    lc = cfg.learner
    params = [p for p in policy.parameters()]
    opt = torch.optim.AdamW(params, lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay)
    batch = collate(groups, cfg)

    def logp_all():
        return batch.layout(policy.token_logprobs(batch.images, batch.proprio, batch.instructions,
                                                  batch.action_tokens, 1.0).float())

    with torch.no_grad():
        prox = logp_all()
    per_group = len(groups) // k
    shards = [[r for r in range(batch.num_trajectories) if j * per_group <= int(batch.group_index[r]) < (j + 1) * per_group]
              for j in range(k)]
    losses = []
    for _ in range(epochs):
        for rows in shards:
            lp = logp_all()[rows]
            loss, _ = grpo.policy_loss(lp, prox[rows], batch.behav_logprobs[rows], batch.advantages[rows],
                                       batch.mask[rows], cfg.loss)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, lc.grad_clip)
            opt.step()
            losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("aggregation,correction", [("token_mean", "tis"), ("seq_mean_token_mean", "mis")])
def test_k_step_update_equals_slow_reference(aggregation, correction):
    cfg = small_cfg("learner.minibatches=2", "learner.steps_per_batch=2", "learner.micro_batch_trajectories=1",
                    "buffer.groups_per_batch=4", f"loss.aggregation={aggregation}", f"loss.correction={correction}",
                    "learner.lr=0.02")
    policy = StandInPolicy(seed=1)
    groups = _groups(policy=policy)
    ref_policy = copy.deepcopy(policy)
    learner = TorchLearner(cfg, policy)
    m = learner.train_step(groups)
    ref_losses = _reference_update(cfg, ref_policy, groups, k=2, epochs=2)
    for (name, got), (_, want) in zip(learner.full_state_items(), ref_policy.named_parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # one version for the batch, four optimizer steps (2 mini-batches x 2 passes), micro-batches of one trajectory
    assert learner.version == 1 and m["learner/steps_applied"] == 4 and m["learner/optimizer_steps"] == 4
    assert m["learner/minibatches"] == 2 and m["learner/micro_batches"] == 8
    assert m["loss/policy"] == pytest.approx(sum(ref_losses) / len(ref_losses), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_clip_binds_only_with_several_minibatches(correction):
    clip = {}
    for k in (1, 4):
        cfg = small_cfg(f"learner.minibatches={k}", "buffer.groups_per_batch=4", f"loss.correction={correction}",
                        "learner.lr=0.05")
        policy = StandInPolicy(seed=2)
        groups = _groups(policy=policy, behav_noise=0.2)
        m = TorchLearner(cfg, policy).train_step(groups)
        clip[k] = m["loss/clip_frac_low"] + m["loss/clip_frac_high"]
        assert m["actor/pg_clipfrac"] == pytest.approx(clip[k])
        if k == 1:   # pi_prox = pi_theta at the only step: ratio 1, nothing clipped, no proximal KL
            assert clip[k] == 0 and m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        else:
            assert m["actor/ppo_kl"] > 1e-4
    assert clip[4] > 0.01, clip


def test_verl_tags_and_entropy_are_logged():
    cfg = small_cfg("loss.correction=tis")
    policy = StandInPolicy(seed=1)
    groups = make_groups(policy=policy, behav_noise=0.2)
    batch = collate(groups, cfg)
    with torch.no_grad():   # the policy's mean per-token entropy at the batch start, by hand
        _, ent = policy.token_logprobs_entropy(batch.images, batch.proprio, batch.instructions, batch.action_tokens, 1.0)
        want = float(batch.layout(ent)[batch.mask].mean())
    m = TorchLearner(cfg, policy).train_step(groups)
    assert m["actor/entropy"] == pytest.approx(want, rel=1e-5) and 0 < want <= torch.log(torch.tensor(16.0))
    for verl, ours in VERL_TAGS.items():
        if ours in m:
            assert m[verl] == m[ours], verl
    for tag in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "critic/score/mean",
                "rollout_corr/kl", "rollout_corr/rollout_is_mean", "critic/advantages/max"):
        assert tag in m, tag
    assert m["critic/score/mean"] == pytest.approx(0.5)


def test_minibatch_rows_are_disjoint_whole_groups():
    cfg = small_cfg("buffer.groups_per_batch=4")
    batch = collate(_groups(), cfg)
    for k in (1, 2, 3, 4):
        shards = minibatch_rows(batch, k)
        assert len(shards) == k and sorted(r for s in shards for r in s) == list(range(batch.num_trajectories))
        groups_of = [set(batch.group_index[s].tolist()) for s in shards]
        assert all(a.isdisjoint(b) for i, a in enumerate(groups_of) for b in groups_of[i + 1:])
    with pytest.raises(ValueError, match="learner.minibatches=5"):
        minibatch_rows(batch, 5)


def test_config_rejects_minibatches_that_do_not_divide_a_rank_s_groups():
    with pytest.raises(ConfigError, match="learner.minibatches"):
        small_cfg("buffer.groups_per_batch=4", "learner.num_ranks=2", "learner.minibatches=4")
    assert small_cfg("buffer.groups_per_batch=8", "learner.num_ranks=2", "learner.minibatches=4").learner.minibatches == 4


SHARES = ([[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])   # per-rank rewards, different means


def _gloo_rank(rank: int, world: int, init_file: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def all_reduce(t, op):
        buf = t.clone()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return buf

    cfg = small_cfg("loss.adv_norm=batch").loss
    rewards = torch.tensor(SHARES[rank])
    out[rank] = grpo.group_advantages(rewards, cfg, grpo.batch_reward_stats(rewards, cfg, all_reduce)).reshape(-1)
    dist.destroy_process_group()


def test_adv_norm_batch_over_two_gloo_ranks_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(_gloo_rank, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True, start_method="spawn")
    cfg = small_cfg("loss.adv_norm=batch").loss
    union = torch.tensor([x for share in SHARES for row in share for x in row]).reshape(1, -1)
    want = grpo.group_advantages(union, cfg).reshape(-1)
    torch.testing.assert_close(torch.cat([out[0], out[1]]), want, rtol=1e-6, atol=1e-6)
    # per-rank statistics (the old behaviour) give other advantages: the test would catch them
    assert not torch.allclose(grpo.group_advantages(torch.tensor(SHARES[0]), cfg).reshape(-1), want[:4])


def test_batch_reward_stats_of_a_uniform_batch_give_zero_advantages():
    cfg = small_cfg("loss.adv_norm=batch").loss
    stats = grpo.batch_reward_stats(torch.ones(2, 2), cfg, lambda t, op: t)
    assert stats.uniform and (grpo.group_advantages(torch.ones(2, 2), cfg, stats) == 0).all()
    with pytest.raises(ValueError, match="adv_norm=batch"):
        grpo.group_advantages(torch.ones(2, 2), small_cfg().loss, stats)


class _CountingPolicy(StandInPolicy):
    """StandInPolicy that counts its forward passes (token_logprobs_entropy calls token_logprobs: one pass)."""

    def __init__(self, seed):
        super().__init__(seed=seed)
        self.forwards = 0

    def token_logprobs(self, *args):
        self.forwards += 1
        return super().token_logprobs(*args)


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_one_step_per_batch_takes_pi_prox_from_its_own_forward_with_the_same_update(correction):
    """learner.proximal_pass=auto: with one optimizer step per batch, pi_prox's log-probs and entropy come from
    the step's own forward (one pass per micro-batch instead of two); the update and the logged signals equal
    those of the separate no-grad pass (always)."""
    runs = {}
    for mode in ("auto", "always"):
        cfg = small_cfg(f"learner.proximal_pass={mode}", "buffer.groups_per_batch=4", f"loss.correction={correction}",
                        "learner.micro_batch_trajectories=3", "learner.lr=0.05")
        policy = _CountingPolicy(seed=3)
        groups = _groups(policy=policy, behav_noise=0.2)
        learner = TorchLearner(cfg, policy)
        policy.forwards = 0
        m = learner.train_step(groups)
        runs[mode] = (m, policy.forwards, {n: p.detach().clone() for n, p in learner.full_state_items()})
    (m_auto, n_auto, w_auto), (m_always, n_always, w_always) = runs["auto"], runs["always"]
    assert m_auto["learner/micro_batches"] == m_always["learner/micro_batches"] == 3
    assert (n_auto, n_always) == (3, 6)
    for name, want in w_always.items():
        torch.testing.assert_close(w_auto[name], want, rtol=1e-6, atol=1e-7, msg=name)
    for tag in ("loss/policy", "actor/entropy", "offpolicy/behav_kl", "offpolicy/is_weight_mean", "learner/grad_norm",
                "loss/clip_frac_low", "loss/clip_frac_high"):
        assert m_auto[tag] == pytest.approx(m_always[tag], rel=1e-5, abs=1e-8), tag


def test_mis_and_several_steps_keep_the_proximal_pass():
    """mis masks tokens by pi_prox / pi_behav before the loss, and with k > 1 steps the weights move after the
    first: both need pi_prox from a pass of its own, whatever learner.proximal_pass says."""
    for extra in (["loss.correction=mis"], ["loss.correction=none", "learner.minibatches=2"],
                  ["loss.correction=tis", "learner.steps_per_batch=2"]):
        cfg = small_cfg("buffer.groups_per_batch=4", "learner.micro_batch_trajectories=8", *extra)
        policy = _CountingPolicy(seed=4)
        groups = _groups(policy=policy, behav_noise=0.2)
        learner = TorchLearner(cfg, policy)
        policy.forwards = 0
        m = learner.train_step(groups)
        steps = int(m["learner/steps_applied"])
        # one no-grad pass over every micro-batch, then one forward per micro-batch per optimizer step
        assert policy.forwards == m["learner/micro_batches"] * (1 + (steps // m["learner/minibatches"])), extra
