"""Slow, obvious references for async_vla.grpo: python loops over floats, written close to the math.

Nothing here is vectorised or clever on purpose; the tests compare the vectorised torch code against it.
Gradients are analytic (d loss / d logp per token), not autograd, so the two sides share no machinery.
Conventions that are decisions rather than math (unbiased std, MIS drops tokens from the count, sequences
without loss tokens leave the sequence mean, log-ratios clamped to +-20) are mirrored from the docstrings
of async_vla/grpo.py.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

CLAMP = 20.0  # async_vla.grpo.LOG_RATIO_CLAMP


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


# ----------------------------------------------------------------------------------------------- advantages
def ref_group_advantages(rewards: list[list[float]], cfg) -> list[list[float]]:
    """A_i = (r_i - mean) / (std + eps) with the unbiased std, group = row or batch = everything."""
    rc = cfg.reward_clip
    r = [[_clamp(x, -rc, rc) if rc is not None else x for x in row] for row in rewards]
    if cfg.adv_norm == "none":
        adv = [list(row) for row in r]
    elif cfg.adv_norm == "group":
        adv = [_ref_normalise(row, cfg) for row in r]
    else:
        flat = _ref_normalise([x for row in r for x in row], cfg)
        G = len(r[0])
        adv = [flat[i * G:(i + 1) * G] for i in range(len(r))]
    ac = cfg.advantage_clip
    if ac is not None:
        adv = [[_clamp(a, -ac, ac) for a in row] for row in adv]
    return adv


def _ref_normalise(xs: list[float], cfg) -> list[float]:
    n = len(xs)
    if all(x == xs[0] for x in xs):  # no contrast in the slice: no signal
        return [0.0] * n
    mean = sum(xs) / n
    out = [x - mean for x in xs]
    if cfg.adv_std:
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        out = [a / (std + cfg.adv_eps) for a in out]
    return out


# -------------------------------------------------------------------------------------------------- NSR
def ref_rescue_probability(u: float, A: float, cfg) -> float:
    """P(token keeps its unclipped gradient | ratio u, advantage A), analytically; 0 if not silenced."""
    hi, lo = 1.0 + cfg.eps_high, 1.0 - cfg.eps_low
    upper = A > 0 and u > hi
    lower = A < 0 and u < lo
    if cfg.nsr == "off" or not (upper or lower):
        return 0.0
    if cfg.nsr == "noise":
        # xi ~ U(1-d, 1+d); rescued iff lo <= u xi <= hi  <=>  xi in [lo/u, hi/u].
        d = cfg.nsr_noise
        a, b = max(1.0 - d, lo / u), min(1.0 + d, hi / u)
        return max(0.0, b - a) / (2.0 * d)
    m = cfg.nsr_band
    if upper:
        if u > hi * (1 + m):
            return 0.0
        frac = (u - hi) / (hi * m)
    else:
        if u < lo * (1 - m):
            return 0.0
        frac = (lo - u) / (lo * m)
    return cfg.nsr_prob * (1.0 - frac) if cfg.nsr_decay else cfg.nsr_prob


def ref_rescued(u: float, A: float, draw: float, cfg) -> bool:
    """The sampled rescue decision for one token, given its U(0,1) draw (same draw as the torch code)."""
    hi, lo = 1.0 + cfg.eps_high, 1.0 - cfg.eps_low
    if cfg.nsr == "off" or not ((A > 0 and u > hi) or (A < 0 and u < lo)):
        return False
    if cfg.nsr == "noise":
        d = cfg.nsr_noise
        xi = 1.0 - d + 2.0 * d * draw
        return lo <= u * xi <= hi
    return draw < ref_rescue_probability(u, A, cfg)


# ------------------------------------------------------------------------------------------- policy loss
def ref_policy_loss(logp, prox, behav, adv, mask, cfg, draws=None, ref=None, entropy=None):
    """-> (loss, dloss/dlogp [B][T] as numpy, metrics dict). Inputs are numpy/lists; adv is [B] or [B,T]."""
    logp, prox, behav, mask = (np.asarray(x, dtype=np.float64) for x in (logp, prox, behav, mask))
    adv = np.asarray(adv, dtype=np.float64)
    B, T = logp.shape
    hi, lo = 1.0 + cfg.eps_high, 1.0 - cfg.eps_low

    tok_loss = np.zeros((B, T))   # l_bt
    tok_grad = np.zeros((B, T))   # d l_bt / d logp_bt
    in_loss = np.zeros((B, T), dtype=bool)
    m = {k: 0.0 for k in ("clip_lo", "clip_hi", "rescued", "dual", "kl", "approx_kl", "w_sum", "w_max",
                          "behav_kl", "ent", "n_valid", "mis_dropped")}
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                continue  # padding: never read
            m["n_valid"] += 1
            A = adv[b] if adv.ndim == 1 else adv[b, t]
            w_raw = math.exp(_clamp(prox[b, t] - behav[b, t], -CLAMP, CLAMP))
            m["w_sum"] += w_raw
            m["w_max"] = max(m["w_max"], w_raw)
            m["behav_kl"] += w_raw - (prox[b, t] - behav[b, t]) - 1.0
            if entropy is not None:
                m["ent"] += entropy[b, t]

            # Off-policy weight w = pi_prox / pi_behav.
            p = behav[b, t] if cfg.correction == "none" else prox[b, t]
            if cfg.correction == "none":
                w = 1.0
            elif cfg.correction == "tis":
                w = min(w_raw, cfg.tis_cap)
            else:
                if not (cfg.mis_low <= w_raw <= cfg.mis_high):
                    m["mis_dropped"] += 1
                    continue
                w = w_raw
            in_loss[b, t] = True

            # PPO ratio u = pi_theta / pi_prox and the clipped surrogate min(uA, clip(u) A).
            log_u = _clamp(logp[b, t] - p, -CLAMP, CLAMP)
            u = math.exp(log_u)
            d_u = u if abs(logp[b, t] - p) < CLAMP else 0.0  # du/dlogp (0 where the clamp is active)
            unclipped, clipped = u * A, _clamp(u, lo, hi) * A
            obj, d_obj = (unclipped, d_u * A) if unclipped <= clipped else (clipped, 0.0)
            if clipped < unclipped:
                m["clip_hi" if A > 0 else "clip_lo"] += 1
                if ref_rescued(u, A, draws[b, t] if draws is not None else 1.0, cfg):
                    m["rescued"] += 1
                    obj, d_obj = unclipped, d_u * A
            if cfg.dual_clip is not None and A < 0 and cfg.dual_clip * A > obj:
                m["dual"] += 1
                obj, d_obj = cfg.dual_clip * A, 0.0
            m["approx_kl"] += u - log_u - 1.0

            l, g = -w * obj, -w * d_obj
            if ref is not None:
                d = _clamp(ref[b, t] - logp[b, t], -CLAMP, CLAMP)
                d_d = -1.0 if abs(ref[b, t] - logp[b, t]) < CLAMP else 0.0
                kl = math.exp(d) - d - 1.0
                m["kl"] += kl
                if cfg.kl_beta > 0:
                    tok_loss[b, t] += cfg.kl_beta * kl
                    tok_grad[b, t] += cfg.kl_beta * (math.exp(d) - 1.0) * d_d
            tok_loss[b, t] += l
            tok_grad[b, t] += g

    # Aggregation weights c_bt: loss = sum c_bt l_bt, so dloss/dlogp_bt = c_bt dl_bt/dlogp_bt.
    coef = ref_aggregation_coef(in_loss, cfg.aggregation)
    n_tok = int(in_loss.sum())
    loss = float((coef * tok_loss).sum())
    grad = coef * tok_grad

    n_loss, n_valid = max(n_tok, 1), max(m["n_valid"], 1)
    kl_part = 0.0
    if ref is not None and cfg.kl_beta > 0:
        # Recompute the aggregated KL alone so policy_loss = loss - kl_beta * KL.
        for b in range(B):
            for t in range(T):
                if in_loss[b, t]:
                    d = _clamp(ref[b, t] - logp[b, t], -CLAMP, CLAMP)
                    kl_part += coef[b, t] * cfg.kl_beta * (math.exp(d) - d - 1.0)
    metrics = {
        "clip_frac_low": m["clip_lo"] / n_loss, "clip_frac_high": m["clip_hi"] / n_loss,
        "nsr_rescued_frac": m["rescued"] / n_loss, "dual_clip_frac": m["dual"] / n_loss,
        "is_weight_mean": m["w_sum"] / n_valid, "is_weight_max": m["w_max"],
        "mis_masked_frac": m["mis_dropped"] / n_valid, "approx_kl": m["approx_kl"] / n_loss,
        "behav_kl": m["behav_kl"] / n_valid, "policy_loss": loss - kl_part, "loss": loss,
    }
    if ref is not None:
        metrics["kl"] = m["kl"] / n_loss
    if entropy is not None:
        metrics["entropy"] = m["ent"] / n_valid
    return loss, grad, metrics


def ref_aggregation_coef(in_loss, mode: str) -> np.ndarray:
    """c_bt with aggregated loss = sum_bt c_bt l_bt: token_mean 1/N; seq_mean_token_mean 1/(S n_b);
    seq_mean_token_sum 1/S; S = sequences with at least one loss token."""
    in_loss = np.asarray(in_loss, dtype=bool)
    B, T = in_loss.shape
    coef = np.zeros((B, T))
    n_tok = int(in_loss.sum())
    seqs = [b for b in range(B) if in_loss[b].any()]
    for b in range(B):
        for t in range(T):
            if not in_loss[b, t]:
                continue
            if mode == "token_mean":
                coef[b, t] = 1.0 / n_tok
            elif mode == "seq_mean_token_mean":
                coef[b, t] = 1.0 / (len(seqs) * in_loss[b].sum())
            else:
                coef[b, t] = 1.0 / len(seqs)
    return coef


def ref_plain_grpo_loss(logp, old_logp, adv, mask, eps_low: float, eps_high: float) -> float:
    """Textbook clipped GRPO, token mean: -(1/N) sum min(u A, clip(u, 1-el, 1+eh) A)."""
    total, n = 0.0, 0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if mask[b][t]:
                u = math.exp(logp[b][t] - old_logp[b][t])
                A = adv[b]
                total += min(u * A, _clamp(u, 1 - eps_low, 1 + eps_high) * A)
                n += 1
    return -total / n


def draws_for(shape, seed: Optional[int]):
    """The NSR draws policy_loss will consume from torch.Generator().manual_seed(seed), as numpy."""
    import torch

    from async_vla.grpo import nsr_uniforms

    return nsr_uniforms(shape, torch.Generator().manual_seed(seed)).double().numpy()
