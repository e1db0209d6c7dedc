"""What a run leaves behind for a person: TensorBoard scalars, summary.json and a success-rate plot."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any, Optional

from async_vla.metrics import Monitor


class RunRecorder:
    """Collects rollout and eval success as the run goes, logs them, and writes the end-of-run report."""

    def __init__(self, cfg: Any, run_dir: Path, monitor: Monitor):
        self.cfg, self.run_dir, self.monitor = cfg, Path(run_dir), monitor
        self.t0 = time.time()
        self.eval_points: list[dict] = []      # {"version", "wall_s", "success_rate", "by_task"}
        self.train_points: list[dict] = []     # {"version", "wall_s", "success_rate"}
        self._window: collections.deque = collections.deque(maxlen=max(64, 8 * cfg.actor.group_size))
        self._by_task: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=64))
        self.trajectories = 0
        self.env_steps = 0
        write_versions(cfg, self.run_dir)

    def rollout(self, traj: Any) -> None:
        """Every finished trajectory (serial mode sees them all; async mode gets ActorStats instead)."""
        self.trajectories += 1
        self.env_steps += int(traj.env_steps)
        self._window.append(float(traj.success))
        self._by_task[int(traj.task_id)].append(float(traj.success))

    def rollout_rates(self) -> tuple[float, dict[int, float]]:
        overall = sum(self._window) / len(self._window) if self._window else 0.0
        return overall, {t: sum(d) / len(d) for t, d in self._by_task.items() if d}

    def eval_result(self, version: int, res: dict) -> None:
        wall = time.time() - self.t0
        self.eval_points.append({"version": version, "wall_s": wall, "success_rate": res["success_rate"],
                                 "by_task": {str(k): v for k, v in res.get("by_task", {}).items()}})
        self.monitor.scalar("eval/success_rate", res["success_rate"], version)
        for task, rate in res.get("by_task", {}).items():
            self.monitor.scalar(f"eval/success_rate_by_task/{task}", rate, version)
        self.monitor.flush()
        print(f"[eval] version {version}: greedy held-out success {res['success_rate']:.3f} "
              f"({res.get('episodes', '?')} episodes, {wall:.0f}s)", flush=True)

    def learner_step(self, version: int, metrics: dict, buffer: Any = None) -> None:
        """Log one learner step's metrics plus the buffer's and the rollout success rates."""
        rate, by_task = self.rollout_rates()
        self.train_points.append({"version": version, "wall_s": time.time() - self.t0, "success_rate": rate})
        values = dict(metrics)
        values["rollout/success_rate"] = rate
        for task, r in by_task.items():
            values[f"rollout/success_rate_by_task/{task}"] = r
        if buffer is not None:
            values.update(buffer.metrics())
            lags = [lag for lag, n in buffer.lag_histogram.items() for _ in range(min(n, 10_000))]
            if lags:
                self.monitor.histogram("buffer/lag_hist", lags, version)
        self.monitor.scalars(values, version)

    def status_line(self, version: int, buffer: Any = None) -> str:
        rate, _ = self.rollout_rates()
        wall = time.time() - self.t0
        best = max((p["success_rate"] for p in self.eval_points), default=float("nan"))
        led = buffer.ledger if buffer is not None else {}
        return (f"[{wall:6.0f}s] v{version} rollout success {rate:.2f} | best eval {best:.2f} | "
                f"traj {led.get('received', self.trajectories)} trained {led.get('trained', 0)} "
                f"uniform {led.get('filtered_uniform', 0)} stale {led.get('stale', 0)} | "
                f"env steps/s {self.env_steps / max(wall, 1e-9):.0f}")

    def finish(self, version: int, ledger: dict, extra: Optional[dict] = None) -> dict:
        """Write summary.json and success.png; returns the summary."""
        wall = time.time() - self.t0
        evals = [p["success_rate"] for p in self.eval_points]
        reached = next((p for p in self.eval_points if self.cfg.run.target_success is not None
                        and p["success_rate"] >= self.cfg.run.target_success), None)
        summary = {
            "run": self.cfg.run.name, "mode": self.cfg.run.mode, "final_version": version,
            "final_eval_success": evals[-1] if evals else None, "best_eval_success": max(evals) if evals else None,
            "initial_eval_success": evals[0] if evals else None,
            "wall_s": wall,
            "time_to_target_s": reached["wall_s"] if reached else None,
            "eval": self.eval_points, "ledger": ledger,
            "throughput": {"trajectories_per_s": self.trajectories / max(wall, 1e-9),
                           "env_steps_per_s": self.env_steps / max(wall, 1e-9)},
        }
        summary.update(extra or {})
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        plot_success(self.run_dir / "success.png", self.eval_points, self.train_points)
        return summary


def write_versions(cfg: Any, run_dir: Path) -> dict:
    """``<run>/versions.json``: the software a run used (and the simulator stack for LIBERO runs)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "deepspeed", "pyzmq", "msgpack", "transformers", "numpy", "async_vla"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if cfg.env.kind == "libero":
        from async_vla.envs.libero import libero_version

        out["libero_stack"] = libero_version()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "versions.json").write_text(json.dumps(out, indent=2))
    return out


def plot_success(path: Path, eval_points: list[dict], train_points: list[dict]) -> None:
    """Success rate (train rollouts at T=1.6, and greedy held-out eval) against wall time and version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "wall_s", "wall time (s)"), (axes[1], "version", "policy version")):
        if train_points:
            ax.plot([p[key] for p in train_points], [p["success_rate"] for p in train_points],
                    label="train rollouts (T=1.6)", alpha=0.7)
        if eval_points:
            ax.plot([p[key] for p in eval_points], [p["success_rate"] for p in eval_points], "o-",
                    label="eval (greedy, held-out)")
        ax.set_xlabel(label)
        ax.set_ylabel("success rate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
