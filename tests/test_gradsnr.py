"""async_vla.gradsnr: the gradient signal-to-noise statistics against explicit vectors, and the score vectors
against the gradient of the project's own GRPO loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_vla import gradsnr
from async_vla.batching import shuffle_outcomes
from tests.learner_helpers import StandInPolicy, make_traj, small_cfg


def _vectors(n_groups=12, size=4, dim=50, signal=1.0, noise=1.0, seed=0):
    """Per-trajectory vectors whose advantage-weighted group sums are m + noise."""
    rng = np.random.default_rng(seed)
    m = rng.normal(size=dim) * signal
    S, adv, groups = [], [], []
    for i in range(n_groups):
        a = np.array([1.0, -1.0] * (size // 2))
        vecs = rng.normal(size=(size, dim)) * noise
        vecs[0] += m / 2
        vecs[1] -= m / 2      # a0 v0 + a1 v1 carries +m
        groups.append(np.arange(i * size, (i + 1) * size))
        S.append(vecs)
        adv.append(a)
    return np.concatenate(S), np.concatenate(adv), groups, m


def test_group_gram_is_the_gram_of_the_explicit_group_gradients():
    S, adv, groups, _ = _vectors()
    g = np.stack([adv[idx] @ S[idx] for idx in groups])
    np.testing.assert_allclose(gradsnr.group_gram(S @ S.T, adv, groups), g @ g.T, rtol=1e-10)


def test_permutation_keeps_each_groups_advantages_and_moves_some():
    _, adv, groups, _ = _vectors()
    perm = gradsnr.permute_within_groups(adv, groups, np.random.default_rng(0))
    for idx in groups:
        assert sorted(perm[idx]) == sorted(adv[idx])
    assert (perm != adv).any()


def test_shuffled_outcomes_keep_each_groups_rewards_and_the_trajectories():
    group = [make_traj("g", j, 2, float(j < 2), seed=j) for j in range(6)]
    got = shuffle_outcomes(group, np.random.default_rng(0))
    assert sorted(t.reward for t in got) == sorted(t.reward for t in group)
    assert [t.traj_id for t in got] == [t.traj_id for t in group]
    assert all(t.success == (t.reward > 0.5) for t in got)
    assert [t.reward for t in got] != [t.reward for t in group]
    for a, b in zip(got, group):
        np.testing.assert_array_equal(a.action_tokens, b.action_tokens)


def test_signal_share_recovers_a_known_share_and_vanishes_under_permutation():
    dim, noise = 40, 0.3
    S, adv, groups, m = _vectors(n_groups=400, dim=dim, noise=noise, seed=1)
    K = S @ S.T
    G = gradsnr.group_gram(K, adv, groups)
    truth = (m @ m) / (m @ m + 4 * dim * noise ** 2)    # 4 members, each adds noise^2 per dimension
    est = gradsnr.signal_share(G, cells=[0] * len(groups))
    assert abs(est["rho"] - truth) < 0.05 * truth
    perm = gradsnr.permute_within_groups(adv, groups, np.random.default_rng(2))
    assert abs(gradsnr.signal_share(gradsnr.group_gram(K, perm, groups), [0] * len(groups))["rho"]) < 0.2 * truth


def test_signal_share_weights_cells_and_leaves_out_single_group_cells():
    rng = np.random.default_rng(3)
    g = rng.normal(size=(5, 7))
    G = g @ g.T
    cells = ["a", "a", "b", "b", "c"]        # c has one group: no same-cell pair
    p = {"a": 0.5, "b": 0.25, "c": 0.25}
    got = gradsnr.signal_share(G, cells, p)
    members = {"a": [0, 1], "b": [2, 3], "c": [4]}
    num = den = 0.0
    for ca in members:
        for cb in members:
            pairs = [(i, j) for i in members[ca] for j in members[cb] if i != j]
            if pairs:
                num += p[ca] * p[cb] * np.mean([g[i] @ g[j] for i, j in pairs])
                den += p[ca] * p[cb]
    total = sum(p[c] * np.mean([g[i] @ g[i] for i in members[c]]) for c in members)
    assert got["signal"] == pytest.approx(num / den) and got["total"] == pytest.approx(total)
    assert got["rho"] == pytest.approx(num / den / total) and got["cells"] == 3


def test_pair_means_sort_pairs_by_relation_and_projection_weighs_them():
    rng = np.random.default_rng(6)
    g = rng.normal(size=(6, 9))
    G = g @ g.T
    cells = [(0, 0), (0, 0), (0, 1), (1, 0), (1, 0), (1, 2)]
    got = gradsnr.pair_means(G, cells)
    assert got["same_state"] == pytest.approx(np.mean([g[0] @ g[1], g[3] @ g[4]]))
    assert got["same_task"] == pytest.approx(np.mean([g[0] @ g[2], g[1] @ g[2], g[3] @ g[5], g[4] @ g[5]]))
    others = [g[i] @ g[j] for i in range(3) for j in range(3, 6)]
    assert got["other_task"] == pytest.approx(np.mean(others)) and got["other_task_pairs"] == 9
    assert got["total"] == pytest.approx(np.mean([v @ v for v in g]))
    # one task, one state: every pair is a same-state pair; many states: the same-task pairs dominate
    assert gradsnr.projected_rho(got, 1, 1) == pytest.approx(got["same_state"] / got["total"])
    mix = gradsnr.projected_rho(got, 2, 4)
    expect = (got["same_state"] / 8 + (3 / 4) / 2 * got["same_task"] + 0.5 * got["other_task"]) / got["total"]
    assert mix == pytest.approx(expect)


def test_batch_cosines_are_cosines_of_explicit_batch_sums():
    S, adv, groups, _ = _vectors(n_groups=10)
    g = np.stack([adv[idx] @ S[idx] for idx in groups])
    got = gradsnr.batch_cosines(g @ g.T, 3, np.random.default_rng(5), draws=4)
    rng = np.random.default_rng(5)
    for d in range(4):
        order = rng.permutation(10)
        a, b = g[order[:3]].sum(0), g[order[3:6]].sum(0)
        assert got[d] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    with pytest.raises(ValueError, match="need 12 groups"):
        gradsnr.batch_cosines(g @ g.T, 6, np.random.default_rng(0))


def test_batch_size_for_half_signal_and_the_expected_cosine_agree():
    for rho in (0.003, 0.05, 0.4):
        k = gradsnr.groups_for_share(rho, 0.5)
        assert gradsnr.expected_cosine(rho, k) == pytest.approx(0.5)
    assert gradsnr.groups_for_share(0.0) == float("inf")


def test_measure_finds_signal_where_there_is_some_and_not_where_there_is_none():
    S, adv, groups, _ = _vectors(n_groups=40, dim=30, noise=0.5, seed=4)
    with_signal = gradsnr.measure(S @ S.T, adv, groups, [0] * 40, batch_sizes=(1, 4), permutations=100, draws=50)
    assert with_signal["p_value"] <= 0.02 and with_signal["rho"] > with_signal["rho_null_95"]
    k4 = [r for r in with_signal["by_batch_size"] if r["k"] == 4][0]
    assert k4["cosine"] > k4["cosine_permuted"] + 0.2
    S0, adv0, groups0, _ = _vectors(n_groups=40, dim=30, signal=0.0, noise=0.5, seed=4)
    without = gradsnr.measure(S0 @ S0.T, adv0, groups0, [0] * 40, batch_sizes=(4,), permutations=100, draws=50)
    assert without["p_value"] > 0.05


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_scores_give_the_gradient_of_the_grpo_loss_at_the_sampling_weights(aggregation):
    """At lag 0 the gradient of grpo.policy_loss over a collated batch is -sum_t w_t A_t s_t, with s_t from
    trajectory_scores and w_t the aggregation's weight: the decomposition bin/grad-snr rests on."""
    from async_vla import grpo
    from async_vla.batching import collate

    cfg = small_cfg(f"loss.aggregation={aggregation}", "loss.correction=none")
    policy = StandInPolicy(seed=1)
    rewards = [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    calls = [[1, 3, 2], [2, 2, 1]]
    groups = [[make_traj(f"g{k}", j, calls[k][j], rewards[k][j], seed=10 * k + j, mask_tail=j % 2, policy=policy)
               for j in range(3)] for k in range(2)]
    batch = collate(groups, cfg)
    logp = batch.layout(policy.token_logprobs(batch.images, batch.proprio, batch.instructions, batch.action_tokens,
                                              1.0).float())
    loss, _ = grpo.policy_loss(logp, logp.detach(), batch.behav_logprobs, batch.advantages, batch.mask, cfg.loss)
    params = [p for p in policy.parameters() if p.requires_grad]
    direct = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).double()

    trajs = [t for g in groups for t in g]
    scores, counts = gradsnr.trajectory_scores(policy, trajs, temperature=1.0)
    adv = batch.advantages.double()
    if aggregation == "token_mean":
        w = torch.full((len(trajs),), 1.0 / counts.sum(), dtype=torch.float64)
    else:
        w = 1.0 / (len(trajs) * torch.from_numpy(counts))
    predicted = -(scores.double() * (w * adv)[:, None]).sum(0)
    torch.testing.assert_close(predicted, direct, rtol=1e-5, atol=1e-7)
    # and score_gram is the Gram of those per-trajectory directions
    K = gradsnr.score_gram(scores, counts, aggregation)
    S = scores.double() / (1.0 if aggregation == "token_mean" else torch.from_numpy(counts)[:, None])
    np.testing.assert_allclose(K, (S @ S.T).numpy(), rtol=1e-9)


def test_scores_of_some_action_dimensions_are_the_gradient_of_those_tokens_only():
    from tests.learner_helpers import DOF

    policy = StandInPolicy(seed=3)
    trajs = [make_traj("g", j, 3, float(j % 2), seed=j, mask_tail=1, policy=policy) for j in range(3)]
    scores, counts = gradsnr.trajectory_scores(policy, trajs, 1.0, dims=[1], action_dim=DOF)
    params = [p for p in policy.parameters() if p.requires_grad]
    for row, t in enumerate(trajs):
        logp = policy.token_logprobs(torch.tensor(t.images), torch.tensor(t.proprio), [t.instruction] * t.num_calls,
                                     torch.tensor(t.action_tokens), 1.0)
        keep = torch.tensor(t.token_mask) & (torch.arange(logp.shape[-1]) % DOF == 1)
        grads = torch.autograd.grad(torch.where(keep, logp, 0.0).sum(), params)
        torch.testing.assert_close(scores[row], torch.cat([g.reshape(-1) for g in grads]))
        assert counts[row] == float(keep.sum())
    with pytest.raises(ValueError, match="action_dim"):
        gradsnr.trajectory_scores(policy, trajs, 1.0, dims=[1])


def test_sharpness_matches_a_position_by_position_reference():
    rng = np.random.default_rng(3)

    def log_softmax(x):
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref = log_softmax(rng.normal(size=(40, 17)) * rng.uniform(0.2, 3.0, size=(40, 1)))
    logp = log_softmax(rng.normal(size=(40, 17)) * rng.uniform(0.2, 3.0, size=(40, 1)))
    logp[:10] = ref[:10] * 1.5                    # some positions share the reference's mode
    logp[:10] -= np.log(np.exp(logp[:10]).sum(-1, keepdims=True))
    got = gradsnr.sharpness(logp, ref, window=2)
    ent, on, near, agree, shift = [], [], [], [], []
    for row, ref_row in zip(logp, ref):
        probs, ref_probs = [float(np.exp(v)) for v in row], [float(np.exp(v)) for v in ref_row]
        m = max(range(17), key=lambda b: ref_probs[b])
        ent.append(-sum(q * np.log(q) for q in probs))
        on.append(probs[m])
        near.append(sum(q for b, q in enumerate(probs) if abs(b - m) <= 2))
        agree.append(max(range(17), key=lambda b: probs[b]) == m)
        shift.append(sum(b * q for b, q in enumerate(probs)) - sum(b * q for b, q in enumerate(ref_probs)))
    assert got["positions"] == 40 and got["window"] == 2
    assert got["entropy"] == pytest.approx(np.mean(ent))
    assert got["mode_mass"] == pytest.approx(np.mean(on))
    assert got["near_mode_mass"] == pytest.approx(np.mean(near))
    assert got["mode_agreement"] == pytest.approx(np.mean(agree)) and 0.25 <= got["mode_agreement"] < 1
    assert got["mean_shift"] == pytest.approx(np.mean(shift))
    assert got["abs_mean_shift"] == pytest.approx(np.mean(np.abs(shift))) and got["abs_mean_shift"] > 0


def test_sharpness_tells_a_sharpened_reference_from_a_shifted_one():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(30, 32))

    def log_softmax(x):
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref = log_softmax(logits)
    same = gradsnr.sharpness(ref, ref)
    sharp = gradsnr.sharpness(log_softmax(3.0 * logits), ref)            # the same modes, a lower temperature
    moved = gradsnr.sharpness(log_softmax(np.roll(logits, 3, axis=1)), ref)   # every bin 3 to the right
    assert same["mode_agreement"] == sharp["mode_agreement"] == 1.0 and same["mean_shift"] == pytest.approx(0)
    assert sharp["entropy"] < same["entropy"] and sharp["mode_mass"] > same["mode_mass"]
    assert moved["entropy"] == pytest.approx(same["entropy"]) and moved["mode_agreement"] < 0.2
    assert moved["mode_mass"] < same["mode_mass"]
    with pytest.raises(ValueError, match="reference_logp"):
        gradsnr.sharpness(np.zeros((3, 4)), np.zeros((2, 4)))


def test_pooled_sharpness_of_parts_is_the_sharpness_of_their_union():
    rng = np.random.default_rng(5)

    def log_softmax(x):
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    logp, ref = log_softmax(rng.normal(size=(50, 9))), log_softmax(rng.normal(size=(50, 9)))
    cuts = [0, 7, 8, 30, 50]
    parts = [gradsnr.sharpness(logp[a:b], ref[a:b], window=1) for a, b in zip(cuts, cuts[1:])]
    whole, pooled = gradsnr.sharpness(logp, ref, window=1), gradsnr.pool_sharpness(parts)
    assert pooled.keys() == whole.keys()
    for key, value in whole.items():
        assert pooled[key] == pytest.approx(value)
    with pytest.raises(ValueError, match="one window"):
        gradsnr.pool_sharpness([parts[0], gradsnr.sharpness(logp, ref, window=2)])
