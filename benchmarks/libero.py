"""Benchmark "libero": env steps/s of real LIBERO bare vs through LiberoEnv vs through SubprocessEnv.

All three run in the same worker processes (``SubprocessEnv`` children holding a ``LiberoEnv`` of spatial task 0),
interleaved ``repeats`` times so machine noise hits every mode alike:
  * bare: the libero/robosuite ``env.step`` loop inside the worker (what the simulator costs, with the same
    cameras and render settings);
  * wrapper: ``LiberoEnv.step`` inside the worker (action conversion, 180-degree flip, proprio);
  * subprocess: ``LiberoEnv.step`` driven from this process through the worker pipe (``step_many``), i.e. what
    an actor with isolated env workers gets (pickling of the observation + IPC).
For 1 and 2 worker processes at once (2 = this machine's cores; throughput is summed over processes). The
render settings, the GL backend, reset times and the RSS of a worker (one simulator) are reported as well.
Because blocks run at different moments, their steps/s ratios carry the machine's load swings; the "sim share"
(simulator seconds / total seconds over the very same steps) measures the overhead robustly.
Goal: wrapper and subprocess >= 90% of bare (sim share >= 90%).

Decision-point rendering (second table): env steps/s of a chunk-8 rollout through ``SubprocessEnv.step_chunk``
(what actors call) with ``env.render_at=every_step`` against ``decision`` (only the chunk's last step renders,
pixel-equal there), the same settings, actions and workers, interleaved. Goal: >= 6x at 128 px full render.
With several workers (``procs``) the steps/s are summed: this is the envs-per-actor scaling on this machine.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from async_vla.config import load_config
from async_vla.envs.libero import LiberoEnv, libero_version, to_libero_action

MAIN = {"image_size": 128, "render_mode": "full", "wrist_camera": False}
SETTINGS = [MAIN, {"image_size": 128, "render_mode": "cheap", "wrist_camera": False},
            {"image_size": 128, "render_mode": "full", "wrist_camera": True},
            {"image_size": 224, "render_mode": "full", "wrist_camera": True, "render_size": 256}]
CPU_RUN = {"image_size": 64, "render_mode": "cheap", "wrist_camera": False}   # configs/libero_cpu.yaml
GOAL = 0.9


class BenchLiberoEnv(LiberoEnv):
    """LiberoEnv with timed step blocks, run inside the worker process."""

    def __init__(self, env_cfg, seed: int = 0):
        super().__init__(env_cfg, seed)
        self._actions = np.random.default_rng(seed).uniform(-0.3, 0.3, (4096, 7))
        self._actions[:, 6] = 1.0  # gripper open (OpenVLA convention)
        self._k = 0
        self.acc = {"raw": 0.0, "wrapper": 0.0, "n": 0}  # seconds inside the simulator's / our step

    # Time the simulator's step inside every wrapper step, so the wrapper's share is measured on the same
    # steps (robust to the machine load drifting between blocks).
    def _env_for(self, task_id: int):
        env = super()._env_for(task_id)
        if not getattr(env, "_bench_timed", False):
            inner = env.step

            def timed(action):
                t0 = time.perf_counter()
                out = inner(action)
                self.acc["raw"] += time.perf_counter() - t0
                return out

            env.step, env._bench_timed = timed, True
        return env

    def step(self, action):
        t0 = time.perf_counter()
        out = super().step(action)
        self.acc["wrapper"] += time.perf_counter() - t0
        self.acc["n"] += 1
        return out

    def take_acc(self) -> dict:
        out, self.acc = self.acc, {"raw": 0.0, "wrapper": 0.0, "n": 0}
        return out

    def block(self, kind: str, n: int) -> float:
        """Seconds for n steps of `bare` (the libero env) or `wrapper` (this class); resets are not timed."""
        raw_steps = self.raw_env.env.timestep if self.raw_env is not None else 10**9
        if self._done or self._steps + n > self._max_steps or raw_steps + n > 900:
            self.reset(self.task_ids[0], 0)
        acts = self._actions[self._k: self._k + n]
        self._k = (self._k + n) % (len(self._actions) - n)
        self.take_acc()
        if kind == "bare":
            env, conv = self.raw_env, [to_libero_action(a, self.cfg.gripper_convention) for a in acts]
            t0 = time.perf_counter()
            for a in conv:
                env.step(a)
            elapsed = time.perf_counter() - t0
            self._steps += n  # keep the wrapper's episode counter in line with the simulator
            return elapsed
        t0 = time.perf_counter()
        for a in acts:
            self.step(a)
        elapsed = time.perf_counter() - t0
        self.share = self.take_acc()
        return elapsed

    def wrapper_share(self) -> dict:
        """Simulator vs wrapper seconds of the last wrapper block."""
        return self.share

    def prepare(self, n: int) -> None:
        """Make sure the next n wrapper steps fit in the episode (untimed), and zero the step timers."""
        if self._done or self._steps + n > self._max_steps or self.raw_env.env.timestep + n > 900:
            self.reset(self.task_ids[0], 0)
        self.take_acc()

    def timed_reset(self) -> float:
        t0 = time.perf_counter()
        self.reset(self.task_ids[0], 0)
        return time.perf_counter() - t0

    def info(self) -> dict:
        import psutil

        return {"rss_mb": psutil.Process().memory_info().rss / 2**20, "gl": self.gl_backend,
                "versions": libero_version()}


def bench_env_factory(cfg, seed: int) -> BenchLiberoEnv:
    return BenchLiberoEnv(cfg.env, seed)


def _overrides(setting: dict) -> list[str]:
    out = ["env.kind=libero", "env.suite=spatial", "env.task_ids=[0]", "env.step_timeout_s=120",
           "policy.patch_size=8"]
    return out + [f"env.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in setting.items()]


def _measure(setting: dict, procs: int, steps: int, repeats: int) -> dict:
    from actors.env_worker import SubprocessEnv, step_many

    cfg = load_config(overrides=_overrides(setting))
    envs = []
    try:
        t0 = time.perf_counter()
        envs = [SubprocessEnv(cfg, seed=i, factory=bench_env_factory) for i in range(procs)]
        for e in envs:
            e.reset_async(0, 0)
        for e in envs:
            e.wait()
        build_s = time.perf_counter() - t0  # spawn + import + simulator build + first reset
        reset_s = statistics.median(envs[0].call("timed_reset") for _ in range(2))
        rates: dict[str, list[float]] = {"bare": [], "wrapper": [], "subprocess": []}
        # Same-step shares: simulator seconds / wrapper seconds (in the worker) and / wall seconds seen here.
        shares: dict[str, list[float]] = {"wrapper": [], "subprocess": []}
        action = np.zeros(7, dtype=np.float32)
        action[6] = 1.0
        for _ in range(repeats):
            for kind in ("bare", "wrapper"):
                for e in envs:
                    e.call_async("block", kind, steps)
                rates[kind].append(sum(steps / e.wait() for e in envs))
            accs = [e.call("wrapper_share") for e in envs]
            shares["wrapper"].append(sum(a["raw"] for a in accs) / sum(a["wrapper"] for a in accs))
            for e in envs:
                e.call("prepare", steps)
            t0 = time.perf_counter()
            for _ in range(steps):
                for r in step_many(envs, [action] * procs):
                    if isinstance(r, Exception):
                        raise r
            wall = time.perf_counter() - t0
            rates["subprocess"].append(procs * steps / wall)
            accs = [e.call("take_acc") for e in envs]
            shares["subprocess"].append(sum(a["raw"] for a in accs) / (procs * wall))
        info = envs[0].call("info")
    finally:
        for e in envs:
            e.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"setting": setting, "procs": procs, "steps_per_s": med, "all": rates,
            "wrapper_vs_bare": med["wrapper"] / med["bare"], "subprocess_vs_bare": med["subprocess"] / med["bare"],
            "sim_share_wrapper": statistics.median(shares["wrapper"]),
            "sim_share_subprocess": statistics.median(shares["subprocess"]),
            "build_s": build_s, "reset_s": reset_s, "rss_mb_per_env": info["rss_mb"], "gl": info["gl"],
            "versions": info["versions"]}


DECISION_GOAL = 6.0
CHUNK = 8


def _measure_decision(setting: dict, procs: int, chunks: int, repeats: int) -> dict:
    """Chunk-8 rollout steps/s, render every step vs at decision points (interleaved blocks of ``chunks``)."""
    out = _measure_chunked(setting, procs, chunks, repeats,
                           {"every_step": ["env.render_at=every_step"], "decision": ["env.render_at=decision"]})
    return {**out, "speedup": out["steps_per_s"]["decision"] / out["steps_per_s"]["every_step"]}


def _measure_single_forward(setting: dict, procs: int, chunks: int, repeats: int) -> dict:
    """Chunk-8 rollout steps/s at decision points with robosuite's step loop vs env.single_forward's."""
    base = ["env.render_at=decision"]
    out = _measure_chunked(setting, procs, chunks, repeats, {"robosuite": base + ["env.single_forward=false"],
                                                             "single_forward": base + ["env.single_forward=true"]})
    return {**out, "speedup": out["steps_per_s"]["single_forward"] / out["steps_per_s"]["robosuite"]}


def _measure_chunked(setting: dict, procs: int, chunks: int, repeats: int, modes: dict[str, list[str]]) -> dict:
    """Steps/s of chunk-8 rollouts through SubprocessEnv.step_chunk for each mode's overrides, the same actions
    and init state, blocks interleaved ``repeats`` times (resets untimed); medians over the blocks."""
    from actors.env_worker import SubprocessEnv

    rng = np.random.default_rng(0)
    actions = rng.uniform(-0.3, 0.3, (chunks, CHUNK, 7)).astype(np.float32)
    actions[..., 6] = 1.0
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    envs: dict[str, list] = {}
    try:
        for mode, extra in modes.items():
            cfg = load_config(overrides=_overrides(setting) + extra + [f"env.max_steps={chunks * CHUNK}"])
            envs[mode] = [SubprocessEnv(cfg, seed=i) for i in range(procs)]
        for _ in range(repeats):
            for mode, workers in envs.items():
                for e in workers:
                    e.reset_async(0, 0)
                for e in workers:
                    e.wait()  # resets are not timed
                t0 = time.perf_counter()
                n = 0
                for chunk in actions:
                    for e in workers:
                        e.step_chunk_async(chunk)
                    n += sum(e.wait()[3] for e in workers)
                rates[mode].append(n / (time.perf_counter() - t0))
    finally:
        for workers in envs.values():
            for e in workers:
                e.close()
    return {"setting": setting, "procs": procs, "steps_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "all": rates}


def _describe(s: dict) -> str:
    cams = "agentview+wrist" if s.get("wrist_camera") else "agentview"
    size = f"{s['render_size']}->{s['image_size']}" if s.get("render_size") else f"{s['image_size']}"
    return f"{size}px {cams} {s['render_mode']}"


def run(quick: bool = False) -> dict:
    steps, repeats = (8, 1) if quick else (25, 3)
    plan = [(MAIN, 1), (MAIN, 2)] if quick else [(MAIN, 1), (MAIN, 2)] + [(s, 1) for s in SETTINGS[1:]]
    rows = [_measure(s, p, steps, repeats) for s, p in plan]
    first = rows[0]
    lines = [
        f"LIBERO spatial task 0, {steps} steps x {repeats} interleaved repeats per mode, GL backend "
        f"`{first['gl']}`, soft resets (env.hard_reset=false), "
        + ", ".join(f"{k} {v}" for k, v in first["versions"].items() if k != "MUJOCO_GL") + ".",
        "",
        "| render settings | procs | bare steps/s | wrapper steps/s | subprocess steps/s | wrapper/bare | "
        "subprocess/bare | sim share wrapper | sim share subprocess | reset s | build s | RSS/env MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["steps_per_s"]
        lines.append(
            f"| {_describe(r['setting'])} | {r['procs']} | {m['bare']:.2f} | {m['wrapper']:.2f} | "
            f"{m['subprocess']:.2f} | {r['wrapper_vs_bare']:.0%} | {r['subprocess_vs_bare']:.0%} | "
            f"{r['sim_share_wrapper']:.1%} | {r['sim_share_subprocess']:.1%} | "
            f"{r['reset_s']:.2f} | {r['build_s']:.1f} | {r['rss_mb_per_env']:.0f} |")
    ok = all(min(r["sim_share_wrapper"], r["sim_share_subprocess"]) >= GOAL for r in rows)
    chunks, drepeats = (2, 1) if quick else (4, 3)
    dplan = [(MAIN, 1)] if quick else [(MAIN, 1), (MAIN, 2), (MAIN, 4),
                                      ({"image_size": 64, "render_mode": "full", "wrist_camera": False}, 2)]
    drows = [_measure_decision(s, p, chunks, drepeats) for s, p in dplan]
    dok = drows[0]["speedup"] >= DECISION_GOAL
    lines += ["", "steps/s: medians of interleaved blocks (block-to-block load swings on 2 shared cores move them "
              "by +-20%). sim share: simulator seconds / total seconds over the very same steps (in the worker for "
              "the wrapper, wall time in this process for the subprocess), the load-robust overhead measure. "
              f"Goal sim share >= {GOAL:.0%}: {'met' if ok else 'NOT met'}.",
              "", f"Decision-point rendering: chunk-{CHUNK} rollout through SubprocessEnv.step_chunk, {chunks} chunks "
              f"x {drepeats} interleaved repeats per mode (resets untimed); steps/s summed over the worker processes.",
              "", "| render settings | procs | every_step steps/s | decision steps/s | speedup |", "|---|---|---|---|---|"]
    for r in drows:
        m = r["steps_per_s"]
        lines.append(f"| {_describe(r['setting'])} | {r['procs']} | {m['every_step']:.2f} | {m['decision']:.2f} | "
                     f"{r['speedup']:.1f}x |")
    lines += ["", f"Goal >= {DECISION_GOAL:g}x at 128 px full render (1 process): "
              f"{'met' if dok else 'NOT met'} ({drows[0]['speedup']:.1f}x)."]
    # env.single_forward at the CPU-run setting (configs/libero_cpu.yaml: 64 px cheap, decision points)
    fchunks, frepeats = (2, 1) if quick else (8, 3)
    frow = _measure_single_forward(CPU_RUN, 1, fchunks, frepeats)
    m = frow["steps_per_s"]
    lines += ["", f"env.single_forward (one mj_forward per physics substep instead of robosuite's two, bit-identical): "
              f"chunk-{CHUNK} rollout at decision points, {fchunks} chunks x {frepeats} interleaved repeats, 1 process.",
              "", "| render settings | robosuite loop steps/s | single_forward steps/s | speedup |", "|---|---|---|---|",
              f"| {_describe(CPU_RUN)} | {m['robosuite']:.2f} | {m['single_forward']:.2f} | {frow['speedup']:.2f}x |"]
    return {"section": "libero", "results": {"rows": rows, "goal": GOAL, "goal_met": ok, "steps": steps,
                                             "repeats": repeats, "decision_rows": drows,
                                             "decision_goal": DECISION_GOAL, "decision_goal_met": dok,
                                             "single_forward": frow},
            "markdown": "\n".join(lines)}


if __name__ == "__main__":
    print(run(quick=True)["markdown"])
