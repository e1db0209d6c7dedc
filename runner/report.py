"""What a run leaves behind for a person: TensorBoard scalars, summary.json, a success-rate plot and a plot of where
each process's time went."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any, Optional

from async_vla.metrics import Monitor


PROGRESS_FILE = "progress.json"   # eval and train points so far, so a resumed run's report covers the whole run
SAVE_EVERY_S = 5.0


class RunRecorder:
    """Collects rollout and eval success as the run goes, logs them, and writes the end-of-run report. With
    ``resume`` it continues ``<run>/progress.json`` (written as the run goes), so summary.json and success.png
    describe the whole run; throughput is per part (this process's own counts over its own time)."""

    def __init__(self, cfg: Any, run_dir: Path, monitor: Monitor, resume: bool = False):
        self.cfg, self.run_dir, self.monitor = cfg, Path(run_dir), monitor
        self.t0 = time.time()
        self.eval_points: list[dict] = []      # {"version", "wall_s", "success_rate", "successes", "episodes", ...}
        self.confirm_points: list[dict] = []   # the same, of the independent confirmations of a target (confirm split)
        self.stopped_on = "budget"             # run.max_wall_s / run.max_versions; "target" (confirmed), "signal", "failed"
        self.train_points: list[dict] = []     # {"version", "wall_s", "success_rate"}
        self.wall_offset = 0.0                 # wall time of the earlier parts of a resumed run
        self.resumed_at: list[int] = []        # versions a part started from
        self._window: collections.deque = collections.deque(maxlen=max(64, 8 * cfg.actor.group_size))
        self._by_task: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=64))
        self.trajectories = 0
        self.env_steps = 0.0
        self._saved_at = 0.0
        if resume:
            self._load_progress()
        write_versions(cfg, self.run_dir)

    def wall(self) -> float:
        """Seconds since the run started (the earlier parts of a resumed run included)."""
        return self.wall_offset + time.time() - self.t0

    def last_eval_version(self) -> Optional[int]:
        return self.eval_points[-1]["version"] if self.eval_points else None

    def mark_resumed(self, version: int) -> None:
        """A part starts at checkpoint ``version``: points past it came from updates a kill discarded (the run
        continues from the checkpoint, not from them), so they leave the record."""
        self.resumed_at.append(int(version))
        self.eval_points = [p for p in self.eval_points if p["version"] <= version]
        self.confirm_points = [p for p in self.confirm_points if p["version"] <= version]
        self.train_points = [p for p in self.train_points if p["version"] <= version]

    def _load_progress(self) -> None:
        try:
            saved = json.loads((self.run_dir / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return
        self.eval_points = list(saved.get("eval", []))
        self.confirm_points = list(saved.get("confirm", []))
        self.train_points = list(saved.get("train", []))
        self.resumed_at = list(saved.get("resumed_at", []))
        self.wall_offset = float(saved.get("wall_s", 0.0))

    def save_progress(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._saved_at < SAVE_EVERY_S:
            return
        self._saved_at = now
        out = {"wall_s": self.wall(), "eval": self.eval_points, "confirm": self.confirm_points,
               "train": self.train_points,
               "resumed_at": self.resumed_at}
        write_atomic(self.run_dir / PROGRESS_FILE, json.dumps(out, default=float))

    def observe_service(self, stats: dict) -> None:
        """Async mode: trajectories and env steps come from the buffer's stats, not from trajectories seen here
        (a buffer starts from zero with each part of a run): its received count, and the env steps the actors
        have reported in their ActorStats (the launcher stops the actors, which send their last, before it asks)."""
        self.trajectories = max(self.trajectories, int(stats.get("received", 0) or 0))
        self.env_steps = max(self.env_steps, float(stats.get("service", {}).get("env_steps_reported", 0) or 0))

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
        wall = self.wall()
        self.eval_points.append(eval_point(version, wall, res))
        self.monitor.scalar("eval/success_rate", res["success_rate"], version)
        for task, rate in res.get("by_task", {}).items():
            self.monitor.scalar(f"eval/success_rate_by_task/{task}", rate, version)
        for video in res.get("videos", []):   # logging.eval_videos episodes (evaluate_greedy(videos=n))
            self.monitor.video(f"eval/video/task{video['task_id']}_init{video['init_state_id']}", video["frames"],
                               version, self.cfg.logging.eval_video_fps)
        self.monitor.flush()
        took = f" in {res['wall_s']:.1f}s" if "wall_s" in res else ""     # the evaluation's own time; wall: the run's
        print(f"[eval] version {version}: greedy {res.get('split', 'eval')} success {res['success_rate']:.3f} "
              f"({res.get('episodes', '?')} episodes{took}; run at {wall:.0f}s)", flush=True)
        self.save_progress(force=True)

    def confirm_result(self, version: int, res: dict) -> bool:
        """Record the independent confirmation of a target reached at ``version``; True when it holds too."""
        self.confirm_points.append(eval_point(version, self.wall(), res))
        self.monitor.scalar("eval/confirm_success_rate", res["success_rate"], version)
        ok = res["success_rate"] >= self.cfg.run.target_success
        if ok:
            self.stopped_on = "target"
        print(f"[eval] version {version}: confirmation on {res['episodes']} other held-out episodes "
              f"{res['success_rate']:.3f} -> {'stop' if ok else 'not confirmed, training on'}", flush=True)
        return ok

    def learner_step(self, version: int, metrics: dict, buffer: Any = None) -> None:
        """Log one learner step's metrics plus the buffer's and the rollout success rates."""
        rate, by_task = self.rollout_rates()
        self.train_points.append({"version": version, "wall_s": self.wall(), "success_rate": rate})
        self.save_progress()
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
        part_s = time.time() - self.t0
        best = max((p["success_rate"] for p in self.eval_points), default=None)
        led = buffer.ledger if buffer is not None else {}
        return (f"[{self.wall():6.0f}s] v{version} rollout success {fmt_rate(rate if self._window else None)} | "
                f"best eval {fmt_rate(best)} | traj {led.get('received', self.trajectories)} trained "
                f"{led.get('trained', 0)} uniform {led.get('filtered_uniform', 0)} stale {led.get('stale', 0)} | "
                f"env steps/s {self.env_steps / max(part_s, 1e-9):.0f}")

    def finish(self, version: int, ledger: dict, extra: Optional[dict] = None,
               phases: Optional[dict] = None) -> dict:
        """Write summary.json, success.png and phases.png (and progress.json); returns the summary. ``phases``:
        seconds by phase per process kind (``async_vla.phases.phase_table``) of this part of the run."""
        wall, part_s = self.wall(), time.time() - self.t0
        evals = [p["success_rate"] for p in self.eval_points]
        reached = next((p for p in self.confirm_points if p["success_rate"] >= (self.cfg.run.target_success or 2)),
                       None)
        summary = {
            "run": self.cfg.run.name, "mode": self.cfg.run.mode, "final_version": version,
            "final_eval_success": evals[-1] if evals else None, "best_eval_success": max(evals) if evals else None,
            "initial_eval_success": start_success(self.eval_points, self.cfg.run.eval_split),
            "wall_s": wall,
            "time_to_target_s": reached["wall_s"] if reached else None,
            "version_at_target": reached["version"] if reached else None,
            "resumed_at": self.resumed_at,
            # The figure to report: the last evaluation (of the final policy), with its episodes and 95% interval,
            # plus what produced it (seed, budget, why the run stopped).
            "final_eval": final_eval(self.eval_points[-1]) if self.eval_points else None,
            "seed": self.cfg.run.seed,
            "budget": {"max_wall_s": self.cfg.run.max_wall_s, "max_versions": self.cfg.run.max_versions,
                       "target_success": self.cfg.run.target_success},
            "eval_split": self.cfg.run.eval_split,
            "stopped_on": self.stopped_on,
            "confirm_evals": self.confirm_points,
            "eval": self.eval_points, "ledger": ledger,
            # this part of the run (a resumed run's earlier parts had their own processes and counts)
            "throughput": {"trajectories_per_s": self.trajectories / max(part_s, 1e-9),
                           "env_steps_per_s": self.env_steps / max(part_s, 1e-9), "over_s": part_s},
            "phases": phases or {},   # this part of the run too: each process's time since it started
        }
        summary.update(extra or {})
        self.save_progress(force=True)
        write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=float))
        plot_success(self.run_dir / "success.png", self.eval_points, self.train_points)
        if phases:
            plot_phases(self.run_dir / "phases.png", phases)
        return summary


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file and a rename: a kill or a second Ctrl-C mid-write leaves the old file or none, never a
    truncated one that a reader (bin/libero-cpu's skip check, a plot) would fail on."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def record_eval_after_run(cfg: Any, run_dir: Path, version: int, res: dict) -> dict:
    """Add an evaluation of version ``version``'s export, made after the run (``bin/eval RUN --versions N
    --record``, docs/ARCHITECTURE.md "Follow one trajectory" step 5 says why), to the run's record: progress.json,
    summary.json's ``eval`` list, TensorBoard's ``eval/success_rate`` at that version and success.png; returns the
    point, marked ``after_run``. Its ``wall_s`` is the run's wall time at its first train point at or past that
    version, so the curve is drawn against training time. ``final_eval`` stays the run's own evaluation."""
    run_dir = Path(run_dir)
    split = res.get("split", "eval")
    progress = _run_progress(run_dir)
    if version in _evaluated_during_run(progress, split):
        raise ValueError(f"version {version} was evaluated on the {split} split during the run already; "
                         f"its figure stays the run's own")
    evals = progress.get("eval", [])
    made = [p["wall_s"] for p in progress.get("train", []) if p["version"] >= version]
    point = eval_point(version, min(made) if made else float("nan"), res)
    point["after_run"] = True
    evals = [p for p in evals if not (p["version"] == version and p.get("split", "eval") == split)] + [point]
    evals.sort(key=lambda p: p["version"])
    progress["eval"] = evals
    write_atomic(run_dir / PROGRESS_FILE, json.dumps(progress, default=float))
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        summary["eval"] = evals
        summary["best_eval_success"] = max(p["success_rate"] for p in evals)
        summary["initial_eval_success"] = start_success(evals, summary.get("eval_split", "eval"))
        write_atomic(summary_file, json.dumps(summary, indent=2, default=float))
    monitor = Monitor(run_dir, enabled=cfg.logging.tensorboard)
    monitor.scalar("eval/success_rate", res["success_rate"], version)
    for task, rate in res.get("by_task", {}).items():
        monitor.scalar(f"eval/success_rate_by_task/{task}", rate, version)
    monitor.close()
    plot_success(run_dir / "success.png", [p for p in evals if p["wall_s"] == p["wall_s"]],
                 progress.get("train", []))
    return point


def evaluated_during_run(run_dir: Path, split: str = "eval") -> set[int]:
    """Versions the run itself evaluated on ``split`` (raises ValueError when ``run_dir`` has no run record)."""
    return _evaluated_during_run(_run_progress(Path(run_dir)), split)


def evaluated_versions(run_dir: Path, split: str = "eval") -> set[int]:
    """Versions with an evaluation on ``split`` in the run's record, during the run or added after it."""
    return _evaluated_during_run(_run_progress(Path(run_dir)), split, with_after_run=True)


def _evaluated_during_run(progress: dict, split: str, with_after_run: bool = False) -> set[int]:
    return {int(p["version"]) for p in progress.get("eval", [])
            if p.get("split", "eval") == split and (with_after_run or not p.get("after_run"))}


def _run_progress(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / PROGRESS_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{run_dir / PROGRESS_FILE}: no run record to add to ({exc}); --record needs a directory "
                         f"bin/train wrote") from exc


def eval_videos(cfg: Any) -> int:
    """Episodes to film per evaluation: ``logging.eval_videos``, 0 when TensorBoard is off (nowhere to put them)."""
    return cfg.logging.eval_videos if cfg.logging.tensorboard else 0


def start_point(points: list[dict], split: str) -> Optional[dict]:
    """Version 0's evaluation on ``split``; None while v0 has none on it (``run.eval_at_start=false``, until
    ``bin/eval RUN --versions 0 --record`` adds it)."""
    return next((p for p in points if p["version"] == 0 and p.get("split", "eval") == split), None)


def start_success(points: list[dict], split: str) -> Optional[float]:
    """The start's figure: the success of version 0's evaluation on ``split`` (None: ``start_point``)."""
    point = start_point(points, split)
    return None if point is None else point["success_rate"]


def eval_point(version: int, wall: float, res: dict) -> dict:
    return {"version": version, "wall_s": wall, "success_rate": res["success_rate"],
            "successes": res.get("successes"), "episodes": res.get("episodes"), "split": res.get("split"),
            "by_task": {str(k): v for k, v in res.get("by_task", {}).items()}}


def final_eval(point: dict) -> dict:
    """The summary's ``final_eval``: version, split, success, successes, episodes and a Wilson 95% interval."""
    from async_vla.evalstats import rate_summary

    out = {"version": point["version"], "split": point.get("split"), "wall_s": point["wall_s"]}
    if point.get("episodes"):
        out.update(rate_summary(int(point["successes"]), int(point["episodes"])))
    else:  # a progress file from before episodes were recorded
        out["success"] = point["success_rate"]
    return out


def gain_lines(summary: dict) -> list[str]:
    """What a run did to held-out greedy success, from its ``summary.json``: the start (version 0's evaluation), the
    final policy, each with its 95% interval, and RL's gain with the one-sided Fisher exact p-value of "final above
    start" (the two evaluations' success counts, the same layouts). Without a version-0 evaluation on the run's split
    (``run.eval_at_start=false``) the lines say so and give no gain."""
    from async_vla.evalstats import fisher_one_sided_p

    def rate(r: dict) -> str:
        if not r.get("episodes"):  # a run recorded before evaluations kept their episode counts
            return f"{r['success']:.3f}"
        lo, hi = r["interval95"]
        return f"{r['success']:.3f} ({r['successes']}/{r['episodes']}, {lo:.3f}-{hi:.3f})"

    split = summary.get("eval_split", "eval")
    f = summary["final_eval"]
    stopped = f"stopped on {summary['stopped_on']}"
    confirm = summary.get("confirm_evals") or []
    if summary.get("stopped_on") == "target" and confirm:
        last = confirm[-1]
        stopped += f", confirmed on {last['episodes']} other held-out episodes: {last['success_rate']:.3f}"
    final = (f"  final  {rate(f)}  version {f['version']}, {summary['wall_s']:.0f} s of run wall time (RL budget "
             f"{summary['budget']['max_wall_s']:.0f} s), {stopped}")
    head = f"held-out ({split}) greedy success, 95% intervals, seed {summary['seed']}:"
    point = start_point(summary.get("eval", []), split)
    if point is None:
        return [head, "  start  not evaluated (run.eval_at_start=false): no gain to report", final]
    start = final_eval(point)
    if not (start.get("episodes") and f.get("episodes")):
        return [head, f"  start  {start['success']:.3f}", final, "  no episode counts: no p-value"]
    p = fisher_one_sided_p(f["successes"], f["episodes"], start["successes"], start["episodes"])
    return [head, f"  start  {rate(start)}  the policy RL started from", final,
            f"  RL's gain {f['success'] - start['success']:+.3f} (one-sided Fisher exact p = {p:.1e})"]


def fmt_rate(x: Optional[float]) -> str:
    """A success rate for a status line; "--" until there is one (not "nan")."""
    return "--" if x is None or x != x else f"{x:.2f}"


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


def plot_phases(path: Path, tables: dict) -> None:
    """One stacked bar per process kind: the share of its wall time each phase took (``phase_table``s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from async_vla.phases import KINDS, OTHER

    kinds = [k for k in KINDS if k in tables]
    names = sorted({n for k in kinds for n in tables[k]["frac"]}, key=lambda n: (n == OTHER, n))
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    colors[OTHER] = "lightgrey"
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(kinds)))
    for row, kind in enumerate(kinds):
        left, table = 0.0, tables[kind]
        for name, frac in table["frac"].items():
            ax.barh(row, frac, left=left, color=colors[name], edgecolor="white")
            if frac >= 0.06:
                ax.text(left + frac / 2, row, f"{name}\n{100 * frac:.0f}%", ha="center", va="center", fontsize=7)
            left += frac
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels([f"{k} ({tables[k]['processes']}, {tables[k]['wall_s']:.0f} s)" for k in kinds])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of wall time (processes of a kind summed)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors[n], label=n) for n in names], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(kinds) > 1 else -0.6), ncol=6, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
