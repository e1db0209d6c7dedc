"""Actor benchmark: env steps/s of the built-in task through real actor processes vs the bare env loop.

Bare loop (per process): the same policy and G envs, the same batched ``policy.act`` + ``decode_actions`` per
chunk and the same env steps, but nothing else: no recording, no messages, no sockets, no heartbeats.
Through actors: ``python -m actors`` processes (exactly what the fleet starts) connected over loopback TCP to
a draining receiver in this process (grants every request, decodes every trajectory and drops it), so the
figure includes trajectory recording, encode, send, heartbeats, stats and status files.

Both run for 1 and 2 processes at once (2 = this machine's cores); each process pins 1 torch thread.
Throughput is counted after a warm-up (first group of every process) over the same wall-clock window, and
the two modes are interleaved ``repeats`` times so machine noise hits both. Goal: actor >= 90% of bare.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
OVERRIDES = ["run.name=bench", "actor.torch_threads=1", "transport.weights_port=0", "logging.level=WARNING"]


def _bare_worker(overrides: list[str], seed: int, duration: float, barrier, out) -> None:
    """One bare-loop process: warm up one group, wait for the others, then count env steps for ``duration``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np
    import torch

    from async_vla.config import load_config
    from async_vla.envs import make_env
    from async_vla.policy import build_policy

    torch.set_num_threads(1)
    cfg = load_config(None, overrides)
    policy = build_policy(cfg).eval()
    g = min(cfg.env.envs_per_actor, cfg.actor.group_size)
    envs = [make_env(cfg, seed * 100 + j) for j in range(g)]
    tasks = envs[0].task_ids
    gen = torch.Generator().manual_seed(seed)

    def group(k: int) -> int:
        task = tasks[k % len(tasks)]
        ids = envs[0].init_state_ids(task, "train")
        obs = [e.reset(task, ids[k % len(ids)]) for e in envs]
        instr = envs[0].instruction(task)
        live, steps = list(range(g)), 0
        while live:
            images = np.stack([obs[i].image for i in live])
            proprio = np.stack([obs[i].proprio for i in live])
            tokens, _ = policy.act(images, proprio, [instr] * len(live), cfg.actor.temperature, generator=gen)
            actions = policy.decode_actions(tokens)
            still = []
            for b, i in enumerate(live):
                for s in range(actions.shape[1]):
                    obs[i], done, _ = envs[i].step(actions[b, s])
                    steps += 1
                    if done:
                        break
                else:
                    still.append(i)
            live = still
        return steps

    group(0)
    barrier.wait()
    t0, c0, steps, k = time.perf_counter(), time.process_time(), 0, 1
    while time.perf_counter() - t0 < duration:
        steps += group(k)
        k += 1
    out.put((steps / (time.perf_counter() - t0), steps / max(time.process_time() - c0, 1e-9)))


def bare(n: int, duration: float, overrides: list[str]) -> list[tuple[float, float]]:
    """(env steps per wall second, per CPU second) of each of ``n`` concurrent bare-loop processes."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_bare_worker, args=(overrides, i, duration, barrier, out)) for i in range(n)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=duration + 300) for _ in procs]
    for p in procs:
        p.join(30)
    return rates


class Drainer:
    """Grants every request and decodes + drops every trajectory, recording (time, actor, env steps)."""

    def __init__(self) -> None:
        from async_vla.transport import ControlServer, TrajectoryReceiver

        self.control = ControlServer("tcp://127.0.0.1:0")
        self.receiver = TrajectoryReceiver("tcp://127.0.0.1:0", max_bytes=256 * 1024**2)
        self.events: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.counter = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from async_vla.messages import AdmissionGrant, GrantRequest, Trajectory

        while not self.stop.is_set():
            got = self.control.recv(0.0)
            while got is not None:
                peer, msg = got
                if isinstance(msg, GrantRequest):
                    ids = [f"bench-g{self.counter + i}" for i in range(msg.want)]
                    self.counter += msg.want
                    self.control.reply(peer, AdmissionGrant(actor_id=msg.actor_id, group_ids=ids))
                got = self.control.recv(0.0)
            msg = self.receiver.recv(0.002)
            if isinstance(msg, Trajectory):
                self.events.append((time.monotonic(), msg.actor_id, msg.env_steps))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.control.close()
        self.receiver.close()


def through_actors(n: int, duration: float, overrides: list[str]) -> list[tuple[float, float]]:
    """Start ``n`` real actor processes against a Drainer; (env steps per wall second, per CPU second of the
    actor process) for each, over a common window."""
    import psutil

    from async_vla.config import load_config, write_resolved

    drainer = Drainer()
    with tempfile.TemporaryDirectory(prefix="bench-actors-") as tmp:
        cfg = load_config(None, overrides)
        cfg_file = write_resolved(cfg, Path(tmp))
        g = min(cfg.env.envs_per_actor, cfg.actor.group_size)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        connect = f"{drainer.receiver.endpoint},{drainer.control.endpoint}"
        procs = [subprocess.Popen([sys.executable, "-m", "actors", "--actor-id", str(i), "--config", str(cfg_file),
                                   "--run-dir", tmp, "--connect", connect], env=env, cwd=str(REPO),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for i in range(n)]
        try:
            deadline = time.monotonic() + 300
            # warm-up: every actor has delivered a whole group
            while any(sum(1 for _, a, _ in drainer.events if a == i) < g for i in range(n)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    errs = [p.stderr.read().decode()[-2000:] for p in procs if p.poll() is not None]
                    raise RuntimeError(f"actors did not warm up: {errs}")
                time.sleep(0.05)
            ps = [psutil.Process(p.pid) for p in procs]
            cpu0 = [sum(q.cpu_times()[:2]) for q in ps]
            t0 = time.monotonic()
            time.sleep(duration)
            t1 = time.monotonic()
            cpu = [sum(q.cpu_times()[:2]) - c for q, c in zip(ps, cpu0)]
            steps = [sum(s for t, a, s in drainer.events if a == i and t0 <= t < t1) for i in range(n)]
            rates = [(st / (t1 - t0), st / max(c, 1e-9)) for st, c in zip(steps, cpu)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            drainer.close()
    return rates


def _table(rows: list[list]) -> str:
    head = ["processes", "bare steps/s (wall)", "actors steps/s (wall)", "actor / bare (wall)",
            "bare steps/CPU-s", "actor steps/CPU-s", "actor / bare (CPU)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def run(quick: bool = False) -> dict:
    """Bare vs actor env steps/s for 1 and 2 processes (interleaved repeats; medians reported).

    Wall-clock steps/s is the figure that matters on a quiet machine; steps per CPU-second of the rollout
    process(es) is reported beside it because it is what the actor machinery costs, whatever else the
    host is running (on a shared 2-core host the wall figure swings with other load).
    """
    import psutil

    duration, repeats = (5.0, 1) if quick else (10.0, 3)
    overrides = list(OVERRIDES)
    results: dict = {"duration_s": duration, "repeats": repeats, "overrides": overrides,
                     "note": "built-in task, default tiny policy, G=8 envs per process, 1 torch thread each",
                     "load_avg_before": os.getloadavg()[0], "cpus": psutil.cpu_count()}
    rows = []
    for n in (1, 2):
        runs: dict[str, list] = {"bare_wall": [], "bare_cpu": [], "actor_wall": [], "actor_cpu": []}
        for _ in range(repeats):  # interleaved so load changes hit both modes alike
            for mode, fn in (("bare", bare), ("actor", through_actors)):
                per_proc = fn(n, duration, overrides)
                runs[f"{mode}_wall"].append(sum(w for w, _ in per_proc))
                runs[f"{mode}_cpu"].append(statistics.mean(c for _, c in per_proc))
        med = {k: statistics.median(v) for k, v in runs.items()}
        wall_ratio = med["actor_wall"] / med["bare_wall"] if med["bare_wall"] else 0.0
        cpu_ratio = med["actor_cpu"] / med["bare_cpu"] if med["bare_cpu"] else 0.0
        results[f"{n}_process"] = {"bare_steps_per_s": med["bare_wall"], "actor_steps_per_s": med["actor_wall"],
                                   "ratio_wall": wall_ratio, "bare_steps_per_cpu_s": med["bare_cpu"],
                                   "actor_steps_per_cpu_s": med["actor_cpu"], "ratio_cpu": cpu_ratio,
                                   "runs": runs, "goal_met_wall": wall_ratio >= 0.9, "goal_met_cpu": cpu_ratio >= 0.9}
        rows.append([n, f"{med['bare_wall']:.0f}", f"{med['actor_wall']:.0f}", f"{wall_ratio:.1%}",
                     f"{med['bare_cpu']:.0f}", f"{med['actor_cpu']:.0f}", f"{cpu_ratio:.1%}"])
    results["load_avg_after"] = os.getloadavg()[0]
    md = _table(rows) + (
        f"\n\nGoal: actor >= 90% of bare. Wall = env steps/s summed over processes; CPU = env steps per CPU-second "
        f"of one rollout process. {duration:.0f} s windows after warm-up, median of {repeats} interleaved run(s); "
        f"through actors = real `python -m actors` processes streaming every trajectory over loopback TCP to a "
        f"draining receiver. Host: {results['cpus']} CPUs, load average {results['load_avg_before']:.1f} before / "
        f"{results['load_avg_after']:.1f} after.")
    return {"section": "actors", "results": results, "markdown": md}


if __name__ == "__main__":
    import json

    rep = run(quick="--quick" in sys.argv)
    print(rep["markdown"])
    print(json.dumps(rep["results"], indent=1))
