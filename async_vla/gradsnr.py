"""How much of a GRPO update is signal: one group's signal share ``rho = |m|^2 / E|g|^2`` (m the expected group
gradient) and what it gives a batch of k groups, estimated from recorded groups on the Gram matrix of
per-trajectory score vectors, against a within-group permutation of the advantages. Pure numpy except
``trajectory_scores``. The derivation: docs/LEARNER.md "Gradient signal-to-noise"; used by bin/grad-snr."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def group_gram(K: np.ndarray, adv: np.ndarray, groups: Sequence[np.ndarray]) -> np.ndarray:
    """``G[i, j] = g_i . g_j`` with ``g_i = sum_{t in groups[i]} adv[t] s_t``, from ``K[t, u] = s_t . s_u``."""
    A = np.zeros((len(groups), K.shape[0]))
    for i, idx in enumerate(groups):
        A[i, idx] = adv[idx]
    return A @ K @ A.T


def permute_within_groups(adv: np.ndarray, groups: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """A copy of ``adv`` whose values are shuffled among the members of each group (the noise-only baseline)."""
    out = np.array(adv, dtype=np.float64, copy=True)
    for idx in groups:
        out[idx] = out[rng.permutation(idx)]
    return out


def signal_share(G: np.ndarray, cells: Sequence, weights: Optional[dict] = None) -> dict:
    """One group's signal share ``rho`` for groups drawn from ``cells`` (e.g. (task, init state)) with probabilities
    ``weights`` (default: the recorded mix); ``G`` is the groups' Gram matrix. A cell with one group has no same-cell
    pair and is left out of the signal. Returns {"signal", "total", "rho", "groups", "cells"}."""
    cells = list(cells)
    if len(cells) != G.shape[0]:
        raise ValueError(f"{len(cells)} cell labels for {G.shape[0]} groups")
    labels = sorted(set(cells), key=repr)
    members = {c: np.array([i for i, x in enumerate(cells) if x == c]) for c in labels}
    if weights is None:
        weights = {c: len(members[c]) / len(cells) for c in labels}
    p = np.array([float(weights[c]) for c in labels])
    p = p / p.sum()
    num = den = 0.0
    for a, ca in enumerate(labels):
        for b, cb in enumerate(labels):
            block = G[np.ix_(members[ca], members[cb])]
            if a == b:
                n = len(members[ca])
                if n < 2:
                    continue
                mean = (block.sum() - np.trace(block)) / (n * (n - 1))
            else:
                mean = block.mean()
            num += p[a] * p[b] * mean
            den += p[a] * p[b]
    signal = num / den if den > 0 else float("nan")
    total = float(sum(p[a] * np.mean(np.diag(G)[members[c]]) for a, c in enumerate(labels)))
    return {"signal": float(signal), "total": total, "rho": float(signal / total) if total > 0 else float("nan"),
            "groups": len(cells), "cells": len(labels)}


def pair_means(G: np.ndarray, cells: Sequence[tuple[int, int]]) -> dict:
    """Mean ``g_i . g_j`` over distinct group pairs by relation ("same_state", "same_task", "other_task"), with pair
    counts, and the mean ``|g_i|^2`` ("total"): the pieces of ``projected_rho``."""
    cells = [tuple(c) for c in cells]
    sums = {"same_state": [0.0, 0], "same_task": [0.0, 0], "other_task": [0.0, 0]}
    for i in range(len(cells)):
        for j in range(i + 1, len(cells)):
            kind = ("same_state" if cells[i] == cells[j] else
                    "same_task" if cells[i][0] == cells[j][0] else "other_task")
            sums[kind][0] += G[i, j]
            sums[kind][1] += 1
    out = {k: (v[0] / v[1] if v[1] else float("nan")) for k, v in sums.items()}
    out.update({f"{k}_pairs": v[1] for k, v in sums.items()})
    out["total"] = float(np.mean(np.diag(G)))
    return out


def projected_rho(means: dict, tasks: int, states: int) -> float:
    """One group's signal share for ``tasks`` x ``states`` drawn uniformly, from ``pair_means``: two draws share the
    state with probability 1/(tasks states), the task only with (1 - 1/states)/tasks, neither with 1 - 1/tasks."""
    p_same = 1.0 / (tasks * states)
    p_task = (1.0 - 1.0 / states) / tasks
    p_other = 1.0 - 1.0 / tasks
    signal = p_same * means["same_state"]
    if p_task > 0:
        signal += p_task * means["same_task"]
    if p_other > 0:
        signal += p_other * means["other_task"]
    return float(signal / means["total"])


def expected_cosine(rho: float, k: int) -> float:
    """Signal share of a batch of k groups = expected cosine between two disjoint batches' gradients."""
    return k * rho / (1.0 + (k - 1) * rho)


def groups_for_share(rho: float, share: float = 0.5) -> float:
    """Groups per batch for the batch's signal share to reach ``share`` (inf when rho <= 0)."""
    if rho <= 0:
        return float("inf")
    return share * (1.0 - rho) / (rho * (1.0 - share))


def batch_cosines(G: np.ndarray, k: int, rng: np.random.Generator, draws: int = 200) -> np.ndarray:
    """Cosines between the gradients of two disjoint batches of k groups, for ``draws`` random splits of the
    groups (each batch gradient the sum of its groups' gradients)."""
    n = G.shape[0]
    if 2 * k > n:
        raise ValueError(f"two disjoint batches of {k} groups need {2 * k} groups, {n} given")
    out = np.empty(draws)
    for d in range(draws):
        order = rng.permutation(n)
        a, b = order[:k], order[k:2 * k]
        ab, aa, bb = G[np.ix_(a, b)].sum(), G[np.ix_(a, a)].sum(), G[np.ix_(b, b)].sum()
        out[d] = ab / np.sqrt(aa * bb) if aa > 0 and bb > 0 else 0.0
    return out


def measure(K: np.ndarray, adv: np.ndarray, groups: Sequence[np.ndarray], cells: Sequence,
            batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), permutations: int = 200, draws: int = 200,
            seed: int = 0) -> dict:
    """The report for one problem: rho with its permutation null (``p_value``: share of permutations with rho at least
    the real one, +1 smoothing; ``rho_null_95``), the groups per batch for a half-signal update, and batch cosines real
    / permuted by batch size."""
    rng = np.random.default_rng(seed)
    G = group_gram(K, adv, groups)
    real = signal_share(G, cells)
    null = np.array([signal_share(group_gram(K, permute_within_groups(adv, groups, rng), groups), cells)["rho"]
                     for _ in range(permutations)])
    G_perm = group_gram(K, permute_within_groups(adv, groups, rng), groups)
    by_k = []
    for k in batch_sizes:
        if 2 * k > len(groups):
            continue
        cos_real = batch_cosines(G, k, rng, draws)
        cos_perm = batch_cosines(G_perm, k, rng, draws)
        by_k.append({"k": int(k), "cosine": float(cos_real.mean()), "cosine_permuted": float(cos_perm.mean()),
                     "expected_from_rho": expected_cosine(real["rho"], k)})
    return {**real,
            "rho_null_mean": float(null.mean()) if permutations else None,
            "rho_null_95": float(np.quantile(null, 0.95)) if permutations else None,
            "p_value": float((1 + np.sum(null >= real["rho"])) / (1 + permutations)) if permutations else None,
            "groups_for_half_signal": groups_for_share(real["rho"], 0.5),
            "by_batch_size": by_k}


def trajectory_scores(policy, trajectories: Sequence, temperature: float, dims: Optional[Sequence[int]] = None,
                      action_dim: Optional[int] = None):
    """Per-trajectory score vectors: the gradient of each trajectory's masked token log-probs at ``temperature``,
    float32 [N, #trainable parameters], with each one's token count [N]. ``dims``: only tokens of these action
    dimensions. One backward per trajectory; the weights are not changed."""
    import torch

    if dims is not None and not action_dim:
        raise ValueError("trajectory_scores: dims needs action_dim")

    params = [p for p in policy.parameters() if p.requires_grad]
    scores = torch.empty((len(trajectories), sum(p.numel() for p in params)), dtype=torch.float32)
    counts = np.empty(len(trajectories))
    for row, traj in enumerate(trajectories):
        mask = torch.tensor(np.asarray(traj.token_mask, dtype=bool))   # copies: decoded arrays are read-only
        if dims is not None:
            mask &= torch.tensor(np.isin(np.arange(mask.shape[-1]) % action_dim, list(dims)))
        logp = policy.token_logprobs(torch.tensor(np.asarray(traj.images)),
                                     torch.tensor(np.asarray(traj.proprio, dtype=np.float32)),
                                     [traj.instruction] * traj.num_calls,
                                     torch.tensor(np.asarray(traj.action_tokens, dtype=np.int64)), temperature)
        total = torch.where(mask, logp, torch.zeros_like(logp)).sum()
        grads = torch.autograd.grad(total, params, allow_unused=True)
        scores[row] = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                 for g, p in zip(grads, params)])
        counts[row] = float(mask.sum())
    return scores, counts


def sharpness(logp: np.ndarray, reference_logp: np.ndarray, window: int = 2) -> dict:
    """How concentrated a policy's action distributions are, and around what, against a reference policy's (the
    start's) at the same N token positions: ``logp`` and ``reference_logp`` float [N, bins], the log-probs at the
    rollout temperature. Means over the positions of: the entropy (nats); the mass on the reference's greedy bin and
    within ``window`` bins of it (action bins are ordinal); the share of positions whose greedy bin is the
    reference's; and the shift of the expected bin from the reference's (signed, and its size). A policy that only
    sharpens the reference keeps its greedy bins and gains mass around them; one that moves its actions shifts."""
    logp = np.asarray(logp, dtype=np.float64)
    ref = np.asarray(reference_logp, dtype=np.float64)
    if logp.ndim != 2 or ref.shape != logp.shape:
        raise ValueError(f"sharpness: logp and reference_logp must both be [N, bins], got {logp.shape} and "
                         f"{ref.shape}")
    p, bins = np.exp(logp), np.arange(logp.shape[1])
    mode = ref.argmax(-1)
    near = np.abs(bins[None, :] - mode[:, None]) <= window
    shift = p @ bins - np.exp(ref) @ bins
    return {"positions": int(logp.shape[0]), "entropy": float(-(p * logp).sum(-1).mean()),
            "mode_mass": float(p[np.arange(len(mode)), mode].mean()),
            "near_mode_mass": float((p * near).sum(-1).mean()), "window": int(window),
            "mode_agreement": float((logp.argmax(-1) == mode).mean()),
            "mean_shift": float(shift.mean()), "abs_mean_shift": float(np.abs(shift).mean())}


def trajectory_action_logprobs(policy, traj, temperature: float,
                               dims: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray]:
    """The policy's action distributions at one recorded trajectory's observations: float32 [positions, bins]
    log-probs at ``temperature`` (the learner's ``action_log_softmax``, teacher-forced on the recorded tokens) of
    its masked token positions, only those of action dimensions ``dims`` if given (e.g. ``actor.sampled_dims``),
    and each position's action dimension [positions]. No grad."""
    import torch

    mask = np.asarray(traj.token_mask, dtype=bool)
    dim_of = np.broadcast_to(np.arange(mask.shape[-1]) % policy.tokenizer.action_dim, mask.shape)
    if dims is not None:
        mask = mask & ~policy.tokenizer.greedy_positions(dims)
    with torch.no_grad():
        logp, _ = policy.action_log_softmax(torch.tensor(np.asarray(traj.images)),
                                            torch.tensor(np.asarray(traj.proprio, dtype=np.float32)),
                                            [traj.instruction] * traj.num_calls,
                                            torch.tensor(np.asarray(traj.action_tokens, dtype=np.int64)), temperature)
    return logp.float().cpu().numpy()[mask], dim_of[mask]


def pool_sharpness(parts: Sequence[dict]) -> dict:
    """``sharpness`` over the union of disjoint sets of positions from its results on each (every figure is a mean
    over positions, so the pooled one is their position-weighted mean); lets a long recording be read one
    trajectory at a time."""
    parts = [p for p in parts if p["positions"] > 0]
    if not parts or len({p["window"] for p in parts}) != 1:
        raise ValueError("pool_sharpness: give results with positions, all of one window")
    n = sum(p["positions"] for p in parts)
    means = ("entropy", "mode_mass", "near_mode_mass", "mode_agreement", "mean_shift", "abs_mean_shift")
    return {"positions": n, "window": parts[0]["window"],
            **{k: float(sum(p[k] * p["positions"] for p in parts) / n) for k in means}}


def score_gram(scores, counts: np.ndarray, aggregation: str) -> np.ndarray:
    """``K[t, u] = s_t . s_u`` (float64) for the per-trajectory directions of ``aggregation`` (``token_mean``: summed
    scores; ``seq_mean_token_mean``: token means); constant factors leave rho and the cosines unchanged."""
    import torch

    S = scores.to(torch.float64)
    if aggregation == "seq_mean_token_mean":
        S = S / torch.from_numpy(np.maximum(counts, 1.0))[:, None]
    elif aggregation != "token_mean":
        raise ValueError(f"aggregation must be token_mean or seq_mean_token_mean, got {aggregation!r}")
    return (S @ S.T).numpy()


__all__ = ["batch_cosines", "expected_cosine", "pair_means", "projected_rho", "group_gram", "groups_for_share", "measure",
           "permute_within_groups", "score_gram", "sharpness", "signal_share",
           "trajectory_action_logprobs", "trajectory_scores", "pool_sharpness"]
