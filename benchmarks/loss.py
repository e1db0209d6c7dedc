"""Benchmark "loss": GRPO policy loss + backward vs a plain cross-entropy step on the same logits.

Both sides start from the same leaf logits [B, T, 256] (B*T = 64*56 action tokens, SimpleVLA-RL's shape) and
run forward + backward:
  * ce:   F.cross_entropy over the 256 bins (the SFT step; the fused log_softmax + NLL kernel), padding ignored;
  * grpo: log_softmax -> gather of the sampled tokens' log-probs -> policy_loss -> backward.
The ratio grpo / ce is the overhead of the RL objective over the cheapest loss on those logits (goal <= 1.15).
Two parts are also timed alone: policy_loss from a [B, T] leaf, and log_softmax + gather (its backward
scatters into a zero [B, T, 256] tensor, which the fused cross-entropy kernel avoids).
The two are timed interleaved, alternating which goes first, in one run; medians of the repeats are reported
and the ratio is the median of the per-repeat ratios (the ratio of the fastest repeats is reported too:
on a machine shared with other jobs it is the least disturbed estimate).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from async_vla.config import LossConfig
from async_vla.grpo import policy_loss

GOAL_RATIO = 1.15

VARIANTS = {
    "default (tis, token_mean)": LossConfig(),
    "mis + nsr band + dual clip + kl": LossConfig(correction="mis", nsr="band", dual_clip=3.0, kl_beta=0.01),
    "none + nsr noise + seq_mean_token_mean": LossConfig(correction="none", nsr="noise",
                                                         aggregation="seq_mean_token_mean"),
}


def _inputs(B: int, T: int, V: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Logits, sampled tokens, proximal/behaviour log-probs a little off the current ones, ragged mask."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)

    def logp_of(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, -1).gather(-1, tokens[..., None]).squeeze(-1)

    prox = logp_of(logits + 0.1 * torch.randn(B, T, V, generator=g))
    behav = logp_of(logits + 0.2 * torch.randn(B, T, V, generator=g))
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    data = dict(logits=logits, tokens=tokens, prox=prox, behav=behav, ref=prox.clone(), mask=mask,
                adv=torch.randn(B, generator=g), targets=torch.where(mask, tokens, torch.full_like(tokens, -100)))
    return {k: v.to(device) for k, v in data.items()}


def _ce_step(d: dict[str, torch.Tensor]) -> None:
    leaf = d["logits"].detach().requires_grad_(True)
    loss = F.cross_entropy(leaf.reshape(-1, leaf.shape[-1]), d["targets"].reshape(-1), ignore_index=-100)
    loss.backward()


def _grpo_step(d: dict[str, torch.Tensor], cfg: LossConfig, gen: torch.Generator) -> None:
    leaf = d["logits"].detach().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1).gather(-1, d["tokens"][..., None]).squeeze(-1)
    loss, _ = policy_loss(logp, d["prox"], d["behav"], d["adv"], d["mask"], cfg, generator=gen,
                          ref_logp=d["ref"] if cfg.kl_beta > 0 else None)
    loss.backward()


def _extract_step(d: dict[str, torch.Tensor]) -> None:
    """Only the log_softmax + gather (backward of a plain sum): the part of grpo that is not policy_loss."""
    leaf = d["logits"].detach().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1).gather(-1, d["tokens"][..., None]).squeeze(-1)
    torch.where(d["mask"], logp, 0.0).sum().backward()


def _loss_only_step(d: dict[str, torch.Tensor], cfg: LossConfig, gen: torch.Generator) -> None:
    """policy_loss forward + backward from a [B, T] leaf: the objective's own cost without the logits."""
    logp = d["prox"].detach().clone().requires_grad_(True)
    loss, _ = policy_loss(logp, d["prox"], d["behav"], d["adv"], d["mask"], cfg, generator=gen,
                          ref_logp=d["ref"] if cfg.kl_beta > 0 else None)
    loss.backward()


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _measure(d: dict[str, torch.Tensor], cfg: LossConfig, repeats: int, warmup: int, device: torch.device
             ) -> dict[str, float]:
    gen = torch.Generator(device=device).manual_seed(0)
    steps = {"ce": lambda: _ce_step(d), "grpo": lambda: _grpo_step(d, cfg, gen),
             "loss_only": lambda: _loss_only_step(d, cfg, gen), "extract": lambda: _extract_step(d)}
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for i in range(repeats):
        for name in (order if i % 2 == 0 else order[::-1]):  # alternate so drift hits both sides alike
            times[name].append(_timed(steps[name], device))
    ce, grpo, only, extract = (statistics.median(times[k]) for k in ("ce", "grpo", "loss_only", "extract"))
    # The ratio is the median of per-repeat ratios: ce and grpo of one repeat run back to back, so load
    # from other processes on a shared machine hits both alike (a ratio of medians can pair a busy ce
    # period with a quiet grpo one).
    paired = statistics.median(g / c for g, c in zip(times["grpo"], times["ce"]))
    extract_ratio = statistics.median(e / c for e, c in zip(times["extract"], times["ce"]))
    # policy_loss's own share: grpo / ce ~ extract_ratio + loss_overhead (the rest is log_softmax + gather).
    loss_overhead = statistics.median(o / c for o, c in zip(times["loss_only"], times["ce"]))
    return {"ce_ms": ce, "grpo_ms": grpo, "policy_loss_ms": only, "extract_ms": extract, "ratio": paired,
            "ratio_of_medians": grpo / ce, "ratio_of_mins": min(times["grpo"]) / min(times["ce"]),
            "extract_ratio": extract_ratio, "loss_overhead": loss_overhead}


def run(quick: bool = False) -> dict:
    """Time the GRPO loss step against cross-entropy on every available device (CPU, and CUDA if present)."""
    B, T, V = (16, 56, 256) if quick else (64, 56, 256)
    repeats, warmup = (5, 1) if quick else (101, 5)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    per_device: dict[str, dict] = {}
    for device in devices:
        d = _inputs(B, T, V, device)
        per_device[device.type] = {name: _measure(d, cfg, repeats, warmup, device) for name, cfg in VARIANTS.items()}
    head = per_device["cpu"][next(iter(VARIANTS))]
    results = {
        "B": B, "T": T, "bins": V, "repeats": repeats, "torch_threads": torch.get_num_threads(),
        "goal_ratio": GOAL_RATIO, **head, "meets_goal": head["ratio"] <= GOAL_RATIO, "by_device": per_device,
    }
    return {"section": "loss", "results": results, "markdown": _markdown(results)}


def _markdown(r: dict) -> str:
    lines = [f"GRPO loss vs cross-entropy, forward + backward on logits [{r['B']}, {r['T']}, {r['bins']}] "
             f"(median of {r['repeats']}, torch threads {r['torch_threads']}; goal ratio <= {r['goal_ratio']})",
             "", "| device | config | CE ms | GRPO ms | ratio (paired) | ratio of medians | ratio of mins "
             "| policy_loss alone ms (ratio to CE) | log_softmax+gather alone ms (ratio to CE) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dev, rows in r["by_device"].items():
        for name, m in rows.items():
            lines.append(f"| {dev} | {name} | {m['ce_ms']:.3f} | {m['grpo_ms']:.3f} | {m['ratio']:.3f} | "
                         f"{m['ratio_of_medians']:.3f} | {m['ratio_of_mins']:.3f} | "
                         f"{m['policy_loss_ms']:.3f} ({m['loss_overhead']:.3f}) | "
                         f"{m['extract_ms']:.3f} ({m['extract_ratio']:.3f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = run()
    print(out["markdown"])
