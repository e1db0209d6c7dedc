"""Tests of async_vla.grpo against the slow references in tests/grpo_reference.py and the seed examples."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from async_vla.buffer.filters import difficulty_mask, mixed_outcome
from async_vla.config import LossConfig
from async_vla.grpo import aggregate, group_advantages, importance_weight, nsr_uniforms, policy_loss
from tests.grpo_reference import (
    draws_for,
    ref_aggregation_coef,
    ref_group_advantages,
    ref_plain_grpo_loss,
    ref_policy_loss,
    ref_rescue_probability,
)

D = torch.float64


def _t(x, dtype=D):
    return torch.as_tensor(x, dtype=dtype)


def _one_token_loss(ratio: float, A: float, cfg: LossConfig, generator=None):
    """Loss and d loss / d logp for one token with pi_old = 0.1 (or 0.2) and the given ratio."""
    old = 0.10 if ratio >= 1 else 0.20
    logp = _t([[math.log(old * ratio)]]).requires_grad_(True)
    old_lp = _t([[math.log(old)]])
    loss, metrics = policy_loss(logp, old_lp, old_lp, _t([A]), _t([[1.0]]), cfg, generator=generator)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# ------------------------------------------------------------------------------------------ seed examples
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_seed_clip_examples(correction):
    # Seed 000: pi_old 0.10 -> pi 0.15 is ratio 1.5; clip [0.8, 1.2] uses 1.2, clip-higher [0.8, 1.28] 1.28.
    loss, grad, m = _one_token_loss(1.5, 1.0, LossConfig(eps_low=0.2, eps_high=0.2, correction=correction))
    assert loss == pytest.approx(-1.2, abs=1e-12) and grad == 0.0 and m["clip_frac_high"] == 1.0
    loss, grad, _ = _one_token_loss(1.5, 1.0, LossConfig(eps_low=0.2, eps_high=0.28, correction=correction))
    assert loss == pytest.approx(-1.28, abs=1e-12) and grad == 0.0
    # pi_old 0.20 -> pi 0.10 is ratio 0.5: treated as at least 0.8 (bites for a negative advantage).
    loss, grad, m = _one_token_loss(0.5, -1.0, LossConfig(eps_low=0.2, eps_high=0.28, correction=correction))
    assert loss == pytest.approx(0.8, abs=1e-12) and grad == 0.0 and m["clip_frac_low"] == 1.0
    # Same ratios on the side the clip does not bite keep the unclipped value and gradient -u*A.
    loss, grad, _ = _one_token_loss(1.5, -1.0, LossConfig(correction=correction))
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)
    loss, grad, _ = _one_token_loss(0.5, 1.0, LossConfig(correction=correction))
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)


def test_seed_group_advantages_worked_example():
    rewards = _t([[1, 0, 1, 1, 0, 0, 1, 0]])
    assert rewards.mean().item() == 0.5
    assert rewards.std().item() == pytest.approx(0.535, abs=5e-4)  # unbiased std, as in the seed
    adv = group_advantages(rewards, LossConfig())
    expected = np.where(rewards.numpy() > 0, 1.0, -1.0) * 0.5 / (math.sqrt(2 / 7) + 1e-6)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-12)
    assert adv[0, 0].item() == pytest.approx(0.935, abs=5e-4) and adv[0, 1].item() == pytest.approx(-0.935, abs=5e-4)


@pytest.mark.parametrize("rewards", [[0, 0, 0, 0], [1, 1, 1, 1], [0.1, 0.1, 0.1], [0.7] * 8])
@pytest.mark.parametrize("norm,std", [("group", True), ("group", False), ("batch", True), ("batch", False)])
def test_uniform_group_gives_exact_zero(rewards, norm, std):
    adv = group_advantages(_t([rewards]), LossConfig(adv_norm=norm, adv_std=std))
    assert torch.equal(adv, torch.zeros_like(adv))
    assert mixed_outcome([r > 0.5 for r in rewards], len(rewards)) is False


def test_uniform_group_among_mixed_groups_stays_zero():
    adv = group_advantages(_t([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]), LossConfig())
    assert torch.equal(adv[0], torch.zeros(4, dtype=D)) and torch.equal(adv[2], torch.zeros(4, dtype=D))
    assert torch.isfinite(adv).all() and adv[1, 0] > 0 > adv[1, 1]


def test_advantages_float32_and_single_member_groups_are_finite():
    adv = group_advantages(torch.tensor([[1.0], [0.0]]), LossConfig(adv_norm="group"))
    assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(2, 1))
    adv = group_advantages(torch.tensor([[3, 1], [2, 2]]), LossConfig())  # integer rewards are promoted
    assert adv.dtype == torch.float32 and adv[0, 0] > 0 and adv[1].abs().sum() == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm,std,rclip,aclip", [
    ("group", True, None, None), ("group", False, None, None), ("batch", True, None, None),
    ("batch", False, None, None), ("none", True, None, None), ("group", True, 1.0, 0.8),
    ("batch", True, 0.5, None), ("none", False, 1.5, 1.0),
])
def test_group_advantages_match_reference(seed, norm, std, rclip, aclip):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(0, 2, size=(5, 6))
    rewards[1] = 0.3  # a uniform group in the mix
    rewards[2] = rng.integers(0, 2, 6)
    cfg = LossConfig(adv_norm=norm, adv_std=std, reward_clip=rclip, advantage_clip=aclip)
    got = group_advantages(_t(rewards), cfg).numpy()
    np.testing.assert_allclose(got, ref_group_advantages(rewards.tolist(), cfg), rtol=1e-10, atol=1e-12)


def test_adv_norm_none_is_raw_rewards():
    adv = group_advantages(_t([[1, 1, 1, 1], [1, 0, 0, 0]]), LossConfig(adv_norm="none"))
    assert torch.equal(adv, _t([[1, 1, 1, 1], [1, 0, 0, 0]]))


def test_group_advantages_rejects_wrong_rank():
    with pytest.raises(ValueError):
        group_advantages(_t([1.0, 0.0]), LossConfig())


# ----------------------------------------------------------------------------------------- predicates
@pytest.mark.parametrize("kind", [list, np.array, torch.tensor])
def test_mixed_outcome(kind):
    assert mixed_outcome(kind([True, False, True, True]), 4) is True
    assert mixed_outcome(kind([1, 0, 0, 0]), 4) is True
    assert mixed_outcome(kind([0, 0, 0, 0]), 4) is False
    assert mixed_outcome(kind([1, 1, 1, 1]), 4) is False
    with pytest.raises(ValueError):
        mixed_outcome(kind([1, 0, 1]), 4)


@pytest.mark.parametrize("kind", [float, np.float64, torch.tensor])
def test_difficulty_mask_scalar(kind):
    assert difficulty_mask(kind(0.5), 0.1, 0.95) is True
    assert difficulty_mask(kind(0.1), 0.1, 0.95) is False   # strict bounds
    assert difficulty_mask(kind(0.95), 0.1, 0.95) is False
    assert difficulty_mask(kind(1.0), 0.1, 0.95) is False
    assert difficulty_mask(kind(0.0), 0.1, 0.95) is False


def test_predicates_accept_bfloat16_and_bool_tensors():
    assert difficulty_mask(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.bfloat16), 0.1, 0.95) is True
    assert mixed_outcome(torch.tensor([True, False]), 2) is True


@pytest.mark.parametrize("kind", [list, np.array, torch.tensor])
def test_difficulty_mask_outcomes(kind):
    assert difficulty_mask(kind([1, 0, 0, 0]), 0.1, 0.95) is True
    assert difficulty_mask(kind([1, 1, 1, 1]), 0.1, 0.95) is False
    assert difficulty_mask(kind([False] * 8), 0.1, 0.95) is False


# --------------------------------------------------------------------------- randomized parity vs reference
def _random_batch(seed: int, B: int = 6, T: int = 9, adv_per_token: bool = False, spread: float = 0.35):
    """Ratios spread around the clip bounds, ragged padding holding NaN/inf garbage."""
    rng = np.random.default_rng(seed)
    prox = np.log(rng.uniform(0.02, 0.9, size=(B, T)))
    logp = prox + rng.normal(0, spread, size=(B, T))
    behav = prox + rng.normal(0, spread, size=(B, T))
    ref = logp + rng.normal(0, 0.3, size=(B, T))
    ent = rng.uniform(0, 5, size=(B, T))
    adv = rng.normal(0, 1, size=(B, T) if adv_per_token else (B,))
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0] = T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    if B > 3:
        mask[3] = 0  # one trajectory entirely padding
    garbage = np.array([np.nan, np.inf, -np.inf, 1e30])
    pad = mask == 0
    for arr in (logp, prox, behav, ref, ent) + ((adv,) if adv_per_token else ()):
        arr[pad] = garbage[rng.integers(0, 4, size=pad.sum())]
    return dict(logp=logp, prox=prox, behav=behav, adv=adv, mask=mask, ref=ref, ent=ent)


def _run_both(batch, cfg, seed, with_ref):
    logp = _t(batch["logp"]).requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    ref = _t(batch["ref"]) if with_ref else None
    loss, metrics = policy_loss(logp, _t(batch["prox"]), _t(batch["behav"]), _t(batch["adv"]),
                                _t(batch["mask"]), cfg, generator=gen, ref_logp=ref, entropy=_t(batch["ent"]))
    loss.backward()
    draws = draws_for(batch["logp"].shape, seed)
    r_loss, r_grad, r_metrics = ref_policy_loss(batch["logp"], batch["prox"], batch["behav"], batch["adv"],
                                                batch["mask"], cfg, draws=draws,
                                                ref=batch["ref"] if with_ref else None, entropy=batch["ent"])
    return loss, logp.grad, metrics, r_loss, r_grad, r_metrics


NSR_MODES = [("off", False), ("band", False), ("band", True), ("noise", False)]


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
@pytest.mark.parametrize("nsr,decay", NSR_MODES)
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("dual", [None, 1.6])
@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_policy_loss_matches_reference(correction, nsr, decay, aggregation, dual, kl_beta):
    # Tight tis/mis bounds and a wide NSR band so every branch is hit on a small batch.
    cfg = LossConfig(correction=correction, nsr=nsr, nsr_decay=decay, nsr_band=0.5, nsr_prob=0.5, nsr_noise=0.3,
                     aggregation=aggregation, dual_clip=dual, kl_beta=kl_beta, tis_cap=1.2, mis_low=0.8,
                     mis_high=1.25)
    seed = zlib.crc32(repr((correction, nsr, decay, aggregation, dual, kl_beta)).encode()) % 10_000
    for k, per_token in enumerate((False, True)):
        batch = _random_batch(seed + k, adv_per_token=per_token)
        with_ref = kl_beta > 0 or per_token  # also report kl with kl_beta = 0 (metric only, no loss term)
        loss, grad, metrics, r_loss, r_grad, r_metrics = _run_both(batch, cfg, seed + k, with_ref=with_ref)
        assert math.isfinite(loss.item())
        assert loss.item() == pytest.approx(r_loss, rel=1e-10, abs=1e-12)
        assert torch.isfinite(grad).all()
        np.testing.assert_allclose(grad.numpy(), r_grad, rtol=1e-9, atol=1e-12)
        assert (grad.numpy()[batch["mask"] == 0] == 0).all()
        assert set(metrics) == set(r_metrics)
        for key, value in r_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_parity_cases_exercise_every_branch():
    """Guard for the parity test: its random batches really contain clipped, rescued, dropped and dual tokens."""
    seen = {"clip_frac_low": 0, "clip_frac_high": 0, "nsr_rescued_frac": 0, "mis_masked_frac": 0,
            "dual_clip_frac": 0}
    for seed in range(5):
        for nsr in ("band", "noise"):
            cfg = LossConfig(correction="mis", nsr=nsr, nsr_band=0.5, nsr_noise=0.3, dual_clip=1.6, mis_low=0.8,
                             mis_high=1.25)
            batch = _random_batch(seed)
            metrics = _run_both(batch, cfg, seed, with_ref=False)[2]
            for key in seen:
                seen[key] += metrics[key] > 0
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregate_and_importance_mask_helpers(aggregation):
    """The helpers batching.py builds on agree with the reference and with what policy_loss uses."""
    b = _random_batch(4)
    valid = _t(b["mask"]) > 0
    log_w = torch.where(valid, _t(b["prox"]), 0.0) - torch.where(valid, _t(b["behav"]), 0.0)
    cfg = LossConfig(correction="mis", mis_low=0.8, mis_high=1.25, aggregation=aggregation)
    weight, loss_mask = importance_weight(log_w, valid, cfg)
    assert (loss_mask <= valid).all() and (weight[valid & ~loss_mask] == 0).all() and (~loss_mask & valid).any()
    values = torch.where(valid, _t(b["ref"]), 0.0)
    expected = (ref_aggregation_coef(loss_mask.numpy(), aggregation) * values.numpy()).sum()
    assert aggregate(values, loss_mask, aggregation).item() == pytest.approx(expected, rel=1e-12)
    _, m = policy_loss(*[_t(b[k]) for k in ("logp", "prox", "behav", "adv", "mask")], cfg)
    assert m["mis_masked_frac"] == pytest.approx(1 - loss_mask.sum().item() / valid.sum().item())
    assert aggregate(values, torch.zeros_like(valid), aggregation).item() == 0.0


# ----------------------------------------------------------------------------------------- gradient facts
def test_clipped_tokens_have_zero_gradient_and_others_do_not():
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, correction="none")
    ratios = _t([[1.5, 0.5, 4.0, 1.1, 0.9, 1.5, 0.5]])
    adv = _t([[1.0, -1.0, -1.0, 1.0, -1.0, -1.0, 1.0]])
    old = torch.log(_t([[0.1] * 7]))
    logp = (old + torch.log(ratios)).requires_grad_(True)
    loss, m = policy_loss(logp, old, old, adv, torch.ones(1, 7), cfg)
    loss.backward()
    g = logp.grad[0]
    # upper clip (A>0, 1.5), lower clip (A<0, 0.5), dual clip (A<0, 4 > c=3): zero gradient.
    assert g[0] == 0 and g[1] == 0 and g[2] == 0
    # inside the clip range or on the side the clip does not bite: d(-uA/N)/dlogp = -uA/N.
    np.testing.assert_allclose(g[3:].numpy(), (-ratios[0, 3:] * adv[0, 3:] / 7).numpy(), rtol=1e-12)
    # dual clip bounds the loss of the negative token at c|A| = 3.
    assert m["dual_clip_frac"] == pytest.approx(1 / 7)
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 3.0 - 1.1 + 0.9 + 1.5 - 0.5) / 7)


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_padding_is_inert_even_when_nan_or_inf(correction, aggregation):
    cfg = LossConfig(correction=correction, aggregation=aggregation, kl_beta=0.05, nsr="band", nsr_band=0.5)
    batch = _random_batch(7, adv_per_token=True)
    clean = {k: np.where(batch["mask"] > 0, v, 0.123) for k, v in batch.items() if k != "mask"}
    out = []
    for data in (batch, clean):
        logp = _t(data["logp"]).requires_grad_(True)
        loss, metrics = policy_loss(logp, _t(data["prox"]), _t(data["behav"]), _t(data["adv"]),
                                    _t(batch["mask"]).bool(), cfg, generator=torch.Generator().manual_seed(1),
                                    ref_logp=_t(data["ref"]), entropy=_t(data["ent"]))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert (logp.grad[_t(batch["mask"]) == 0] == 0).all()
        out.append((loss.item(), logp.grad.clone(), metrics))
    assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


def _nsr_grid(cfg: LossConfig, n: int):
    """n rows (independent draws) of tokens at fixed ratios in and around both bands; token_mean over 1 row."""
    hi, lo = 1 + cfg.eps_high, 1 - cfg.eps_low
    ratios = [hi * 1.001, hi * 1.05, hi * 1.09, hi * 1.2, lo * 0.999, lo * 0.95, lo * 0.91, lo * 0.8, 1.0]
    advs = [1.0] * 4 + [-1.0] * 4 + [1.0]
    old = torch.full((n, len(ratios)), math.log(0.1), dtype=D)
    logp = (old + torch.log(_t(ratios))).requires_grad_(True)
    return ratios, advs, old, logp


@pytest.mark.parametrize("nsr,decay", [("band", False), ("band", True), ("noise", False)])
def test_nsr_mean_gradient_matches_expectation(nsr, decay):
    """Mean gradient over n = 4000 independent draws vs p(u) * unclipped gradient.

    Tolerance: the per-token mean of n Bernoulli(p) rescues has std sqrt(p(1-p)/n) <= 0.0079; we allow
    4.5 of those (plus 1e-12), so a wrong p (e.g. the decay slope or the noise window) fails, while the fixed
    seed keeps the test deterministic.
    """
    n = 4000
    cfg = LossConfig(nsr=nsr, nsr_decay=decay, nsr_band=0.1, nsr_prob=0.6, nsr_noise=0.2, correction="none")
    ratios, advs, old, logp = _nsr_grid(cfg, n)
    T = len(ratios)
    loss, m = policy_loss(logp, old, old, _t(advs).expand(n, T), torch.ones(n, T), cfg,
                          generator=torch.Generator().manual_seed(123))
    loss.backward()
    # Per token: gradient of -uA/(nT) when rescued, else 0 -> rescue frequency = grad / (-uA/(nT)).
    freq = (logp.grad / (-_t(ratios) * _t(advs) / (n * T))).mean(0).numpy()
    for j, (u, A) in enumerate(zip(ratios, advs)):
        p = ref_rescue_probability(u, A, cfg) if j < T - 1 else 1.0  # last token: inside the range, always on
        tol = 4.5 * math.sqrt(p * (1 - p) / n) + 1e-12
        assert abs(freq[j] - p) <= tol, (j, u, freq[j], p)
    # Sanity on the analytic probabilities themselves.
    if nsr == "noise":
        assert ref_rescue_probability(ratios[0], 1.0, cfg) == pytest.approx(0.5, abs=0.01)
        assert ref_rescue_probability((1 + cfg.eps_high) / 0.79, 1.0, cfg) == 0.0
    elif decay:
        assert ref_rescue_probability(ratios[1], 1.0, cfg) == pytest.approx(0.6 * 0.5)
    else:
        assert ref_rescue_probability(ratios[3], 1.0, cfg) == 0.0  # beyond the band
    assert 0 < m["nsr_rescued_frac"] < m["clip_frac_high"] + m["clip_frac_low"]


def test_nsr_draws_advance_and_reproduce():
    cfg = LossConfig(nsr="band", nsr_band=0.2, nsr_prob=0.5, correction="none")
    ratios, advs, old, logp = _nsr_grid(cfg, 64)
    args = (logp, old, old, _t(advs).expand(64, len(ratios)), torch.ones(64, len(ratios)), cfg)
    gen = torch.Generator().manual_seed(5)
    first, second = policy_loss(*args, generator=gen)[0], policy_loss(*args, generator=gen)[0]
    again = policy_loss(*args, generator=torch.Generator().manual_seed(5))[0]
    assert first.item() != second.item() and first.item() == again.item()
    draws = nsr_uniforms((3, 4), torch.Generator().manual_seed(0))
    assert draws.dtype == torch.float32 and draws.shape == (3, 4)


def test_nsr_prob_extremes():
    base = LossConfig(correction="none")
    ratios, advs, old, logp = _nsr_grid(base, 8)
    args = (logp, old, old, _t(advs).expand(8, len(ratios)), torch.ones(8, len(ratios)))
    off = policy_loss(*args, LossConfig(correction="none"))[0]
    p0 = policy_loss(*args, LossConfig(correction="none", nsr="band", nsr_prob=0.0))[0]
    p1, m1 = policy_loss(*args, LossConfig(correction="none", nsr="band", nsr_prob=1.0, nsr_band=0.1))
    assert p0.item() == off.item()
    # p = 1 rescues exactly the in-band tokens: 3 upper + 3 lower of the 8 silenced per row.
    assert m1["nsr_rescued_frac"] == pytest.approx(6 / 9) and m1["clip_frac_high"] == pytest.approx(4 / 9)


# ----------------------------------------------------------------------------------- correction identities
@pytest.mark.parametrize("seed", range(4))
def test_tis_and_none_with_prox_equal_behav_is_plain_grpo(seed):
    b = _random_batch(seed)
    mask = b["mask"]
    logp = np.where(mask > 0, b["logp"], 0.0)
    old = np.where(mask > 0, b["prox"], 0.0)
    expected = ref_plain_grpo_loss(logp, old, b["adv"], mask, 0.2, 0.28)
    losses = []
    for corr in ("tis", "none", "mis"):
        lp = _t(logp).requires_grad_(True)
        loss, m = policy_loss(lp, _t(old), _t(old), _t(b["adv"]), _t(mask), LossConfig(correction=corr))
        assert loss.item() == pytest.approx(expected, rel=1e-12)
        assert m["is_weight_mean"] == 1.0 and m["behav_kl"] == 0.0 and m["mis_masked_frac"] == 0.0
        loss.backward()
        losses.append((loss.item(), lp.grad))
    assert losses[0][0] == losses[1][0] == losses[2][0]
    assert torch.equal(losses[0][1], losses[1][1]) and torch.equal(losses[0][1], losses[2][1])


def test_correction_none_ignores_prox():
    b = _random_batch(3)
    args = [_t(b[k]) for k in ("logp", "prox", "behav", "adv", "mask")]
    loss_a = policy_loss(*args, LossConfig(correction="none"))[0]
    args[1] = args[1] + 0.7
    loss_b = policy_loss(*args, LossConfig(correction="none"))[0]
    assert loss_a.item() == loss_b.item()


def test_tis_weight_is_truncated_and_detached():
    old, behav = torch.log(_t([[0.1, 0.1]])), torch.log(_t([[0.02, 0.1]]))  # w = 5 and 1
    logp = old.clone().requires_grad_(True)
    loss, m = policy_loss(logp, old, behav, _t([1.0]), torch.ones(1, 2), LossConfig(correction="tis", tis_cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)
    np.testing.assert_allclose(logp.grad.numpy(), [[-1.0, -0.5]])
    assert m["is_weight_max"] == pytest.approx(5.0) and m["is_weight_mean"] == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------- errors, dtypes
def test_kl_requires_reference():
    b = _random_batch(0)
    args = [_t(b[k]) for k in ("logp", "prox", "behav", "adv", "mask")]
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(*args, LossConfig(kl_beta=0.1))
    _, m = policy_loss(*args, LossConfig(kl_beta=0.0))
    assert "kl" not in m


def test_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        policy_loss(x, x, x, torch.zeros(3), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError):
        policy_loss(x, torch.zeros(2, 4), x, torch.zeros(2), torch.ones(2, 3), LossConfig())


def test_empty_mask_gives_zero_loss_and_grad():
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        loss, m = policy_loss(logp, logp.detach(), logp.detach(), torch.ones(2), torch.zeros(2, 3),
                              LossConfig(aggregation=agg))
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
        assert all(math.isfinite(v) for v in m.values())


def test_bfloat16_logp_is_computed_in_float32():
    b = _random_batch(2)
    mask = _t(b["mask"])
    args64 = [torch.where(mask > 0, _t(b[k]), 0.0) for k in ("logp", "prox", "behav")]
    loss64 = policy_loss(*args64, _t(b["adv"]), mask, LossConfig())[0]
    lp = args64[0].to(torch.bfloat16).requires_grad_(True)
    loss16, _ = policy_loss(lp, args64[1].to(torch.bfloat16), args64[2].to(torch.bfloat16),
                            _t(b["adv"]).float(), mask, LossConfig())
    loss16.backward()
    assert loss16.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16
    assert loss16.item() == pytest.approx(loss64.item(), abs=0.05)


def test_nsr_without_generator_uses_global_rng():
    cfg = LossConfig(nsr="band", nsr_band=0.2, correction="none")
    ratios, advs, old, logp = _nsr_grid(cfg, 32)
    args = (logp, old, old, _t(advs).expand(32, len(ratios)), torch.ones(32, len(ratios)), cfg)
    torch.manual_seed(9)
    first = policy_loss(*args)[0].item()
    torch.manual_seed(9)
    assert policy_loss(*args)[0].item() == first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    """Same batch and the same CPU generator on both devices: same loss, gradient and metrics."""
    cfg = LossConfig(correction="mis", mis_low=0.8, mis_high=1.25, nsr="band", nsr_band=0.5, kl_beta=0.1,
                     dual_clip=1.6)
    batch = _random_batch(11, adv_per_token=True)
    out = []
    for device in ("cpu", "cuda"):
        logp = _t(batch["logp"]).to(device).requires_grad_(True)
        data = [_t(batch[k]).to(device) for k in ("prox", "behav", "adv", "mask")]
        loss, m = policy_loss(logp, *data, cfg, generator=torch.Generator().manual_seed(3),
                              ref_logp=_t(batch["ref"]).to(device))
        loss.backward()
        out.append((loss.item(), logp.grad.cpu(), m))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-10)
    np.testing.assert_allclose(out[1][1].numpy(), out[0][1].numpy(), rtol=1e-9, atol=1e-12)
    assert out[1][2] == pytest.approx(out[0][2], rel=1e-9, abs=1e-12)
    adv = group_advantages(_t([[1, 0, 1, 1, 0, 0, 1, 0]]).cuda(), LossConfig())
    assert adv.is_cuda and adv[0, 0].item() == pytest.approx(0.935, abs=5e-4)


def test_metrics_are_python_floats():
    b = _random_batch(1)
    _, m = policy_loss(*[_t(b[k]) for k in ("logp", "prox", "behav", "adv", "mask")],
                       LossConfig(kl_beta=0.1, nsr="noise"), generator=torch.Generator().manual_seed(0),
                       ref_logp=_t(b["ref"]), entropy=_t(b["ent"]))
    expected = {"clip_frac_low", "clip_frac_high", "nsr_rescued_frac", "dual_clip_frac", "is_weight_mean",
                "is_weight_max", "mis_masked_frac", "approx_kl", "behav_kl", "kl", "entropy", "policy_loss", "loss"}
    assert set(m) == expected and all(type(v) is float for v in m.values())


def test_benchmark_quick_smoke():
    from benchmarks import loss as bench

    out = bench.run(quick=True)
    assert out["section"] == "loss" and isinstance(out["markdown"], str)
    assert out["results"]["ratio"] > 0 and "policy_loss_ms" in out["results"]

