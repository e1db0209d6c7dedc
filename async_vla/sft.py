"""SFT bootstrap (expert demos -> cross-entropy on action tokens) and greedy evaluation; no processes, no argument
parsing (``bin/sft`` wraps it). A demo gives one sample per policy call, or with ``all_offsets`` one per step;
chunks past the episode end are padded with "stay still, keep the gripper" actions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from async_vla.envs.base import Env, Observation
from async_vla.image_ops import random_shift
from async_vla.policy.interface import VLAPolicy
from async_vla.progress import Progress

# Defaults (bin/sft uses the same; bin/quickstart passes its own recipe). bin_sigma: a target a few bins wide keeps
# T=1.6 rollouts near the demos' actions, so GRPO groups come out mixed; a much wider one makes rollouts so noisy
# that GRPO collapses (how the recipes were chosen: docs/BENCHMARKS.md, "SFT start on task v2").
DEFAULT_BIN_SIGMA = 4.0
DEFAULT_EPOCHS = 200
DEFAULT_BATCH_SIZE = 8
DEFAULT_LR = 1e-3


@dataclass
class DemoSamples:
    """Stacked SFT samples."""

    images: np.ndarray  # uint8 [N, H, W, 3]
    proprio: np.ndarray  # float32 [N, P]
    instructions: list[str]
    actions: Optional[np.ndarray]  # float32 [N, chunk, dof] raw expert actions (tokenised by the policy), or
    task_ids: list[int] = field(default_factory=list)
    tokens: Optional[np.ndarray] = None  # int64 [N, chunk * dof] tokens made already (async_vla.demos)
    token_mask: Optional[np.ndarray] = None  # bool [N, chunk * dof] tokens the expert executed (informational)

    def __len__(self) -> int:
        return len(self.instructions)


def collect_demos(env: Env, task_ids: Sequence[int], demos_per_task: int, chunk_size: int, seed: int = 0,
                  all_offsets: bool = True, progress: Optional[str] = None
                  ) -> tuple[DemoSamples, list[tuple[int, int]]]:
    """Expert demos on randomly chosen train init states; returns samples and the (task, init id) used.
    ``progress``: a label to report each demo under (``async_vla.progress``); None reports nothing."""
    from async_vla.envs.expert import expert_episode

    rng = np.random.default_rng(seed)
    picks = []
    for task in task_ids:
        train_ids = env.init_state_ids(task, "train")
        chosen = rng.choice(train_ids, size=min(demos_per_task, len(train_ids)), replace=False)
        picks += [(task, int(i)) for i in chosen]
    images, proprio, instr, actions, tids = [], [], [], [], []
    with Progress(progress, len(picks), "demos") as bar:
        for task, init_id in picks:
            obs, acts, success = expert_episode(env, task, init_id)
            if not success:
                raise RuntimeError(f"the expert failed task {task} init state {init_id}")
            acts = np.asarray(acts, dtype=np.float32)
            hold = np.zeros((chunk_size, acts.shape[1]), dtype=np.float32)
            hold[:, -1] = acts[-1, -1]
            padded = np.concatenate([acts, hold])
            starts = range(len(acts)) if all_offsets else range(0, len(acts), chunk_size)
            for s in starts:
                images.append(obs[s].image)
                proprio.append(obs[s].proprio)
                instr.append(env.instruction(task))
                actions.append(padded[s:s + chunk_size])
                tids.append(task)
            bar.update()
    return DemoSamples(np.stack(images), np.stack(proprio).astype(np.float32), instr, np.stack(actions), tids), picks


def smoothed_targets(index: torch.Tensor, num_bins: int, sigma: float) -> torch.Tensor:
    """Gaussian target distributions over bins centred on ``index [...]`` -> ``[..., num_bins]``."""
    bins = torch.arange(num_bins, dtype=torch.float32)
    q = torch.exp(-0.5 * ((bins - index.unsqueeze(-1).float()) / sigma) ** 2)
    return q / q.sum(-1, keepdim=True)


def sft_train(policy: VLAPolicy, demos: DemoSamples, epochs: int = DEFAULT_EPOCHS, lr: float = DEFAULT_LR,
              batch_size: int = DEFAULT_BATCH_SIZE, weight_decay: float = 0.0, seed: int = 0,
              bin_sigma: float = 0.0, lr_schedule: str = "constant", image_shift: int = 0,
              after_epoch: Optional[Callable[[int], bool]] = None, progress: Optional[str] = None) -> dict:
    """Cross-entropy on the expert's action tokens at T = 1.

    ``progress``: a label to report each epoch under (None: nothing). ``after_epoch(k)`` runs after epoch k (1-based)
    and may end training by returning True; it must leave the parameters alone. ``lr_schedule``: ``constant`` or
    ``cosine`` (to 0 over all steps). ``bin_sigma > 0``: CE against a Gaussian over neighbouring bins (sigma in bins)
    on the dims the demos vary: one-hot CE on a few demos makes the tiny model so sharp that T = 1.6 rollouts almost
    never leave the demo's action, every group has one outcome and GRPO has no signal. ``image_shift > 0``: each
    batch's images are randomly shifted by up to that many pixels (``image_ops.random_shift``, DrQ / RAD), drawn from
    their own generator seeded by ``seed`` (the batch order is the same as without)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    shift_rng = np.random.default_rng((seed, 1))
    if demos.tokens is not None:
        tokens_np = np.asarray(demos.tokens, dtype=np.int64)
    else:
        tokens_np = policy.tokenizer.encode_actions(demos.actions)
    tokens = torch.from_numpy(tokens_np)
    # Smooth only the action dims the expert actually varies: dims it always leaves at one value (dz and the
    # rotations on the built-in tasks) stay one-hot, so rollouts sample them (almost) deterministically and
    # they add no noise to the policy gradient.
    chunk, dof = policy.tokenizer.chunk_size, policy.tokenizer.action_dim
    varies = tokens_np.reshape(-1, dof).std(0) > 1e-6
    smooth_mask = torch.from_numpy(np.tile(varies, chunk))  # [T], step-major like the tokens
    images, proprio = torch.from_numpy(demos.images), torch.from_numpy(demos.proprio)
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}")
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)
    total_steps = max(1, epochs * -(-len(demos) // batch_size))
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1.0 + np.cos(np.pi * min(k, total_steps) / total_steps)))
             if lr_schedule == "cosine" else None)
    policy.train()
    losses, t0, steps = [], time.perf_counter(), 0
    n = len(demos)
    stopped_at = None
    bar = Progress(progress, epochs, "epochs")
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n)
        epoch_loss = 0.0
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            instr = [demos.instructions[i] for i in idx]
            batch_images = torch.from_numpy(random_shift(demos.images[idx], image_shift, shift_rng))
            if bin_sigma > 0:
                bins = policy.tokenizer.token_to_index(tokens[idx])
                logits = policy.action_logits(batch_images, proprio[idx], instr, bins)
                target = smoothed_targets(bins, policy.tokenizer.num_bins, bin_sigma)
                onehot = torch.nn.functional.one_hot(bins, policy.tokenizer.num_bins).float()
                target = torch.where(smooth_mask[None, :, None], target, onehot)
                loss = -(target * torch.log_softmax(logits.float(), -1)).sum(-1).mean()
            else:
                loss = -policy.token_logprobs(batch_images, proprio[idx], instr, tokens[idx], temperature=1.0).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            epoch_loss += float(loss.detach()) * len(idx)
            steps += 1
        losses.append(epoch_loss / n)
        bar.update(epoch, f"loss {losses[-1]:.4f}")
        if after_epoch is not None:
            bar.clear()   # what after_epoch prints starts on a line of its own
            stop = after_epoch(epoch)
            policy.train()
            if stop:
                stopped_at = epoch
                break
    bar.close()
    policy.eval()
    with torch.no_grad():
        logits = policy.action_logits(images, proprio, demos.instructions, policy.tokenizer.token_to_index(tokens))
        acc = float((logits.argmax(-1) == policy.tokenizer.token_to_index(tokens)).float().mean())
    return {"samples": n, "epochs": epochs, "epochs_run": len(losses), "stopped_at_epoch": stopped_at,
            "optimizer_steps": steps, "final_loss": losses[-1] if losses else None,
            "loss_curve": losses, "train_token_accuracy": acc, "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ rollouts
@dataclass
class EpisodeResult:
    task_id: int
    init_state_id: int
    success: bool
    env_steps: int
    observations: list[Observation]  # one per policy call
    action_tokens: list[np.ndarray]  # [T] per call
    logprobs: list[np.ndarray]  # [T] per call
    frames: list[np.ndarray] = field(default_factory=list)
    """The camera image (uint8 [H, W, 3]) at the reset and after every chunk, when recorded."""


def rollout(policy: VLAPolicy, envs: Sequence[Env], episodes: Sequence[tuple[int, int]], temperature: float,
            generator: Optional[torch.Generator] = None, keep_data: bool = False,
            record: Sequence[bool] = (), greedy: Optional[np.ndarray] = None) -> list[EpisodeResult]:
    """Run ``len(envs)`` episodes ``(task_id, init_state_id)`` in lock-step, one batched ``act`` per chunk;
    ``record[k]``: keep episode k's frames (at reset and after each chunk) for a video; ``greedy``: the positions
    ``act`` takes by argmax (``actor.sampled_dims``)."""
    if len(episodes) != len(envs):
        raise ValueError(f"{len(episodes)} episodes for {len(envs)} envs")
    if len(envs) > 1 and all(hasattr(env, "reset_async") for env in envs):
        for env, (t, i) in zip(envs, episodes):
            env.reset_async(t, i)
        obs = [env.wait() for env in envs]
    else:
        obs = [env.reset(t, i) for env, (t, i) in zip(envs, episodes)]
    instr = [env.instruction(t) for env, (t, _) in zip(envs, episodes)]
    results = [EpisodeResult(t, i, False, 0, [], [], []) for t, i in episodes]
    recording = [bool(record[k]) if k < len(record) else False for k in range(len(envs))]
    for k in range(len(envs)):
        if recording[k]:
            results[k].frames.append(obs[k].image)
    live = list(range(len(envs)))
    while live:
        images = np.stack([obs[k].image for k in live])
        proprio = np.stack([obs[k].proprio for k in live])
        tokens, logp = policy.act(images, proprio, [instr[k] for k in live], temperature, generator, greedy)
        chunks = policy.decode_actions(tokens)
        # Env workers (actors.env_worker.SubprocessEnv) step their chunks in parallel: start all, then collect.
        parallel = len(live) > 1 and all(hasattr(envs[k], "step_chunk_async") for k in live)
        if parallel:
            for row, k in enumerate(live):
                envs[k].step_chunk_async(chunks[row])
        still = []
        for row, k in enumerate(live):
            res = results[k]
            if keep_data:
                res.observations.append(obs[k])
                res.action_tokens.append(tokens[row])
                res.logprobs.append(logp[row])
            obs[k], done, success, n = envs[k].wait() if parallel else envs[k].step_chunk(chunks[row])
            res.env_steps += n
            if recording[k]:
                res.frames.append(obs[k].image)
            if done:
                res.success = bool(success)
            else:
                still.append(k)
        live = still
    return results


def video_episodes(episodes: Sequence[tuple[int, int]], n: int) -> set[tuple[int, int]]:
    """The ``n`` episodes to film: round-robin over the tasks (each task's first init states first), so a few
    videos show as many tasks as possible and the same episodes at every eval."""
    by_task: dict[int, list[tuple[int, int]]] = {}
    for ep in episodes:
        by_task.setdefault(ep[0], []).append(ep)
    chosen: list[tuple[int, int]] = []
    depth = 0
    while len(chosen) < min(n, len(episodes)):
        chosen += [eps[depth] for eps in by_task.values() if depth < len(eps)][:n - len(chosen)]
        depth += 1
    return set(chosen)


def evaluate_greedy(policy: VLAPolicy, env: Union[Env, Sequence[Env]], task_ids: Optional[Sequence[int]] = None,
                    split: str = "eval", batch_size: int = 8,
                    pick: Optional[Callable[[list[int]], list[int]]] = None,
                    videos: int = 0, temperature: float = 0.0, repeats: int = 1,
                    generator: Optional[torch.Generator] = None, progress: Optional[str] = None,
                    sampled_dims: Optional[Sequence[int]] = None) -> dict:
    """Greedy (T = 0) success over every init state of ``split`` for each task (those ``pick`` keeps of them);
    ``temperature`` > 0 samples instead (only ``sampled_dims`` if given, the others greedily, as the actors do),
    ``repeats`` episodes per init state. ``env``: one env or a list of one
    family (episodes run batched). Returns success_rate, successes, by_task, episodes, split, env_steps, wall_s,
    outcomes ([task_id, init_state_id, success] per episode) and, with ``videos`` > 0, "videos" (task_id,
    init_state_id, success, frames uint8 [chunks + 1, H, W, 3])."""
    envs = list(env) if isinstance(env, (list, tuple)) else [env]
    task_ids = list(envs[0].task_ids if task_ids is None else task_ids)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    pick = pick or list
    episodes = [(t, i) for t in task_ids for i in pick(envs[0].init_state_ids(t, split))] * repeats
    film = video_episodes(episodes, videos) if videos > 0 else set()
    t0 = time.perf_counter()
    was_training = policy.training
    policy.eval()
    results: list[EpisodeResult] = []
    width = max(1, min(batch_size, len(envs)))
    greedy = policy.tokenizer.greedy_positions(sampled_dims if temperature > 0 else None)
    with Progress(progress, len(episodes), "episodes") as bar:
        for start in range(0, len(episodes), width):
            part = episodes[start:start + width]
            results += rollout(policy, envs[:len(part)], part, temperature=temperature, generator=generator,
                               record=[ep in film for ep in part], greedy=greedy)
            bar.update(len(results), f"{sum(r.success for r in results)} successes")
    policy.train(was_training)
    by_task = {t: float(np.mean([r.success for r in results if r.task_id == t])) for t in task_ids}
    out = {"success_rate": float(np.mean([r.success for r in results])) if results else 0.0, "by_task": by_task,
           "successes": int(sum(r.success for r in results)), "episodes": len(results), "split": split,
           "temperature": float(temperature), "sampled_dims": None if greedy is None else list(sampled_dims),
           "env_steps": int(sum(r.env_steps for r in results)), "wall_s": time.perf_counter() - t0,
           "outcomes": [[r.task_id, r.init_state_id, bool(r.success)] for r in results]}
    if film:
        out["videos"] = [{"task_id": r.task_id, "init_state_id": r.init_state_id, "success": r.success,
                          "frames": np.stack(r.frames)} for r in results if r.frames]
    return out
