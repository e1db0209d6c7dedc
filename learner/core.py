"""The learner step (shared by every backend) and ``TorchLearner`` (single process, plain AdamW).

``train_step(groups)``: collate, proximal log-probs at the batch-start weights, ``learner.steps_per_batch`` passes of
one optimizer step per mini-batch of whole groups (micro-batches weighted to the exact mini-batch gradient), then
``version += 1``; a non-finite loss or gradient skips the rest of the batch and the version still moves on. Metrics
use the TensorBoard tag names (and verl's copies), reduced over ranks. The step in full: docs/LEARNER.md "The step".
"""

from __future__ import annotations

import abc
import copy
import logging
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from async_vla import grpo
from async_vla.batching import TrainBatch, collate, micro_batches, minibatch_rows, shuffle_outcomes
from async_vla.grpo import aggregation_units, loss_token_mask, micro_batch_weight
from async_vla.config import Config
from async_vla.messages import ROOT, Lineage, Trajectory
from async_vla.metrics import verl_aliases
from async_vla.phases import PhaseClock, since
from learner.checkpoint_files import CKPT_FORMAT
from learner.lr_schedule import lr_at

log = logging.getLogger(__name__)


# policy_loss metrics by the count they average over (so micro-batches and ranks combine exactly).
_PER_LOSS_TOKEN = ("clip_frac_low", "clip_frac_high", "nsr_rescued_frac", "dual_clip_frac", "approx_kl", "kl")
_PER_VALID_TOKEN = ("is_weight_mean", "mis_masked_frac", "behav_kl")
_PER_UNIT = ("policy_loss", "loss")
_TAGS = {
    "policy_loss": "loss/policy", "loss": "loss/total", "clip_frac_low": "loss/clip_frac_low",
    "clip_frac_high": "loss/clip_frac_high", "nsr_rescued_frac": "loss/nsr_rescued_frac",
    "dual_clip_frac": "loss/dual_clip_frac", "approx_kl": "loss/approx_kl", "kl": "loss/kl_ref",
    "is_weight_mean": "offpolicy/is_weight_mean", "mis_masked_frac": "offpolicy/mis_masked_frac",
    "behav_kl": "offpolicy/behav_kl", "is_weight_max": "offpolicy/is_weight_max",
}


def rollout_temperature(cfg: Config) -> float:
    """Temperature the learner's log-probs use: the actors' sampling temperature (0 = greedy -> 1)."""
    return 1.0 if cfg.actor.temperature == 0 else float(cfg.actor.temperature)


def prox_from_step_forward(cfg: Config) -> bool:
    """Whether pi_prox's log-probs come from the optimizer step's own forward (learner.proximal_pass=auto): one
    step per batch, so the weights at batch start are the ones that forward runs with, and a loss mask that does
    not need pi_prox before the loss (correction none or tis; mis masks tokens by pi_prox / pi_behav)."""
    lc = cfg.learner
    return (lc.proximal_pass == "auto" and lc.minibatches == 1 and lc.steps_per_batch == 1
            and cfg.loss.correction in ("none", "tis"))


def _entropy_sums(mb: TrainBatch, ent: Optional[Tensor]) -> Tensor:
    """[sum of the per-token entropy over mb's valid tokens, their count] (zeros when the policy gives none)."""
    if ent is None:
        return torch.zeros(2, dtype=torch.float64)
    ent = mb.layout(ent.float())
    return torch.tensor([float(torch.where(mb.mask, ent, 0.0).sum()), float(mb.mask.sum())], dtype=torch.float64)


def _stale_kl_sums(mb: TrainBatch, prox: Tensor, start_version: int) -> Tensor:
    """[sum of k3 KL(pi_behav || pi_prox) over mb's valid tokens from chunks an older version sampled (lag > 0),
    their count]. On lag-0 tokens the two policies are the same weights and the KL is 0 by construction, so
    averaging over every token (offpolicy/behav_kl) dilutes the movement the actors see by their share."""
    per_call = (mb.call_versions < start_version)[:, None].expand(-1, mb.tokens_per_call)
    stale = mb.layout(per_call.to(torch.float32)) > 0
    stale &= mb.mask if mb.mask.dtype == torch.bool else mb.mask != 0
    log_w = (prox.double() - mb.behav_logprobs.double()).clamp(-grpo.LOG_RATIO_CLAMP, grpo.LOG_RATIO_CLAMP)
    k3 = torch.exp(log_w) - log_w - 1.0
    return torch.tensor([float(torch.where(stale, k3, 0.0).sum()), float(stale.sum())], dtype=torch.float64)


# --------------------------------------------------------------------------------------- the learner
class Learner(abc.ABC):
    """Interface (docs/CONTRACTS.md) plus the GRPO step; backends implement the hooks at the bottom."""

    version: int

    def __init__(self, cfg: Config, policy: torch.nn.Module, rank: int = 0, world: int = 1,
                 phases: Optional[PhaseClock] = None):
        from learner.adapt import lora_scale, prepare_for_training

        self.cfg = cfg
        self.policy = prepare_for_training(policy, cfg.learner)   # LoRA / checkpointing, in place (learner/adapt.py)
        self.lora_scale = lora_scale(cfg.learner)   # None without LoRA; else full_state_items merges the adapters
        self.rank, self.world = rank, world
        # loss.kl_beta > 0: a frozen copy of the starting policy (policy.path, or the seeded initial weights) is
        # the KL reference; each backend keeps its own (``_ref_logprobs``). Taken before any step or checkpoint
        # load, so a resumed run keeps the same reference as long as it starts from the same policy.
        self.uses_reference = cfg.loss.kl_beta > 0
        self.version = 0
        self.lineage = Lineage(ROOT)
        """Whose weights these are: the initial policy's until ``start_lineage``, a checkpoint's after a load."""
        self.skipped_steps = 0
        self.optimizer_steps = 0
        """Optimizer steps applied over the run (minibatches x steps_per_batch per batch, less skipped ones)."""
        self.temperature = rollout_temperature(cfg)
        # NSR draws come from this generator (per rank) so a resumed run repeats them exactly.
        self.loss_generator = torch.Generator(device="cpu")
        self.loss_generator.manual_seed(cfg.run.seed * 7919 + 1_000_003 * (rank + 1))
        self.outcome_rng = np.random.default_rng([cfg.run.seed, rank, 0x0C7])
        """``loss.outcomes=shuffled`` (the noise-only control) draws each group's shuffle from it."""
        self.last_lags = np.zeros(0, dtype=np.int64)
        """Per-trajectory lag (version at batch start - behaviour version) of this rank's last batch."""
        self.phases = phases if phases is not None else PhaseClock()
        """Where this rank's time goes (docs/BENCHMARKS.md): a step's ``collate``, ``proximal`` (the no-grad pass
        for pi_prox, its entropy and the KL reference), ``forward_backward`` and ``optimizer``; the process loop
        (bin/learner, serial mode) charges its own phases (waiting for a batch, publishing, ...) to it too."""

    # ---------------------------------------------------------------------------------- the step
    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        """One batch of groups -> ``steps_per_batch`` x ``minibatches`` optimizer steps (fewer if one is
        skipped) -> ``version += 1`` -> metrics."""
        before = self.phases.seconds()
        with self.phases.phase("collate"):
            cfg = self.cfg
            lc = cfg.learner
            if cfg.loss.outcomes == "shuffled":
                groups = [shuffle_outcomes(g, self.outcome_rng) for g in groups]
            batch = collate(groups, cfg, self._reward_stats(groups)).to(self.device)
            start_version = self.version
            if lc.lr_decay is not None:
                self._set_lr(lr_at(start_version, lc.lr, lc.lr_decay, lc.lr_final))
            self.last_lags = batch.lag(start_version).cpu().numpy()
            shards = ([batch] if lc.minibatches == 1
                      else [batch.select(rows) for rows in minibatch_rows(batch, lc.minibatches)])
            # Every rank runs the same number of micro-batches per mini-batch (ZeRO-3 forwards are collective).
            minis = [self._pad_micro_batches(micro_batches(s, lc.micro_batch_trajectories)) for s in shards]
            flat = [mb for mbs in minis for mb in mbs]
            mini_of = [j for j, mbs in enumerate(minis) for _ in mbs]

        # pi_prox: the weights at batch start. With one optimizer step per batch they are the weights every
        # micro-batch's forward below runs with, so (learner.proximal_pass=auto) that forward's detached log-probs
        # are pi_prox's and the no-grad pass is skipped; otherwise one no-grad pass before the first step.
        reuse = prox_from_step_forward(cfg)
        entropy = torch.zeros(2, dtype=torch.float64)   # per-token entropy of pi_prox (actor/entropy): sum, count
        stale_kl = torch.zeros(2, dtype=torch.float64)  # offpolicy/behav_kl_stale: sum, count
        prox: list[Optional[Tensor]] = [None] * len(flat)
        with self.phases.phase("proximal"):
            with torch.no_grad():
                if not reuse:
                    for i, mb in enumerate(flat):
                        logp, ent = self._logprobs_entropy(mb)
                        prox[i] = mb.layout(logp.float())
                        entropy += _entropy_sums(mb, ent)
                refs = ([mb.layout(self._ref_logprobs(mb).float()) for mb in flat] if self.uses_reference
                        else [None] * len(flat))
        with self.phases.phase("forward_backward"):   # the optimizer steps inside: "optimizer"
            # (reuse: the mask does not depend on pi_prox for none / tis, so the behaviour log-probs stand in for it)
            loss_masks = [loss_token_mask(mb.behav_logprobs if p is None else p, mb.behav_logprobs, mb.mask, cfg.loss)
                          for p, mb in zip(prox, flat)]
            units = [float(aggregation_units(m, cfg.loss.aggregation)) for m in loss_masks]
            # Each optimizer step minimises its global mini-batch's loss: units over that mini-batch on every rank.
            local_units = torch.zeros(len(minis), dtype=torch.float64)
            for u, j in zip(units, mini_of):
                local_units[j] += u
            mini_units = self._all_reduce(local_units, "sum").tolist()
            weights = [micro_batch_weight(u, mini_units[j], self.world) for u, j in zip(units, mini_of)]

            sums = torch.zeros(len(_PER_LOSS_TOKEN) + len(_PER_VALID_TOKEN) + len(_PER_UNIT) + 2, dtype=torch.float64)
            w_max = torch.zeros(1, dtype=torch.float64)
            applied, steps_run, norms, has_kl = 0, 0, [], False
            order = [[i for i, j in enumerate(mini_of) if j == mini] for mini in range(len(minis))]
            for step in range(lc.steps_per_batch * len(minis)):
                idx = order[step % len(minis)]
                nonfinite = False
                steps_run += 1
                for pos, i in enumerate(idx):
                    mb, p, ref, lm, w, u = flat[i], prox[i], refs[i], loss_masks[i], weights[i], units[i]
                    self._begin_micro_batch(pos == len(idx) - 1)
                    if reuse:
                        logp, ent = self._logprobs_entropy(mb)
                        logp = mb.layout(logp.float())
                        p = logp.detach()
                        entropy += _entropy_sums(mb, None if ent is None else ent.detach())
                    else:
                        logp = mb.layout(self._logprobs(mb).float())
                    if step < len(minis):   # the first pass over the batch: p is pi_prox, the weights at batch start
                        stale_kl += _stale_kl_sums(mb, p, start_version)
                    loss, m = grpo.policy_loss(logp, p, mb.behav_logprobs, mb.advantages, mb.mask, cfg.loss,
                                               generator=self.loss_generator, ref_logp=ref)
                    # A non-finite log-prob of a real token is a broken forward even where the loss clamps it into a
                    # finite number (correction=none: log(pi_theta / pi_behav) is clamped to +-20): skip the step.
                    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(torch.where(mb.mask, logp, 0.0)).all())
                    nonfinite |= not finite
                    self._backward(loss * w, finite)
                    has_kl |= "kl" in m
                    n_loss, n_valid = float(lm.sum()), float(mb.mask.sum())
                    total_units = mini_units[mini_of[i]]
                    row = [m.get(k, 0.0) * n_loss for k in _PER_LOSS_TOKEN]
                    row += [m[k] * n_valid for k in _PER_VALID_TOKEN]
                    row += [m[k] * (u / total_units if total_units > 0 else 0.0) for k in _PER_UNIT]
                    sums += torch.tensor(row + [n_loss, n_valid], dtype=torch.float64)
                    w_max = torch.maximum(w_max, torch.tensor([m["is_weight_max"]], dtype=torch.float64))
                with self.phases.phase("optimizer"):
                    ok, norm = self._optimizer_step(nonfinite)
                norms.append(norm)
                if not ok:
                    self.skipped_steps += 1
                    log.warning("learner: non-finite loss or gradient at version %d (optimizer step %d of the batch): "
                                "the rest of the batch is skipped (%d skipped so far)", self.version, step + 1,
                                self.skipped_steps)
                    break
                applied += 1
            # One version per batch, however many optimizer steps it took (docs/LEARNER.md "Versions"): only the
            # weights after the last step leave the learner. A batch whose first step was skipped is consumed all
            # the same (as DeepSpeed does on an fp16 overflow): the version moves on with the weights bit-equal, so
            # the buffer forms a fresh batch; holding it would get this very batch served again, forever if its
            # data is the cause.
            self.version += 1
            self.optimizer_steps += applied
            metrics = self._finish_metrics(batch, sums, w_max, steps_run, has_kl, start_version, entropy, stale_kl)
        took = since(self.phases.seconds(), before)
        dt, t_prox = sum(took.values()), took.get("proximal", 0.0)
        grad_norm = float(np.mean(norms)) if norms else float("nan")
        metrics.update({
            "perf/learner_step_s": dt, "perf/learner_prox_s": t_prox,
            "perf/learner_tokens_per_s": metrics["learner/tokens"] / dt if dt > 0 else 0.0,
            "learner/version": float(self.version), "learner/steps_applied": float(applied),
            "learner/optimizer_steps": float(self.optimizer_steps),
            "learner/skipped_steps": float(self.skipped_steps),
            "learner/grad_norm": grad_norm, "learner/lr": float(self._lr()),
            "learner/micro_batches": float(len(flat)), "learner/minibatches": float(len(minis)),
        })
        metrics.update(verl_aliases(metrics))
        return metrics

    def _reward_stats(self, groups: Sequence[Sequence[Trajectory]]) -> Optional[grpo.RewardStats]:
        """``loss.adv_norm=batch`` on several ranks: the statistics of the whole batch (all ranks' shares), so
        every rank normalises as one process would on the union. None otherwise (the local statistics are
        the batch's)."""
        if self.cfg.loss.adv_norm != "batch" or self.world == 1:
            return None
        rewards = torch.tensor([float(t.reward) for g in groups for t in g], dtype=torch.float32)
        return grpo.batch_reward_stats(rewards, self.cfg.loss, self._all_reduce)

    def _finish_metrics(self, batch: TrainBatch, sums: Tensor, w_max: Tensor, steps: int, has_kl: bool,
                        start_version: int, entropy: Tensor, stale_kl: Tensor) -> dict[str, float]:
        lag = batch.lag(start_version).double()
        adv = batch.advantages.double()
        batch_sums = torch.tensor([batch.num_trajectories, batch.num_valid_tokens, float(batch.env_steps.sum()),
                                   float(batch.success.sum()), float(batch.rewards.sum()), float(lag.sum()),
                                   float(adv.abs().sum()), float(adv.sum()), float(entropy[0]),
                                   float(entropy[1]), float(stale_kl[0]), float(stale_kl[1])], dtype=torch.float64)
        reduced = self._all_reduce(torch.cat([sums, batch_sums]), "sum")
        maxes = self._all_reduce(torch.cat([w_max, lag.max().reshape(1).cpu(), adv.max().reshape(1).cpu(),
                                            -adv.min().reshape(1).cpu()]), "max")
        n = len(sums)
        sums = reduced[:n]
        (trajs, tokens, env_steps, succ, rew, lag_sum, adv_abs, adv_sum, ent_sum, ent_n, stale_sum,
         stale_n) = reduced[n:].tolist()
        n_loss, n_valid = float(sums[-2]), float(sums[-1])
        out: dict[str, float] = {}
        j = 0
        for keys, count in ((_PER_LOSS_TOKEN, n_loss), (_PER_VALID_TOKEN, n_valid), (_PER_UNIT, None)):
            for k in keys:
                v = float(sums[j]) / (count if count else 1.0) if count is not None else float(sums[j]) / steps
                out[_TAGS[k]] = v
                j += 1
        if not has_kl:
            del out["loss/kl_ref"]
        # loss/kl: KL to the reference policy when one is used, else the k3 estimate of KL(pi_prox || pi_theta)
        # (how far the step moved the policy), so the tag always exists.
        out["loss/kl"] = out.get("loss/kl_ref", out["loss/approx_kl"])
        out["offpolicy/is_weight_max"] = float(maxes[0])
        if ent_n > 0:
            out["loss/entropy"] = ent_sum / ent_n
        # The behaviour/proximal gap where there is one: tokens sampled by an older version (0 when none were).
        out["offpolicy/behav_kl_stale"] = stale_sum / stale_n if stale_n > 0 else 0.0
        out["offpolicy/stale_token_frac"] = stale_n / n_valid if n_valid > 0 else 0.0
        ntraj = max(trajs, 1.0)
        out.update({
            "learner/trajectories": trajs, "learner/tokens": tokens, "learner/env_steps": env_steps,
            "learner/success_rate": succ / ntraj, "learner/reward_mean": rew / ntraj,
            "learner/adv_abs_mean": adv_abs / ntraj, "learner/adv_mean": adv_sum / ntraj,
            "learner/adv_max": float(maxes[2]), "learner/adv_min": -float(maxes[3]),
            "learner/lag_mean": lag_sum / ntraj, "learner/lag_max": float(maxes[1]),
        })
        return out

    # --------------------------------------------------------------------------- backend hooks
    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @abc.abstractmethod
    def _logprobs(self, mb: TrainBatch) -> Tensor:
        """Per-call token log-probs [C, T] under the current weights at ``self.temperature``."""

    def _logprobs_entropy(self, mb: TrainBatch) -> tuple[Tensor, Optional[Tensor]]:
        """(log-probs, per-token entropy [C, T] of the action distribution) under the current weights, with or
        without gradient (the caller's grad mode); entropy None when the policy cannot give it
        (``token_logprobs_entropy``)."""
        return self._logprobs(mb), None

    def _ref_logprobs(self, mb: TrainBatch) -> Tensor:
        """Per-call token log-probs [C, T] under the frozen reference policy (only with ``loss.kl_beta`` > 0)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no reference policy")

    @abc.abstractmethod
    def _backward(self, loss: Tensor, finite: bool) -> None:
        """Accumulate gradients of ``loss`` (``finite`` False: the backend must make this step be skipped)."""

    @abc.abstractmethod
    def _optimizer_step(self, nonfinite_loss: bool) -> tuple[bool, float]:
        """Step unless a loss or gradient was non-finite; clears gradients; returns (applied, grad norm)."""

    @abc.abstractmethod
    def _lr(self) -> float: ...

    @abc.abstractmethod
    def _set_lr(self, lr: float) -> None:
        """The lr of the optimizer steps that follow (learner.lr_decay)."""

    def _begin_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch's forward (DeepSpeed marks the accumulation boundary)."""

    def _pad_micro_batches(self, mbs: list[TrainBatch]) -> list[TrainBatch]:
        """Multi-rank backends pad to the same number of micro-batches on every rank."""
        return mbs

    def _all_reduce(self, t: Tensor, op: str) -> Tensor:
        """Sum / max over learner ranks (identity for one process)."""
        return t

    def start_lineage(self) -> Lineage:
        """Mint this learner start's lineage (after any checkpoint load; a collective, every rank calls it): a new
        id rank 0 draws and an all-reduce hands to the others, descending from the lineage of the weights held now
        at the current version. It tags published versions and batch requests; checkpoints keep it."""
        import secrets

        draw = [float(secrets.randbits(52) | 1) for _ in range(2)] if self.rank == 0 else [0.0, 0.0]
        got = self._all_reduce(torch.tensor(draw, dtype=torch.float64), "max").tolist()   # 52 bits: exact
        self.lineage = self.lineage.descend("".join(f"{int(x):013x}" for x in got), self.version)
        return self.lineage

    @abc.abstractmethod
    def full_state_items(self, all_ranks: bool = False, copy: bool = True) -> Iterator[tuple[str, Tensor]]:
        """Full (unpartitioned) parameters as (name, tensor clone); names as in the policy module.
        Every rank must call and exhaust it; only rank 0 receives items unless ``all_ranks``. ``copy=False``:
        the parameters themselves, valid only until the next item is asked for (ZeRO-3 releases a module's
        gathered weights when the consumer moves on) and until the next step - for a consumer that copies each
        at once (the weight publisher packs it: one copy of the weights per publish instead of two)."""

    @abc.abstractmethod
    def save_checkpoint(self, directory: str | Path, extra: Optional[dict] = None) -> Path: ...

    @abc.abstractmethod
    def load_checkpoint(self, directory: str | Path, tag: Optional[str] = None) -> dict:
        """Restore the latest (or ``tag``) checkpoint; returns the ``extra`` dict saved with it."""

    @abc.abstractmethod
    def export_policy(self, directory: str | Path) -> Optional[Path]:
        """Write the policy in its HF/safetensors format for evaluation (rank 0 writes; all ranks call)."""

    def _rank_streams(self) -> dict:
        """This rank's random streams for a checkpoint: NSR's draws and ``loss.outcomes=shuffled``'s shuffles."""
        return {"loss_generator": self.loss_generator.get_state(),
                "outcome_rng": self.outcome_rng.bit_generator.state}

    def _restore_rank_streams(self, state: dict) -> None:
        self.loss_generator.set_state(state["loss_generator"])
        if "outcome_rng" in state:
            self.outcome_rng.bit_generator.state = state["outcome_rng"]
        else:
            log.warning("the checkpoint predates loss.outcomes: its shuffles restart from run.seed")

    def _learner_state(self, extra: Optional[dict]) -> dict:
        return {"format": CKPT_FORMAT, "version": self.version, "lineage": self.lineage.encode(),
                "skipped_steps": self.skipped_steps, "optimizer_steps": self.optimizer_steps, "world": self.world,
                "extra": dict(extra or {})}

    def _restore_learner_state(self, state: dict) -> dict:
        if state.get("format") != CKPT_FORMAT:
            raise ValueError(f"unsupported learner checkpoint format {state.get('format')}")
        self.version = int(state["version"])
        # (a checkpoint from before lineages: its weights count as the initial policy's line)
        self.lineage = Lineage.parse(state.get("lineage", ROOT))
        self.skipped_steps = int(state["skipped_steps"])
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        return dict(state.get("extra", {}))


def policy_has_entropy(policy: torch.nn.Module) -> bool:
    """Whether ``policy`` gives per-token entropies (``token_logprobs_entropy``, as every ``VLAPolicy``
    does); without it ``actor/entropy`` is not logged, and this says so once."""
    has = callable(getattr(policy, "token_logprobs_entropy", None))
    if not has:
        log.warning("%s has no token_logprobs_entropy(): actor/entropy (loss/entropy) is not logged",
                    type(policy).__name__)
    return has


def save_policy_dir(policy: torch.nn.Module, directory: Path) -> Path:
    """The policy's own save function (safetensors + config); HF ``save_pretrained`` for wrapped models."""
    from async_vla.policy import save_policy

    try:
        return save_policy(policy, directory)  # type: ignore[arg-type]
    except ValueError:
        if hasattr(policy, "save_pretrained"):
            policy.save_pretrained(str(directory))   # safetensors: transformers' default (the flag is gone in 5.x)
            return directory
        raise


def frozen_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``policy`` that never trains: the KL reference (eval mode, no gradients)."""
    ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref
