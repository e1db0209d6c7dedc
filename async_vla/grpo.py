"""GRPO advantages and the off-policy-corrected, clipped policy loss (pure torch; no processes, no state).

Notation (docs/LEARNER.md "The step"; the loss options: docs/CONFIG.md, section loss):
    pi_b  behaviour policy (the actor that sampled the tokens)      -> ``behav_logp``
    pi_p  proximal policy (learner weights at batch start)          -> ``prox_logp``
    pi_t  current policy (differentiable)                           -> ``logp``
    u = pi_t / pi_p   (PPO ratio, clipped)       w = pi_p / pi_b   (importance weight, corrected)

Token loss (to MINIMISE):  l = -w * obj(u, A) + kl_beta * k3(ref, logp), where
    obj = min(u A, clip(u, 1 - eps_low, 1 + eps_high) A), optionally dual-clipped and NSR-rescued.

Everything here is a small pure function so that tests/grpo_reference.py can mirror it line by line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

from async_vla.config import LossConfig

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp: exp(88) overflows float32, and an inf ratio on a
# token whose branch torch.where discards still turns its gradient into 0 * inf = NaN. e^20 ~ 4.9e8 is far
# beyond any clip bound, so the clamp only touches tokens that carry no gradient anyway (or absurd ones).
LOG_RATIO_CLAMP = 20.0


# ----------------------------------------------------------------------------------------------- advantages
@dataclass(frozen=True)
class RewardStats:
    """Statistics of (clipped) rewards over a batch spread over learner ranks: ``adv_norm=batch`` normalises every
    rank's share with them, as one process would the union (``batch_reward_stats``)."""

    mean: float
    std: float
    """Unbiased (n - 1) sample std; 0 for a single reward."""
    uniform: bool
    """Every reward equal (max == min): advantages are exactly 0."""


def clip_rewards(rewards: Tensor, cfg: LossConfig) -> Tensor:
    """Rewards in the loss precision (>= float32), clipped to +-reward_clip when set: the first stage of
    ``group_advantages``."""
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    return r.clamp(-cfg.reward_clip, cfg.reward_clip) if cfg.reward_clip is not None else r


def batch_reward_stats(rewards: Tensor, cfg: LossConfig, all_reduce: Callable[[Tensor, str], Tensor]
                       ) -> RewardStats:
    """``RewardStats`` of the union of every rank's ``rewards`` (this rank's share). ``all_reduce(t, op)`` sums or
    maximises a float64 tensor over the ranks; two passes, like torch.std (no sum-of-squares cancellation)."""
    r = clip_rewards(rewards, cfg).reshape(-1).double()
    n_sum = all_reduce(torch.stack([r.sum(), torch.tensor(float(r.numel()), dtype=torch.float64)]), "sum")
    n = float(n_sum[1])
    if n == 0:
        raise ValueError("batch_reward_stats: no rewards on any rank")
    mean = float(n_sum[0]) / n
    big = torch.finfo(torch.float64).max
    hi_neglo = all_reduce(torch.stack([r.max() if r.numel() else torch.tensor(-big, dtype=torch.float64),
                                       -r.min() if r.numel() else torch.tensor(-big, dtype=torch.float64)]), "max")
    sq = float(all_reduce(((r - mean) ** 2).sum().reshape(1), "sum")[0])
    std = (sq / (n - 1)) ** 0.5 if n > 1 else 0.0
    return RewardStats(mean=mean, std=std, uniform=float(hi_neglo[0]) == -float(hi_neglo[1]))


def group_advantages(rewards: Tensor, cfg: LossConfig, stats: Optional[RewardStats] = None) -> Tensor:
    """Group-relative advantages for rewards [num_groups, G] -> [num_groups, G]: clip rewards to +-reward_clip ->
    normalise (``cfg.adv_norm``: ``group`` per row, ``batch`` over the whole tensor or ``stats``, ``none`` raw) -> clip
    to +-advantage_clip. ``adv_std=False`` keeps only the centring (Dr.GRPO). The std is the unbiased sample std; a
    uniform group gives exactly zero advantages (max == min), never NaN. Why each: docs/LEARNER.md "Group
    advantages"."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if stats is not None and cfg.adv_norm != "batch":
        raise ValueError(f"batch reward statistics only apply to loss.adv_norm=batch, not {cfg.adv_norm!r}")
    r = clip_rewards(rewards, cfg)
    if cfg.adv_norm == "none":
        adv = r
    elif stats is not None:
        centred = torch.zeros_like(r) if stats.uniform else r - stats.mean
        # A uniform batch: numerator 0, divide by 1 (as _normalise does).
        adv = centred / ((1.0 if stats.uniform else stats.std) + cfg.adv_eps) if cfg.adv_std else centred
    else:
        dims = (-1,) if cfg.adv_norm == "group" else (0, 1)
        adv = _normalise(r, dims, cfg.adv_std, cfg.adv_eps)
    if cfg.advantage_clip is not None:
        adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip)
    return adv


def _normalise(r: Tensor, dims: tuple[int, ...], use_std: bool, eps: float) -> Tensor:
    """(r - mean) [/ (std + eps)] over ``dims``; exactly 0 where the reduced slice is uniform."""
    uniform = r.amax(dim=dims, keepdim=True) == r.amin(dim=dims, keepdim=True)
    centred = torch.where(uniform, torch.zeros_like(r), r - r.mean(dim=dims, keepdim=True))
    if not use_std:
        return centred
    n = int(np.prod([r.shape[d] for d in dims]))
    std = r.std(dim=dims, keepdim=True, correction=1 if n > 1 else 0)
    # A uniform slice has std 0 (or NaN for n == 1); its numerator is already 0, so divide by 1 instead.
    std = torch.where(uniform, torch.ones_like(std), std)
    return centred / (std + eps)


# ------------------------------------------------------------------------------------------ policy loss
def nsr_uniforms(shape: torch.Size | tuple[int, ...], generator: Optional[torch.Generator] = None,
                 device: torch.device | str | None = None) -> Tensor:
    """The per-token U(0, 1) draws NSR consumes: one float32 draw for every token of ``shape``, on the generator's
    device (then moved), so a test can reproduce ``policy_loss``'s draws from a generator seeded alike."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(tuple(shape), generator=generator, dtype=torch.float32, device=gen_device)
    return u.to(device) if device is not None else u


def importance_weight(log_w: Tensor, valid: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """Off-policy weight from log w = log pi_p - log pi_b -> (weight [B,T], loss_mask [B,T] bool). none: 1. tis:
    min(w, tis_cap). mis (icepop): w where mis_low <= w <= mis_high, else the token leaves ``loss_mask``. The weight is
    data, never differentiated; ``log_w`` must be 0 on padding."""
    if cfg.correction == "none":
        return torch.ones_like(log_w), valid
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if cfg.correction == "tis":
        return w.clamp(max=cfg.tis_cap), valid
    keep = (w >= cfg.mis_low) & (w <= cfg.mis_high)
    return torch.where(keep, w, torch.zeros_like(w)), valid & keep


def nsr_rescue(u: Tensor, clip_hi: Tensor, clip_lo: Tensor, draws: Tensor, cfg: LossConfig) -> Tensor:
    """Which silenced tokens keep their unclipped gradient (bool [B,T]); ``u`` detached, draws U(0, 1).

    band:  upper band (1+eh, (1+eh)(1+m)], lower band [(1-el)(1-m), 1-el); rescued when draw < p, with p =
           nsr_prob, or with nsr_decay p falling linearly from nsr_prob at the bound to 0 at the far edge.
    noise: xi = 1 - delta + 2 delta draw ~ U(1-delta, 1+delta); rescued when u*xi lands back inside
           [1-el, 1+eh] (probability 1/2 just past the bound, 0 beyond (1+eh)/(1-delta)).
    """
    hi, lo = 1.0 + cfg.eps_high, 1.0 - cfg.eps_low
    if cfg.nsr == "noise":
        noisy = u * (1.0 - cfg.nsr_noise + 2.0 * cfg.nsr_noise * draws.to(u.dtype))
        return (clip_hi | clip_lo) & (noisy >= lo) & (noisy <= hi)
    m = cfg.nsr_band
    in_band = (clip_hi & (u <= hi * (1.0 + m))) | (clip_lo & (u >= lo * (1.0 - m)))
    if cfg.nsr_decay:
        # Distance past the bound as a fraction of the band width (0 at the bound, 1 at the far edge).
        frac = torch.where(clip_hi, (u - hi) / (hi * m), (lo - u) / (lo * m))
        p = cfg.nsr_prob * (1.0 - frac)
    else:
        p = torch.full_like(u, cfg.nsr_prob)
    return in_band & (draws.to(u.dtype) < p)


def clipped_objective(u: Tensor, adv: Tensor, cfg: LossConfig, draws: Optional[Tensor]
                      ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-token clipped PPO objective (to MAXIMISE), as data: -> (keep, frozen, flags); ``u`` detached. obj = u*A where
    ``keep``, the constant ``frozen`` elsewhere, so silenced tokens (A > 0 and u > 1+eh, or A < 0 and u < 1-el) get an
    exact zero gradient and NSR can swap the branch per token. Dual clip (c > 1): for A < 0, obj = max(obj, cA)."""
    hi, lo = 1.0 + cfg.eps_high, 1.0 - cfg.eps_low
    clip_hi = (adv > 0) & (u > hi)
    clip_lo = (adv < 0) & (u < lo)
    silenced = clip_hi | clip_lo
    flags = {"clip_hi": clip_hi, "clip_lo": clip_lo}
    if cfg.nsr != "off" and draws is not None:
        flags["rescued"] = nsr_rescue(u, clip_hi, clip_lo, draws, cfg)
        silenced = silenced & ~flags["rescued"]
    frozen = u.clamp(lo, hi) * adv
    if cfg.dual_clip is not None:
        flags["dual"] = (adv < 0) & (u > cfg.dual_clip)
        frozen = torch.where(flags["dual"], cfg.dual_clip * adv, frozen)
        silenced = silenced | flags["dual"]
    return ~silenced, frozen, flags


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: e^d - d - 1 with d = ref - logp (>= 0, unbiased
    under samples from pi). d is clamped to +-LOG_RATIO_CLAMP, like every log-ratio here."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def aggregation_weights(loss_mask: Tensor, mode: str, dtype: torch.dtype) -> Tensor:
    """Weights a [B,T] with aggregated loss = sum_bt a_bt l_bt (0 outside ``loss_mask``). token_mean: 1/N.
    seq_mean_token_mean: 1/(S n_b). seq_mean_token_sum: 1/S. S counts sequences with at least one loss token; an
    empty batch gives all-zero weights."""
    m = loss_mask.to(dtype)
    if mode == "token_mean":
        return m / m.sum().clamp(min=1)
    counts = m.sum(dim=-1, keepdim=True)
    num_seqs = (counts > 0).sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        return m / (counts.clamp(min=1) * num_seqs)
    if mode == "seq_mean_token_sum":
        return m / num_seqs
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate(token_loss: Tensor, loss_mask: Tensor, mode: str) -> Tensor:
    """Token values [B,T] -> scalar as policy_loss aggregates them: S / max(U, 1), with U the number of loss
    tokens (token_mean) or of sequences with a loss token (seq_mean_*); see ``aggregation_weights``."""
    tl = torch.where(loss_mask, token_loss, torch.zeros_like(token_loss))
    return (aggregation_weights(loss_mask, mode, token_loss.dtype) * tl).sum()


def policy_loss(logp: Tensor, prox_logp: Tensor, behav_logp: Tensor, advantages: Tensor, mask: Tensor,
                cfg: LossConfig, generator: Optional[torch.Generator] = None, ref_logp: Optional[Tensor] = None,
                entropy: Optional[Tensor] = None) -> tuple[Tensor, dict[str, float]]:
    """Decoupled-PPO / GRPO loss to minimise -> (scalar loss, metrics of python floats).

    logp [B,T] (differentiable), prox_logp / behav_logp / ref_logp / entropy [B,T] (data); advantages [B] or [B,T];
    mask [B,T]. Padded tokens contribute nothing whatever they hold, NaN and inf included (every input goes through
    torch.where first). correction "none" takes the ratio against the sampler (u = pi_t / pi_b, w = 1). NSR draws come
    from ``nsr_uniforms(logp.shape, generator)``. The metrics (clip, NSR, dual-clip and MIS fractions, IS weights,
    approx / behaviour / reference KL, entropy, policy_loss, loss): docs/LEARNER.md "TensorBoard"."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name, t in (("prox_logp", prox_logp), ("behav_logp", behav_logp), ("mask", mask),
                    ("ref_logp", ref_logp), ("entropy", entropy)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")
    if cfg.kl_beta > 0 and ref_logp is None:
        raise ValueError("loss.kl_beta > 0 needs ref_logp (log-probs of the reference policy)")

    dtype = torch.promote_types(logp.dtype, torch.float32)  # bf16 log-probs: do the loss in float32
    valid = mask if mask.dtype == torch.bool else mask != 0
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def clean(t: Tensor) -> Tensor:  # padded positions -> 0, detached unless it is logp itself
        return torch.where(valid, t.to(dtype), zero)

    lp = clean(logp)
    behav = clean(behav_logp.detach())
    prox_given = clean(prox_logp.detach())
    prox = behav if cfg.correction == "none" else prox_given
    adv = clean(_broadcast_advantages(advantages.detach(), shape))

    log_w = prox_given - behav  # from the given prox even for "none", where w is only reported
    weight, loss_mask = importance_weight(log_w, valid, cfg)
    log_u = (lp - prox).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    u = torch.exp(log_u)
    draws = nsr_uniforms(shape, generator, logp.device) if cfg.nsr != "off" else None
    keep, frozen, flags = clipped_objective(u.detach(), adv, cfg, draws)
    a = aggregation_weights(loss_mask, cfg.aggregation, dtype)

    # Surrogate sum_bt a w (-obj): on kept tokens obj = uA is linear in u, elsewhere a constant. Folding all
    # the clip / NSR / IS / aggregation decisions into data coefficients leaves autograd a short chain
    # (where, sub, clamp, exp, mul, sum) instead of ~20 nodes; at 64x56 tokens per-op overhead, not
    # arithmetic, is the loss's cost. tests/grpo_reference.py checks the gradient this yields.
    neg_aw = -(a * weight)
    coef = torch.where(keep, neg_aw * adv, zero)
    surrogate = (coef * u).sum() + torch.where(keep, zero, neg_aw * frozen).sum()
    loss = surrogate
    kl_tok = None
    if ref_logp is not None:
        kl_tok = kl_k3(lp if cfg.kl_beta > 0 else lp.detach(), clean(ref_logp.detach()))
        if cfg.kl_beta > 0:
            loss = loss + cfg.kl_beta * (a * kl_tok).sum()

    metrics = _metrics(u.detach(), log_u.detach(), log_w, valid, loss_mask, flags,
                       surrogate.detach(), loss.detach(), None if kl_tok is None else kl_tok.detach(),
                       None if entropy is None else clean(entropy.detach()))
    return loss, metrics


def _broadcast_advantages(adv: Tensor, shape: torch.Size) -> Tensor:
    if adv.shape == shape:
        return adv
    if adv.dim() == 1 and adv.shape[0] == shape[0]:
        return adv[:, None].expand(shape)
    raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(adv.shape)}")


def _metrics(u: Tensor, log_u: Tensor, log_w: Tensor, valid: Tensor, loss_mask: Tensor,
             flags: dict[str, Tensor], surrogate: Tensor, loss: Tensor, kl_tok: Optional[Tensor],
             entropy: Optional[Tensor]) -> dict[str, float]:
    """Every metric from one stacked masked sum and one .tolist(): a single device sync and a handful of
    kernels (a dozen separate .item() calls cost more than the loss itself at 64x56 tokens)."""
    with torch.no_grad():
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # raw, before truncation / masking
        over = {"valid": valid, "loss": loss_mask}
        rows = {  # metric -> (per-token value, tokens it is averaged over); absent inputs are skipped
            "clip_frac_low": (flags["clip_lo"], "loss"),
            "clip_frac_high": (flags["clip_hi"], "loss"),
            "nsr_rescued_frac": (flags.get("rescued"), "loss"),
            "dual_clip_frac": (flags.get("dual"), "loss"),
            "mis_masked_frac": (~loss_mask, "valid"),
            "is_weight_mean": (w, "valid"),
            "behav_kl": (w - log_w - 1.0, "valid"),        # k3 with ratio w
            "approx_kl": (u - log_u - 1.0, "loss"),        # k3 with ratio u
            "kl": (kl_tok, "loss"),
            "entropy": (entropy, "valid"),
        }
        rows = {k: v for k, v in rows.items() if v[0] is not None}
        values = torch.stack([value.to(u.dtype) for value, _ in rows.values()])
        masks = torch.stack([over[m] for _, m in rows.values()])
        sums = torch.where(masks, values, torch.zeros((), dtype=u.dtype, device=u.device)).sum(dim=(1, 2))
        extra = torch.stack([valid.sum().to(u.dtype), loss_mask.sum().to(u.dtype),
                             torch.where(valid, w, torch.zeros_like(w)).amax(), surrogate, loss])
        flat = torch.cat([sums, extra]).tolist()
    n_valid, n_loss, w_max, surr, total = flat[len(rows):]
    count = {"valid": max(n_valid, 1.0), "loss": max(n_loss, 1.0)}
    out = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "nsr_rescued_frac": 0.0, "dual_clip_frac": 0.0}
    for (name, (_, m)), row_sum in zip(rows.items(), flat):
        out[name] = row_sum / count[m]
    out.update(is_weight_max=w_max, policy_loss=surr, loss=total)
    return out


# ------------------------------------------------------------------------------------------- loss layout
# Exact aggregation over micro-batches: micro-batch m's loss S_m / max(U_m, 1) weighted by W * U_m / U_global sums
# to the global batch's loss (derivation: docs/LEARNER.md "Micro-batches are exact").


def loss_token_mask(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, loss_cfg: LossConfig) -> Tensor:
    """The tokens ``policy_loss`` will average over: valid tokens minus MIS-masked ones (as policy_loss computes
    them)."""
    valid = mask if mask.dtype == torch.bool else mask != 0
    if loss_cfg.correction == "none":
        return valid
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    log_w = torch.where(valid, prox_logp.float(), zero) - torch.where(valid, behav_logp.float(), zero)
    return importance_weight(log_w, valid, loss_cfg)[1]


def aggregation_units(loss_mask: Tensor, aggregation: str) -> Tensor:
    """The count ``aggregate`` divides by (before its clamp to >= 1), as a float scalar tensor:
    loss tokens for token_mean, trajectories with >= 1 loss token for the seq_mean_* modes."""
    if aggregation == "token_mean":
        return loss_mask.sum().to(torch.float64)
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return (loss_mask.sum(dim=-1) > 0).sum().to(torch.float64)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def micro_batch_weight(units: float, total_units: float, world: int = 1) -> float:
    """Weight of a micro-batch loss so the weighted sum (averaged over ``world`` ranks) equals the full-batch loss:
    ``world * units / total_units`` (``total_units`` over the global batch); an empty batch gives 0."""
    if total_units <= 0:
        return 0.0
    return float(world) * float(units) / float(total_units)
