"""Groups of trajectories -> one ``TrainBatch`` of tensors, and micro-batches of whole trajectories (tensor layout
only; the loss weighting of micro-batches is ``grpo``'s). Per-call tensors ``[C, ...]``, per-token tensors
``[B, L*T]`` (``batch.layout`` scatters ``[C, T]`` into them), per-trajectory advantages and metadata; the layout
in full: docs/LEARNER.md "Batch layout"."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from async_vla import grpo
from async_vla.config import Config, LossConfig
from async_vla.messages import Trajectory


@dataclass
class TrainBatch:
    """Tensors of one learner batch (the layout: docs/LEARNER.md "Batch layout")."""

    # ---- per policy call (C rows)
    images: Tensor
    """uint8 [C, H, W, 3]."""
    proprio: Tensor
    """float32 [C, P]."""
    instructions: list[str]
    """C strings (each trajectory's instruction repeated for each of its calls)."""
    action_tokens: Tensor
    """int64 [C, T] token ids."""
    call_row: Tensor
    """int64 [C]: trajectory row of each call."""
    call_slot: Tensor
    """int64 [C]: index of each call within its trajectory."""
    call_versions: Tensor
    """int64 [C]: policy version that produced each call."""
    wrist_images: Optional[Tensor]
    """uint8 [C, H, W, 3] or None (None unless every trajectory has them)."""
    # ---- per trajectory (B rows), tokens laid out as [B, L*T]
    behav_logprobs: Tensor
    """float32 [B, L*T]: behaviour log-probs (0 on padding)."""
    mask: Tensor
    """bool [B, L*T]: token_mask on real calls, False on padding calls."""
    advantages: Tensor
    """float32 [B]: one advantage per trajectory (broadcast to its tokens by the loss)."""
    rewards: Tensor
    """float32 [B]."""
    success: Tensor
    """bool [B]."""
    behaviour_version: Tensor
    """int64 [B]: oldest policy version that produced any call of the trajectory."""
    num_calls: Tensor
    """int64 [B]: policy calls per trajectory."""
    env_steps: Tensor
    """int64 [B]."""
    task_id: Tensor
    """int64 [B]."""
    group_index: Tensor
    """int64 [B]: index of the trajectory's group in the list given to ``collate``."""
    tokens_per_call: int
    max_calls: int

    # ------------------------------------------------------------------------------------- properties
    @property
    def num_trajectories(self) -> int:
        return int(self.advantages.shape[0])

    @property
    def num_calls_total(self) -> int:
        return int(self.action_tokens.shape[0])

    @property
    def num_valid_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def device(self) -> torch.device:
        return self.mask.device

    # ---------------------------------------------------------------------------------------- helpers
    def layout(self, per_call: Tensor) -> Tensor:
        """``[C, T]`` per-call values -> ``[B, L*T]`` (zeros on padding calls); differentiable."""
        if per_call.shape != self.action_tokens.shape:
            raise ValueError(f"per-call tensor must be [C, T] = {tuple(self.action_tokens.shape)}, "
                             f"got {tuple(per_call.shape)}")
        out = per_call.new_zeros(self.num_trajectories, self.max_calls, self.tokens_per_call)
        # Out-of-place index_put keeps the autograd graph back to per_call.
        out = out.index_put((self.call_row, self.call_slot), per_call)
        return out.reshape(self.num_trajectories, self.max_calls * self.tokens_per_call)

    def lag(self, version: int) -> Tensor:
        """Per-trajectory staleness ``version - behaviour_version`` (int64 [B])."""
        return version - self.behaviour_version

    def select(self, rows: Sequence[int] | slice) -> "TrainBatch":
        """A batch of the given trajectory rows (whole trajectories, with all their calls)."""
        idx = torch.arange(self.num_trajectories)[rows] if isinstance(rows, slice) else torch.as_tensor(rows)
        idx = idx.to(torch.long).cpu()
        remap = torch.full((self.num_trajectories,), -1, dtype=torch.long)
        remap[idx] = torch.arange(len(idx))
        call_row_cpu = self.call_row.cpu()
        keep = remap[call_row_cpu] >= 0
        # Order calls by new row then slot, like collate does, so layouts stay comparable.
        call_idx = torch.nonzero(keep).squeeze(1)
        new_rows = remap[call_row_cpu[call_idx]]
        order = torch.argsort(new_rows * (self.max_calls + 1) + self.call_slot.cpu()[call_idx], stable=True)
        call_idx = call_idx[order]
        max_calls = int(self.num_calls.cpu()[idx].max()) if len(idx) else 0
        width = max_calls * self.tokens_per_call
        dev = self.device
        cidx, ridx = call_idx.to(dev), idx.to(dev)
        return replace(
            self,
            images=self.images[cidx], proprio=self.proprio[cidx],
            instructions=[self.instructions[i] for i in call_idx.tolist()],
            action_tokens=self.action_tokens[cidx], call_row=remap[call_row_cpu[call_idx]].to(dev),
            call_slot=self.call_slot[cidx], call_versions=self.call_versions[cidx],
            wrist_images=None if self.wrist_images is None else self.wrist_images[cidx],
            behav_logprobs=self.behav_logprobs[ridx, :width], mask=self.mask[ridx, :width],
            advantages=self.advantages[ridx], rewards=self.rewards[ridx], success=self.success[ridx],
            behaviour_version=self.behaviour_version[ridx], num_calls=self.num_calls[ridx],
            env_steps=self.env_steps[ridx], task_id=self.task_id[ridx], group_index=self.group_index[ridx],
            max_calls=max_calls,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TrainBatch":
        """Every tensor moved to ``device`` (instructions stay a list)."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v
        return TrainBatch(**moved)


# ------------------------------------------------------------------------------------------- collate
def shuffle_outcomes(group: Sequence[Trajectory], rng: np.random.Generator) -> list[Trajectory]:
    """A group's trajectories with their (success, reward) pairs shuffled among the members: the same reward set,
    no link between a member's actions and its outcome (``loss.outcomes=shuffled``, the noise-only control)."""
    order = rng.permutation(len(group))
    return [replace(t, success=group[j].success, reward=group[j].reward) for t, j in zip(group, order)]


def compute_advantages(groups: Sequence[Sequence[Trajectory]], loss_cfg: LossConfig,
                       stats: Optional[grpo.RewardStats] = None) -> Tensor:
    """Per-trajectory advantages [B] (groups concatenated in order) from ``grpo.group_advantages``: one
    ``[num_groups, G]`` call when groups have one size, else per group (``group``), over all rewards (``batch``) or
    elementwise (``none``). ``stats``: the whole batch's statistics when these groups are one rank's share of it."""
    sizes = [len(g) for g in groups]
    rewards = [float(t.reward) for g in groups for t in g]
    if len(set(sizes)) == 1:
        r = torch.tensor(rewards, dtype=torch.float32).reshape(len(groups), sizes[0])
        return grpo.group_advantages(r, loss_cfg, stats).reshape(-1)
    if loss_cfg.adv_norm == "batch" or loss_cfg.adv_norm == "none":
        return grpo.group_advantages(torch.tensor([rewards], dtype=torch.float32), loss_cfg, stats).reshape(-1)
    return torch.cat([grpo.group_advantages(torch.tensor([[float(t.reward) for t in g]], dtype=torch.float32),
                                            loss_cfg).reshape(-1) for g in groups])


def collate(groups: Sequence[Sequence[Trajectory]], cfg: Config,
            reward_stats: Optional[grpo.RewardStats] = None) -> TrainBatch:
    """Groups (lists of trajectories of one init state) -> a TrainBatch on the CPU (``reward_stats``: see
    ``compute_advantages``)."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("collate needs at least one group and no empty group")
    trajs = [t for g in groups for t in g]
    T = int(trajs[0].action_tokens.shape[1])
    for t in trajs:
        if t.action_tokens.shape[1] != T:
            raise ValueError(f"trajectory {t.traj_id} has {t.action_tokens.shape[1]} tokens per call, "
                             f"others have {T}")
    if T != cfg.tokens_per_call:
        raise ValueError(f"trajectories have {T} tokens per call, the config says {cfg.tokens_per_call} "
                         f"(policy.chunk_size x policy.action_dim)")
    n_calls = np.array([t.num_calls for t in trajs], dtype=np.int64)
    B, L = len(trajs), int(n_calls.max())

    call_row = np.repeat(np.arange(B), n_calls)
    call_slot = np.concatenate([np.arange(n) for n in n_calls])
    behav = np.zeros((B, L, T), dtype=np.float32)
    mask = np.zeros((B, L, T), dtype=bool)
    for b, t in enumerate(trajs):
        n = t.num_calls
        # where(): a masked-out token may carry any value (even NaN from a sampler); keep padding clean.
        behav[b, :n] = np.where(t.token_mask, t.behav_logprobs, 0.0)
        mask[b, :n] = t.token_mask
    has_wrist = all(t.wrist_images is not None for t in trajs)
    group_index = np.repeat(np.arange(len(groups)), [len(g) for g in groups])

    return TrainBatch(
        images=torch.from_numpy(np.concatenate([t.images for t in trajs])),
        proprio=torch.from_numpy(np.concatenate([t.proprio for t in trajs]).astype(np.float32, copy=False)),
        instructions=[t.instruction for t in trajs for _ in range(t.num_calls)],
        action_tokens=torch.from_numpy(np.concatenate([t.action_tokens for t in trajs]).astype(np.int64)),
        call_row=torch.from_numpy(call_row), call_slot=torch.from_numpy(call_slot),
        call_versions=torch.from_numpy(np.concatenate([t.chunk_versions for t in trajs]).astype(np.int64)),
        wrist_images=torch.from_numpy(np.concatenate([t.wrist_images for t in trajs])) if has_wrist else None,
        behav_logprobs=torch.from_numpy(behav.reshape(B, L * T)),
        mask=torch.from_numpy(mask.reshape(B, L * T)),
        advantages=compute_advantages(groups, cfg.loss, reward_stats).to(torch.float32),
        rewards=torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32),
        success=torch.tensor([bool(t.success) for t in trajs], dtype=torch.bool),
        behaviour_version=torch.tensor([int(t.behaviour_version) for t in trajs], dtype=torch.int64),
        num_calls=torch.from_numpy(n_calls),
        env_steps=torch.tensor([int(t.env_steps) for t in trajs], dtype=torch.int64),
        task_id=torch.tensor([int(t.task_id) for t in trajs], dtype=torch.int64),
        group_index=torch.from_numpy(group_index),
        tokens_per_call=T,
        max_calls=L,
    )


# ------------------------------------------------------------------------------------ mini-batches
def minibatch_rows(batch: TrainBatch, k: int) -> list[list[int]]:
    """Trajectory rows of ``k`` disjoint PPO mini-batches of consecutive whole groups (sizes as equal as the group count
    allows): a group's advantages sum to zero, so each mini-batch keeps one init state's contrast whole."""
    n_groups = int(batch.group_index.max()) + 1 if batch.num_trajectories else 0
    if k < 1 or n_groups < k:
        raise ValueError(f"learner.minibatches={k} needs at least {k} groups per learner rank, got {n_groups}: "
                         "lower learner.minibatches or raise buffer.groups_per_batch")
    gi = batch.group_index.cpu().numpy()
    return [np.flatnonzero(np.isin(gi, part)).tolist() for part in np.array_split(np.arange(n_groups), k)]


# ------------------------------------------------------------------------------------ micro-batches
def micro_batches(batch: TrainBatch, max_trajectories: int) -> list[TrainBatch]:
    """Consecutive micro-batches of at most ``max_trajectories`` whole trajectories (one batch if it fits)."""
    if max_trajectories < 1:
        raise ValueError("max_trajectories must be >= 1")
    B = batch.num_trajectories
    if B <= max_trajectories:
        return [batch]
    return [batch.select(slice(i, min(i + max_trajectories, B))) for i in range(0, B, max_trajectories)]
