"""Test support for the learner / batching tests: a tiny stand-in policy, trajectories, and a rank worker.

``StandInPolicy`` has the ``token_logprobs`` signature of the real policy and uses the same patterns that
matter under ZeRO-3: a parameter owned by the root module (``query``) and a weight read outside its module's
forward (``head.weight`` via ``F.linear``, like a tied LM head). ``poison`` injects NaN into the log-probs
("logp") or only into the backward pass ("grad").

Run as a script it is one learner rank for tests/test_learner_deepspeed.py (see ``worker``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from async_vla.config import Config, load_config  # noqa: E402
from async_vla.messages import Trajectory  # noqa: E402

VOCAB, BINS, CHUNK, DOF, PROPRIO, IMG = 512, 16, 2, 2, 3, 8
T = CHUNK * DOF
FIRST = VOCAB - BINS


def finite_params(items) -> bool:
    """True when every tensor of (name, tensor) pairs is finite."""
    return all(bool(torch.isfinite(t).all()) for _, t in items)


def small_cfg(*overrides: str) -> Config:
    base = [f"policy.vocab_size={VOCAB}", f"policy.num_bins={BINS}", f"policy.chunk_size={CHUNK}",
            f"policy.action_dim={DOF}", "learner.lr=0.01", "actor.temperature=1.0", "run.seed=3",
            "learner.zero3_persistence_threshold=0", "buffer.groups_per_batch=2"]
    return load_config(None, base + list(overrides))


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.full_like(g, float("nan"))


class StandInPolicy(torch.nn.Module):
    """images [C,H,W,3] uint8 + proprio [C,P] -> log-probs [C,T] of given action tokens."""

    def __init__(self, hidden: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.enc = torch.nn.Linear(3 + PROPRIO, hidden)
        self.query = torch.nn.Parameter(torch.randn(T, hidden, generator=g) * 0.5)
        self.head = torch.nn.Linear(hidden, BINS)
        with torch.no_grad():
            for p in (self.enc.weight, self.enc.bias, self.head.weight, self.head.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.poison: Optional[str] = None
        self.tokens_per_call = T

    def _logp_all(self, images, proprio, temperature):
        dev = self.query.device
        x = torch.as_tensor(images, device=dev).float().mean(dim=(1, 2)) / 255.0
        p = torch.as_tensor(proprio, device=dev).to(self.query.dtype)
        feat = torch.tanh(self.enc(torch.cat([x.to(self.query.dtype), p], dim=-1)))
        hidden = feat[:, None, :] + self.query[None]
        logits = F.linear(hidden, self.head.weight, self.head.bias)  # weight read outside head's forward
        return F.log_softmax(logits.float() / temperature, dim=-1)

    def token_logprobs_entropy(self, images, proprio, instructions, action_tokens, temperature):
        logp_all = self._logp_all(images, proprio, temperature)
        return (self.token_logprobs(images, proprio, instructions, action_tokens, temperature),
                -(logp_all.exp() * logp_all).sum(-1))

    def token_logprobs(self, images, proprio, instructions, action_tokens, temperature):
        dev = self.query.device
        logp_all = self._logp_all(images, proprio, temperature)
        idx = torch.as_tensor(action_tokens, device=dev).long() - FIRST
        logp = logp_all.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        if self.poison == "logp":
            logp = logp.clone()
            logp[0, 0] = float("nan")
        elif self.poison == "grad":
            logp = _NaNGrad.apply(logp)
        return logp


def make_traj(group: str, i: int, n_calls: int, reward: float, version: int = 0, seed: int = 0,
              mask_tail: int = 0, policy: Optional[torch.nn.Module] = None, temperature: float = 1.0,
              behav_noise: float = 0.0) -> Trajectory:
    """A valid trajectory; behaviour log-probs from ``policy`` (on-policy) or random negatives."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 255, size=(n_calls, IMG, IMG, 3), dtype=np.uint8)
    proprio = rng.standard_normal((n_calls, PROPRIO)).astype(np.float32)
    tokens = rng.integers(FIRST, VOCAB, size=(n_calls, T)).astype(np.int64)
    mask = np.ones((n_calls, T), dtype=bool)
    if mask_tail:
        mask[-1, T - mask_tail:] = False
    if policy is not None:
        with torch.no_grad():
            behav = policy.token_logprobs(torch.from_numpy(images), torch.from_numpy(proprio),
                                          [f"task {group}"] * n_calls, torch.from_numpy(tokens),
                                          temperature).numpy().astype(np.float32)
    else:
        behav = -rng.uniform(1.5, 4.0, size=(n_calls, T)).astype(np.float32)
    if behav_noise:
        behav = np.minimum(behav + rng.normal(0, behav_noise, behav.shape).astype(np.float32), 0.0)
    versions = np.full(n_calls, version, dtype=np.int64)
    return Trajectory(run_id="t", actor_id=0, group_id=group, traj_id=f"{group}-{i}", task_id=1, init_state_id=0,
                      instruction=f"task {group}", behaviour_version=version, success=reward > 0.5,
                      reward=float(reward), env_steps=n_calls * CHUNK, t_start=0.0, t_end=1.0, group_size=2,
                      chunk_versions=versions, images=images, proprio=proprio, action_tokens=tokens,
                      behav_logprobs=behav, token_mask=mask)


def make_groups(policy: Optional[torch.nn.Module] = None, seed: int = 0, n_groups: int = 2,
                calls: Sequence[int] = (1, 3, 2, 2), rewards: Sequence[float] = (1.0, 0.0, 0.0, 1.0),
                behav_noise: float = 0.0) -> list[list[Trajectory]]:
    g = len(calls) // n_groups
    out = []
    for k in range(n_groups):
        out.append([make_traj(f"g{k}", j, calls[k * g + j], rewards[k * g + j], seed=seed * 100 + k * g + j,
                              mask_tail=1 if j == 0 else 0, policy=policy, behav_noise=behav_noise)
                    for j in range(g)])
    return out


# ------------------------------------------------------------------------------ multi-rank worker
MB_REWARDS = ((1.0, 0.0, 1.0, 1.0), (0.0, 0.0, 1.0, 0.0))   # per rank: 2 groups of 2, different reward means


def minibatch_groups(rank: int) -> list[list[Trajectory]]:
    """Rank ``rank``'s share for the mini-batch worker: two groups (policy-independent behaviour log-probs)."""
    return make_groups(seed=20 + rank, n_groups=2, calls=(2, 1, 3, 2), rewards=MB_REWARDS[rank], behav_noise=0.2)


def minibatch_worker(out_path: str) -> None:
    """One ZeRO-3 rank: ``learner.minibatches=2`` with ``loss.adv_norm=batch`` over 2 ranks, one batch; writes
    the gathered weights' digest and the metrics. The reference (one process, TorchLearner) trains the groups
    ordered rank0-g0, rank1-g0, rank0-g1, rank1-g1: its mini-batch j is the union of the ranks' mini-batch j."""
    torch.set_num_threads(1)
    from learner.deepspeed_engine import DeepSpeedLearner

    over = ["learner.zero_stage=3", "learner.num_ranks=2", "learner.micro_batch_trajectories=1",
            "learner.minibatches=2", "buffer.groups_per_batch=4", "loss.adv_norm=batch", "loss.correction=tis"]
    cfg = small_cfg(*over)
    learner = DeepSpeedLearner(cfg, StandInPolicy(seed=1))
    m = learner.train_step(minibatch_groups(learner.rank))
    full = {k: v.tolist() for k, v in learner.full_state_items(all_ranks=True)}
    report = {"rank": learner.rank, "version": learner.version, "params": full,
              "metrics": {k: m[k] for k in ("loss/policy", "learner/steps_applied", "learner/minibatches",
                                            "learner/adv_abs_mean", "actor/pg_clipfrac", "actor/ppo_kl")}}
    Path(f"{out_path}.{learner.rank}").write_text(json.dumps(report))
    learner._dist.barrier()


def worker(phase: str, ckpt_dir: str, out_path: str, zero_stage: int) -> None:
    """One DeepSpeed rank. phase "train": 2 steps, digests, save, 1 more step, digests, then SIGKILL itself.
    phase "resume": load, digests, the same 3rd step, digests. Each rank writes its JSON to out_path.<rank>."""
    import time
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    from learner.checkpoint_files import tensors_digest
    from learner.deepspeed_engine import DeepSpeedLearner

    cfg = small_cfg(f"learner.zero_stage={zero_stage}", "learner.num_ranks=2", "learner.micro_batch_trajectories=1",
                    "loss.nsr=band", "loss.nsr_prob=0.5", "learner.steps_per_batch=1")
    learner = DeepSpeedLearner(cfg, StandInPolicy(seed=1))
    rank = learner.rank
    report: dict = {"rank": rank, "world": learner.world, "stage": learner.stage, "init_s": time.perf_counter() - t0}

    def digests(tag: str) -> None:
        full = list(learner.full_state_items(all_ranks=True))
        report[f"{tag}_params"] = tensors_digest(full)
        report[f"{tag}_opt"] = learner.optimizer_digest()
        report[f"{tag}_version"] = learner.version
        report[f"{tag}_finite"] = all(bool(torch.isfinite(t).all()) for _, t in full)
        rank0 = list(learner.full_state_items())
        report[f"{tag}_rank0_items"] = len(rank0)

    # Identical synthetic batches on every rank (policy-independent behaviour log-probs, off-policy); the
    # third differs in size per rank (2 vs 3 trajectories), so rank 0 must pad to 3 micro-batches.
    batches = [make_groups(seed=s, n_groups=1, calls=(2, 3), rewards=(1.0, 0.0), behav_noise=0.1)
               for s in range(2)]
    def third(r: int) -> list:
        return make_groups(seed=7 + r, n_groups=1, calls=(2, 1, 3)[:2 + r], rewards=(1.0, 0.0, 1.0)[:2 + r],
                           behav_noise=0.1)

    batches.append(third(rank))
    times = []
    if phase == "train":
        report["lineage"] = learner.start_lineage().encode()   # started by the test, not bin/learner: agreed all the same
        for b in batches[:2]:
            t0 = time.perf_counter()
            m = learner.train_step(b)
            times.append(time.perf_counter() - t0)
            report.setdefault("losses", []).append(m["loss/policy"])
        digests("before_save")
        learner.save_checkpoint(ckpt_dir, extra={"ledger": {"trained": 4}})
        learner.train_step(batches[2])
        digests("after_step3")
        report["step_s"] = times
    else:
        extra = learner.load_checkpoint(ckpt_dir)
        report["extra"] = extra
        report["lineage"] = learner.start_lineage().encode()   # descends from the checkpoint's
        digests("after_load")
        # Reference: one process, the union of both ranks' (different-sized) third batches, same weights.
        from learner.torch_engine import TorchLearner
        ref_policy = StandInPolicy(seed=1)
        ref_policy.load_state_dict(dict(learner.full_state_items(all_ranks=True)))
        ref = TorchLearner(cfg, ref_policy).train_step(third(0) + third(1))
        m3 = learner.train_step(batches[2])
        report["step3"] = {k: m3[k] for k in ("loss/policy", "learner/grad_norm", "learner/micro_batches",
                                               "learner/trajectories", "learner/tokens")}
        report["step3_ref"] = {k: ref[k] for k in ("loss/policy", "learner/grad_norm", "learner/trajectories",
                                                    "learner/tokens")}
        digests("after_step3")
    report["total_s"] = time.perf_counter() - t0
    Path(f"{out_path}.{rank}").write_text(json.dumps(report))
    learner._dist.barrier()
    if phase == "train":
        os.kill(os.getpid(), 9)  # the "kill" of save -> kill -> resume


if __name__ == "__main__":
    if sys.argv[1] == "minibatch":
        minibatch_worker(sys.argv[3])
    else:
        worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
