"""collate layout, advantages, micro-batches, and the exactness of micro-batch loss weighting."""

import numpy as np
import pytest
import torch

from async_vla import grpo
from async_vla.batching import collate, compute_advantages, micro_batches
from async_vla.grpo import aggregation_units, loss_token_mask, micro_batch_weight
from tests.learner_helpers import IMG, PROPRIO, T, StandInPolicy, make_groups, make_traj, small_cfg


def test_collate_layout():
    cfg = small_cfg()
    groups = make_groups()  # calls (1, 3 | 2, 2); first member of each group has its last token masked
    b = collate(groups, cfg)
    trajs = [t for g in groups for t in g]
    assert b.num_trajectories == 4 and b.max_calls == 3 and b.tokens_per_call == T
    assert b.images.shape == (8, IMG, IMG, 3) and b.images.dtype == torch.uint8
    assert b.proprio.shape == (8, PROPRIO) and b.action_tokens.shape == (8, T) and len(b.instructions) == 8
    assert b.call_row.tolist() == [0, 1, 1, 1, 2, 2, 3, 3]
    assert b.call_slot.tolist() == [0, 0, 1, 2, 0, 1, 0, 1]
    assert b.behav_logprobs.shape == (4, 3 * T) and b.mask.shape == (4, 3 * T)
    assert b.num_calls.tolist() == [1, 3, 2, 2] and b.group_index.tolist() == [0, 0, 1, 1]
    for r, t in enumerate(trajs):
        n = t.num_calls
        np.testing.assert_array_equal(b.mask[r, :n * T].numpy(), t.token_mask.reshape(-1))
        assert not b.mask[r, n * T:].any()  # padding calls are never valid
        np.testing.assert_array_equal(b.behav_logprobs[r, :n * T].numpy()[t.token_mask.reshape(-1)],
                                      t.behav_logprobs.reshape(-1)[t.token_mask.reshape(-1)])
        assert (b.behav_logprobs[r, n * T:] == 0).all()
    assert b.mask[0].sum() == T - 1 and b.num_valid_tokens == 8 * T - 2
    # layout() puts call c of row r at columns slot*T..: per-call values come back where they belong
    per_call = torch.arange(8 * T, dtype=torch.float32).reshape(8, T).requires_grad_()
    lay = b.layout(per_call)
    assert lay[1, T:2 * T].tolist() == per_call[2].tolist()
    assert lay[3, :T].tolist() == per_call[6].tolist() and (lay[0, T:] == 0).all()
    lay.sum().backward()  # differentiable, each call exactly once
    assert (per_call.grad == 1).all()
    assert b.lag(3).tolist() == [3, 3, 3, 3]


def test_advantages_per_group_and_broadcast():
    cfg = small_cfg()
    groups = make_groups(rewards=(1.0, 0.0, 0.0, 1.0))
    b = collate(groups, cfg)
    want = grpo.group_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), cfg.loss).reshape(-1)
    assert torch.allclose(b.advantages, want)
    assert b.advantages[0] > 0 > b.advantages[1] and b.advantages[3] > 0
    # one advantage per trajectory broadcasts to all of its tokens inside the loss
    lp = torch.zeros_like(b.behav_logprobs)
    loss, _ = grpo.policy_loss(lp, lp, lp, b.advantages, b.mask, cfg.loss)
    per_tok = -b.advantages[:, None].expand_as(lp)
    assert torch.isclose(loss, per_tok[b.mask].mean())


def test_unequal_group_sizes():
    cfg = small_cfg()
    g1 = [make_traj("a", i, 1, r, seed=i) for i, r in enumerate((1.0, 0.0, 0.0))]
    g2 = [make_traj("b", i, 1, r, seed=10 + i) for i, r in enumerate((1.0, 0.0))]
    adv = compute_advantages([g1, g2], cfg.loss)
    a1 = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0]]), cfg.loss).reshape(-1)
    a2 = grpo.group_advantages(torch.tensor([[1.0, 0.0]]), cfg.loss).reshape(-1)
    assert torch.allclose(adv, torch.cat([a1, a2]))
    batch_cfg = small_cfg("loss.adv_norm=batch").loss
    ab = compute_advantages([g1, g2], batch_cfg)
    assert torch.allclose(ab, grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]]), batch_cfg)[0])


def test_collate_rejects_wrong_tokens_per_call():
    with pytest.raises(ValueError, match="tokens per call"):
        collate(make_groups(), small_cfg("policy.chunk_size=3"))
    with pytest.raises(ValueError):
        collate([], small_cfg())


def test_micro_batches_are_whole_trajectories():
    cfg = small_cfg()
    b = collate(make_groups(), cfg)
    mbs = micro_batches(b, 3)
    assert [m.num_trajectories for m in mbs] == [3, 1]
    assert sum(m.num_calls_total for m in mbs) == b.num_calls_total
    rows = 0
    for m in mbs:
        w = m.max_calls * T
        assert torch.equal(m.mask, b.mask[rows:rows + m.num_trajectories, :w])
        assert torch.equal(m.behav_logprobs, b.behav_logprobs[rows:rows + m.num_trajectories, :w])
        assert torch.equal(m.advantages, b.advantages[rows:rows + m.num_trajectories])
        per_call = torch.randn(m.num_calls_total, T)
        assert m.layout(per_call).shape == m.mask.shape
        rows += m.num_trajectories
    assert micro_batches(b, 16) == [b]
    # an arbitrary row order selects whole trajectories too
    s = b.select([2, 0])
    assert s.num_calls.tolist() == [2, 1] and s.call_row.tolist() == [0, 0, 1]
    assert torch.equal(s.action_tokens[:2], b.action_tokens[4:6])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_micro_batch_weighting_equals_full_batch(aggregation, correction):
    """sum_m (U_m / U) * loss_m == loss(full batch), for the loss and its gradient (module docstring)."""
    cfg = small_cfg(f"loss.aggregation={aggregation}", f"loss.correction={correction}",
                    "loss.mis_low=0.9", "loss.mis_high=1.1")
    policy = StandInPolicy(seed=5)
    groups = make_groups(policy=policy, calls=(1, 3, 2, 4, 2, 1), n_groups=3,
                         rewards=(1.0, 0.0, 0.0, 1.0, 1.0, 0.0), behav_noise=0.2)
    b = collate(groups, cfg)

    def logp_of(batch):
        return batch.layout(policy.token_logprobs(batch.images, batch.proprio, batch.instructions,
                                                  batch.action_tokens, 1.0))

    with torch.no_grad():
        prox_full = logp_of(b) + 0.05  # prox != current so the ratio and clipping matter
    policy.zero_grad()
    full, _ = grpo.policy_loss(logp_of(b), prox_full, b.behav_logprobs, b.advantages, b.mask, cfg.loss)
    full.backward()
    g_full = [p.grad.clone() for p in policy.parameters()]

    mbs = micro_batches(b, 2)
    assert len(mbs) == 3
    with torch.no_grad():
        proxes = [logp_of(m) + 0.05 for m in mbs]
    masks = [loss_token_mask(p, m.behav_logprobs, m.mask, cfg.loss) for p, m in zip(proxes, mbs)]
    if correction == "mis":
        assert sum(int((m.mask & ~lm).sum()) for m, lm in zip(mbs, masks)) > 0  # MIS really masks some
    units = [float(aggregation_units(lm, aggregation)) for lm in masks]
    total = sum(units)
    policy.zero_grad()
    acc = 0.0
    for m, p, u in zip(mbs, proxes, units):
        loss, _ = grpo.policy_loss(logp_of(m), p, m.behav_logprobs, m.advantages, m.mask, cfg.loss)
        (loss * micro_batch_weight(u, total)).backward()
        acc += float(loss.detach()) * micro_batch_weight(u, total)
    assert acc == pytest.approx(float(full.detach()), rel=1e-5, abs=1e-7)
    for g, p in zip(g_full, policy.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    # two "ranks" whose gradients are averaged: weights world * U_m / U_global reproduce the same loss
    w2 = [micro_batch_weight(u, total, world=2) for u in units]
    assert sum(w2) / 2 == pytest.approx(1.0) and micro_batch_weight(3.0, 0.0) == 0.0


def test_collate_keeps_every_call_s_tokens_images_and_versions_in_call_order():
    groups = make_groups(seed=3)
    b = collate(groups, small_cfg())
    calls = [(t, c) for g in groups for t in g for c in range(t.num_calls)]
    assert b.action_tokens.dtype == torch.int64 and len(calls) == b.action_tokens.shape[0]
    for i, (t, c) in enumerate(calls):
        assert b.action_tokens[i].tolist() == t.action_tokens[c].tolist()
        assert torch.equal(b.images[i], torch.from_numpy(t.images[c]))
        assert int(b.call_versions[i]) == int(t.chunk_versions[c])
