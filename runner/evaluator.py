"""Greedy held-out evaluation during a run, and the rule that ends a run at ``run.target_success``. ``HeldOut`` scores a
policy and applies the target rule (serial mode holds one); ``Evaluator`` is the launchers': its own copy of the
policy, loaded from a milestone export, the latest export, or the learner's final ``<run>/policy``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

from async_vla.config import Config
from async_vla.placement import evaluator_device
from runner.report import RunRecorder, eval_videos


class HeldOut:
    """Greedy evaluation of ``policy`` on ``envs``: ``score`` on ``run.eval_split`` (the run's curve), ``confirm``
    on the second, disjoint held-out set (an independent check of a target before the run stops on it)."""

    def __init__(self, cfg: Config, policy: Any, envs: list, task_ids: list[int]):
        self.cfg, self.policy, self.envs, self.task_ids = cfg, policy, envs, task_ids

    def score(self) -> dict:
        from async_vla.sft import evaluate_greedy

        return evaluate_greedy(self.policy, self.envs, self.task_ids, split=self.cfg.run.eval_split,
                               videos=eval_videos(self.cfg))

    def confirm(self) -> dict:
        from async_vla.sft import evaluate_greedy

        return evaluate_greedy(self.policy, self.envs, self.task_ids, split="confirm")

    def record(self, recorder: RunRecorder, version: int, res: dict) -> bool:
        """Record ``res``, the score of ``version`` (the weights evaluated last); True - the run stops there - once
        it reaches ``run.target_success`` and the confirmation on the second held-out set holds too."""
        recorder.eval_result(version, res)
        target = self.cfg.run.target_success
        if target is None or res["success_rate"] < target or not recorder.confirm_result(version, self.confirm()):
            return False
        print(f"[train] target success {target} reached at version {version}", flush=True)
        return True


class Evaluator(HeldOut):
    """Greedy held-out evaluation of exported weights (``<run>/weights``), in the launcher process."""

    def __init__(self, cfg: Config, run_dir: Path):
        import torch

        from actors.env_worker import make_isolated_env
        from async_vla.policy import build_policy

        torch.set_num_threads(1)
        self.run_dir = run_dir
        device = evaluator_device(cfg)
        if device is not None:     # "cuda" (what the OpenVLA loader asks for) then means this GPU
            torch.cuda.set_device(torch.device(device))
        torch.manual_seed(cfg.run.seed)
        policy = build_policy(cfg)   # the architecture (and action statistics) the exported weights load into
        n = cfg.run.eval_envs or min(cfg.actor.group_size, 8)
        # LIBERO: one worker process per env (env.worker=auto), so held-out episodes step in parallel.
        envs = [make_isolated_env(cfg, seed=10_000 + i) for i in range(n)]
        super().__init__(cfg, policy, envs, list(cfg.env.task_ids if cfg.env.task_ids is not None
                                                 else envs[0].task_ids))
        self.version = -1

    def latest_version(self) -> int:
        """Version named by ``<run>/weights/latest`` (cheap: reads the pointer, not the tensors)."""
        try:
            name = (self.run_dir / "weights" / "latest").read_text().strip()
            return int(name[1:].split(".")[0]) if name.startswith("v") else -1
        except (OSError, ValueError):
            return -1

    def final_version(self) -> int:
        """The version ``evaluate()`` would score now: the latest export's, else the learner's final policy's
        (weights.export=false), else the one loaded last (the initial policy if nothing was trained)."""
        from async_vla.policy.build import read_policy_version

        latest = self.latest_version()
        if latest >= 0:
            return latest
        final = read_policy_version(self.run_dir / "policy")
        return final if final is not None and final >= self.version else max(self.version, 0)

    def ask_for_milestones(self) -> None:
        """Have the learner keep the export of every ``run.eval_every``-th version for us (``weights/milestones``);
        any left from an earlier part of this run (a resume discards what came after its checkpoint) go."""
        from async_vla.weights.export import MILESTONES, discard_milestones

        if self.cfg.run.eval_every:
            (self.run_dir / "weights" / MILESTONES).mkdir(parents=True, exist_ok=True)
            discard_milestones(self.run_dir / "weights")

    def next_milestone(self) -> Optional[Path]:
        """The newest milestone export past the version evaluated last; older ones are skipped (deleted)."""
        from async_vla.weights.export import newest_milestone

        return newest_milestone(self.run_dir / "weights", self.version)

    def close_milestones(self) -> None:
        from async_vla.weights.export import MILESTONES, discard_milestones

        discard_milestones(self.run_dir / "weights")
        with contextlib.suppress(OSError):
            (self.run_dir / "weights" / MILESTONES).rmdir()

    def evaluate(self, use_latest: bool = True, path: Optional[Path] = None) -> tuple[int, dict]:
        """Greedy held-out success of the export at ``path`` (deleted once loaded: a milestone), else - with
        ``use_latest`` - of the latest export, or where there is none (weights.export=false) of the learner's
        final ``<run>/policy`` once it has written one; else of the weights loaded last (the initial policy)."""
        from async_vla.policy.build import read_policy_version

        final = self.run_dir / "policy"
        if path is not None:
            self._load(path)
            with contextlib.suppress(OSError):
                path.unlink()
        elif use_latest and self.latest_version() >= 0:
            self._load(self.run_dir / "weights")
        elif use_latest and (v := read_policy_version(final)) is not None and v >= self.version:
            self._load(final, v)
        else:
            self.version = max(self.version, 0)
        return self.version, self.score()

    def _load(self, path: Path, version: Optional[int] = None) -> None:
        from actors.weight_loading import load_weights, load_weights_path

        got, state = load_weights_path(str(path), max(self.version, 0) if version is None else version)
        load_weights(self.policy, state)
        self.version = got

    def close(self) -> None:
        for env in self.envs:
            env.close()
