"""Serial mode (``run.mode=serial``): actor, buffer and learner in one process and one thread.

The same objects the multi-process system uses — ``SerialActor`` (policy + envs + group rollouts),
``GroupBuffer`` (assembly, filters, staleness, ledger), ``TorchLearner`` (the GRPO step) — wired by direct
calls: trajectories still go through the wire encoding (``LocalPipe``) so the schema is exercised. The
actor shares the learner's policy object, so a "weight swap" is only a version bump. Useful for tests,
debugging and ablations; throughput comes from the async mode.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
from pathlib import Path
from typing import Any, Optional

from async_vla.config import Config, write_resolved
from async_vla.metrics import Monitor
from async_vla.transport import LocalPipe
from runner.report import RunRecorder

log = logging.getLogger("runner.serial")


def build_policy_for(cfg: Config) -> Any:
    """The starting policy: ``policy.path`` when given (e.g. the SFT checkpoint), else a fresh tiny model."""
    import torch

    from async_vla.policy import build_policy, load_policy

    torch.manual_seed(cfg.run.seed)
    if cfg.policy.path and cfg.policy.arch == "tiny":
        return load_policy(cfg.policy.path)
    return build_policy(cfg)


def run_serial(cfg: Config, run_dir: Path, *, resume: bool = False) -> dict:
    """Train until ``run.max_versions``, ``run.max_wall_s`` or ``run.target_success``; returns the summary."""
    import torch

    from actors.actor import SerialActor
    from async_vla.buffer import GroupBuffer
    from async_vla.envs.base import make_env
    from async_vla.sft import evaluate_greedy
    from learner.core import TorchLearner

    torch.set_num_threads(max(1, cfg.actor.torch_threads))
    write_resolved(cfg, run_dir)
    policy = build_policy_for(cfg)
    envs = [make_env(cfg, seed=cfg.run.seed * 1000 + i) for i in range(cfg.actor.group_size)]
    task_ids = list(cfg.env.task_ids if cfg.env.task_ids is not None else envs[0].task_ids)
    learner = TorchLearner(cfg, policy)
    ckpt_dir = run_dir / "checkpoints"
    extra: dict = {}
    if resume and ckpt_dir.exists():
        extra = learner.load_checkpoint(ckpt_dir)
        log.info("resumed at version %d", learner.version)
    lag = cfg.run.serial_lag
    # serial_lag > 0: the actor gets its own copy of the policy and the weights of `lag` versions ago.
    actor_policy = copy.deepcopy(policy) if lag else policy
    snapshots: collections.deque = collections.deque(maxlen=lag + 1)
    if lag:
        snapshots.append((learner.version, {k: v.detach().clone() for k, v in policy.state_dict().items()}))
    actor = SerialActor(cfg, 0, actor_policy, envs, version=learner.version)
    buffer = GroupBuffer(cfg, run_id=cfg.run.name, valid_task_ids=task_ids)
    buffer.set_learner_version(learner.version)
    pipe = LocalPipe(capacity=cfg.actor.group_size * 4)
    monitor = Monitor(run_dir, enabled=cfg.logging.tensorboard)
    recorder = RunRecorder(cfg, run_dir, monitor, resume=resume)
    if resume:
        recorder.mark_resumed(learner.version)
    t_start = time.perf_counter()

    def evaluate(version: int) -> float:
        res = evaluate_greedy(policy, envs, task_ids, split=cfg.run.eval_split)
        recorder.eval_result(version, res)
        return res["success_rate"]

    def confirmed(version: int) -> bool:
        """The target reached on the eval split holds on the second, disjoint held-out set too."""
        return recorder.confirm_result(version, evaluate_greedy(policy, envs, task_ids, split="confirm"))

    if recorder.last_eval_version() != learner.version:   # resumed: the previous part ended with this very eval
        evaluate(learner.version)
    rollout_s = train_s = 0.0
    last_status = time.perf_counter()
    try:
        while learner.version < cfg.run.max_versions:
            if time.perf_counter() - t_start > cfg.run.max_wall_s:
                log.info("wall-time budget reached")
                break
            t0 = time.perf_counter()
            groups = None
            while groups is None:
                buffer.expire()
                got = buffer.take_batch(learner.version)
                if got is not None:
                    groups = got[1]
                    break
                ids = buffer.grant(0, want=1)
                if not ids:
                    raise RuntimeError("serial mode: buffer granted nothing and has no batch (check buffer.max_groups "
                                       "and buffer.groups_per_batch)")
                for traj in actor.run_one_group(ids[0]):
                    pipe.send(traj)
                    recorder.rollout(traj)
                    while (msg := pipe.recv()) is not None:
                        buffer.add(msg)
            t1 = time.perf_counter()
            rollout_s += t1 - t0
            metrics = learner.train_step(groups)
            train_s += time.perf_counter() - t1
            buffer.set_learner_version(learner.version)
            if lag:
                snapshots.append((learner.version, {k: v.detach().clone() for k, v in policy.state_dict().items()}))
                version, state = snapshots[0]  # the oldest kept: `lag` versions ago once the deque is full
                actor.set_weights(version, state)
            else:
                actor.set_weights(learner.version)  # shared policy object: already updated in place
            wall = time.perf_counter() - t_start
            metrics.update({
                "perf/learner_idle_frac": rollout_s / max(wall, 1e-9),  # learner waits for rollouts here
                "weights/sync_s": 0.0, "weights/bytes": 0.0, "weights/version": float(learner.version),
                "perf/env_steps_per_s": actor.totals.env_steps / max(wall, 1e-9),
                "perf/trajectories_per_s": buffer.received / max(wall, 1e-9),
                "perf/tokens_per_s": metrics.get("perf/learner_tokens_per_s", 0.0),
            })
            recorder.learner_step(learner.version, metrics, buffer)
            if cfg.run.eval_every and learner.version % cfg.run.eval_every == 0:
                rate = evaluate(learner.version)
                if cfg.run.target_success is not None and rate >= cfg.run.target_success and confirmed(learner.version):
                    print(f"[train] target success {cfg.run.target_success} reached at version {learner.version}",
                          flush=True)
                    break
            if cfg.run.checkpoint_every and learner.version % cfg.run.checkpoint_every == 0:
                learner.save_checkpoint(ckpt_dir, extra={"ledger": buffer.ledger})
            if time.perf_counter() - last_status > cfg.logging.status_every_s:
                last_status = time.perf_counter()
                print(recorder.status_line(learner.version, buffer), flush=True)
        if not (cfg.run.eval_every and learner.version % cfg.run.eval_every == 0):
            evaluate(learner.version)
        learner.save_checkpoint(ckpt_dir, extra={"ledger": buffer.ledger, **extra})
        learner.export_policy(run_dir / "policy")
        buffer.write_ledger(run_dir)
        return recorder.finish(learner.version, buffer.ledger_snapshot(),
                               extra={"rollout_s": rollout_s, "train_s": train_s, "mode": "serial"})
    finally:
        monitor.close()
        actor.close()


def main_serial(cfg: Config, run_dir: Path, resume: bool = False) -> Optional[dict]:
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tensorboard = None
    if cfg.logging.serve_tensorboard:   # the one process besides this one that serial mode starts
        from runner.launch import start_tensorboard

        tensorboard = start_tensorboard(cfg, run_dir)
    try:
        return run_serial(cfg, run_dir, resume=resume)
    finally:
        if tensorboard is not None:
            tensorboard.stop(timeout_s=10)
