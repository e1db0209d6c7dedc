"""Benchmark "scale": one live ``bin/buffer`` under SimpleVLA-RL-shaped traffic from N actor connections.

N simulated actors (N = 16 / 64 / 256 ZeroMQ PUSH connections, spread over a few producer processes) replay
LIBERO-sized trajectories (224 px, 28 policy calls: ~4 MiB, LIBERO-spatial's step limit) as fast as the buffer
takes them; 8 rank clients (one process each, ``BatchClient`` as a learner rank uses it) fetch batches of B groups
of G = 8; a prober asks for grants every 0.2 s. Measured per N: ingest (trajectories/s, MB/s, over the window
after the first batch), batch latency per rank (first batch, then steady), grant latency, the buffer process's
peak memory against its bound (buffer.max_bytes + N x (transport.trajectory_hwm + 1) trajectories; the buffer
reports both itself: buffer/rss_bytes, buffer/memory_bound_bytes), and the
buffer's CPU per trajectory. The batch is smaller than SimpleVLA-RL's 64 groups (``--quick``: 8) so that every
process together stays within ~6 GB on a shared machine; the per-trajectory costs do not depend on B.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

import yaml

from benchmarks.buffer import RUN, G, make_trajectory

REPO = Path(__file__).resolve().parent.parent
CALLS, IMAGE = 28, 224          # LIBERO-spatial: 220 steps / 8 per call, 224 px
RANKS = 8
PRODUCER_PROCS = 4


def _config(run_dir: Path, B: int, traj_bytes: int, hwm: int) -> dict:
    from async_vla.hosts import free_port

    return {
        "run": {"name": RUN},
        "env": {"image_size": IMAGE, "max_steps": CALLS * 8},
        # Pacing on, eta 1: at most (eta + v + 1) B groups started and not yet trained, so the buffer holds
        # about 3 batches whatever N is; max_bytes leaves it that room.
        "buffer": {"groups_per_batch": B, "max_staleness": 1, "dynamic_sampling": False,
                   "max_bytes": int(3.5 * B * G * traj_bytes), "ledger_every_s": 5.0, "group_timeout_s": 600.0},
        "learner": {"num_ranks": RANKS, "batch_timeout_s": 60.0},
        "transport": {"trajectory_port": free_port(), "control_port": free_port(), "batch_port": free_port(),
                      "trajectory_hwm": hwm},
        "logging": {"status_every_s": 5.0},
    }


def _produce(traj_ep: str, ctl_ep: str, conns: int, first_actor: int, stop, sent, run_dir: str) -> None:
    """``conns`` simulated actors, each with its own trajectory (PUSH) and control (DEALER) connection, as
    bin/actors has: ask for a grant, stream the granted group's G members, ask again. Pacing in the buffer bounds
    the groups in flight, as it does for real actors (without it every connection holds a partial group)."""
    import dataclasses

    from async_vla.learner_secret import ACTOR_SECRET_FILE, actor_secret, as_actor
    from async_vla.messages import AdmissionGrant, GrantRequest, encode
    from async_vla.transport import ControlClient, TrajectorySender

    secret = actor_secret(Path(run_dir) / ACTOR_SECRET_FILE)   # the run's actors' credential
    template = make_trajectory(CALLS, IMAGE)
    senders = [TrajectorySender(traj_ep, hwm=2) for _ in range(conns)]
    controls = [ControlClient(ctl_ep) for _ in range(conns)]
    groups: list[list[str]] = [[] for _ in range(conns)]
    member = [0] * conns
    asked = [0.0] * conns
    version, lineage = 0, ""
    while not stop.is_set():
        progressed = False
        now = time.monotonic()
        for c in range(conns):
            actor = first_actor + c
            while (reply := controls[c].recv(0)) is not None:
                if isinstance(reply, AdmissionGrant):
                    groups[c] += list(reply.group_ids)
                    version, lineage = max(version, reply.learner_version), reply.learner_lineage
                    asked[c] = now + (reply.retry_after_s if not reply.group_ids else 0)
            if not groups[c]:
                if now >= asked[c]:
                    controls[c].send(as_actor(secret, GrantRequest(actor_id=actor, want=1, policy_version=version,
                                                                   policy_lineage=lineage)))
                    asked[c] = now + 5.0   # re-ask if no reply comes
                continue
            k = member[c]
            traj = dataclasses.replace(template, group_id=groups[c][0], traj_id=f"{groups[c][0]}.{k}",
                                       success=k % 2 == 0, actor_id=actor, behaviour_version=version,
                                       chunk_versions=template.chunk_versions * 0 + version, lineage=lineage)
            if senders[c].send_frames(encode(traj), timeout_s=0):
                progressed = True
                with sent.get_lock():
                    sent.value += 1
                member[c] += 1
                if member[c] == G:
                    groups[c].pop(0)
                    member[c] = 0
                    asked[c] = 0.0
        if not progressed:
            time.sleep(0.002)
    for snd, ctl in zip(senders, controls):
        snd.close(flush_s=0)
        ctl.close()


def _rank(cfg_path: str, run_dir: str, rank: int, batches: int, out, lineage: str, step) -> None:
    from async_vla.buffer.client import BatchClient
    from async_vla.config import load_config
    from async_vla.messages import ROOT, Lineage

    cfg = load_config(cfg_path)
    client = BatchClient(cfg, Path(run_dir), rank, RANKS, lineage=Lineage(ROOT).descend(lineage, 0))
    lat = []
    for v in range(batches):
        # Ranks in lock-step, as a learner's are (its step all-reduces): once a rank asks for v + 1, a batch v
        # not formed yet is refused (a version older than the learner's).
        step.wait()
        t0 = time.monotonic()
        while client.poll(v) is None:
            pass
        lat.append(time.monotonic() - t0)
    client.close()
    out.put((rank, lat))


def _probe_grants(endpoint: str, stop, out, run_dir: str) -> None:
    from async_vla.learner_secret import ACTOR_SECRET_FILE, actor_secret, as_actor
    from async_vla.messages import GrantRequest
    from async_vla.transport import ControlClient, ControlTimeout

    probe = as_actor(actor_secret(Path(run_dir) / ACTOR_SECRET_FILE), GrantRequest(actor_id=99999, want=0))

    client = ControlClient(endpoint)
    lat = []
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            client.call(probe, timeout_s=30.0)
            lat.append(time.monotonic() - t0)
        except ControlTimeout:
            lat.append(30.0)
        time.sleep(0.2)
    client.close()
    out.put(lat)


def _proc_stat(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, RSS bytes, peak RSS bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return cpu, int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def one(n: int, B: int, batches: int, hwm: int) -> dict:
    from runner.commands import component_argv
    from runner.launch import buffer_stats

    traj = make_trajectory(CALLS, IMAGE).nbytes
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        cfg = _config(run_dir, B, traj, hwm)
        cfg_path = run_dir / "scale.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        log = open(run_dir / "buffer.log", "w")
        buf = subprocess.Popen(component_argv("buffer", str(cfg_path), str(run_dir)), stdout=log,
                               stderr=subprocess.STDOUT, env=env)
        t = cfg["transport"]
        traj_ep, ctl_ep = f"tcp://127.0.0.1:{t['trajectory_port']}", f"tcp://127.0.0.1:{t['control_port']}"
        try:
            while buffer_stats(ctl_ep, 0.5) is None:
                if buf.poll() is not None:
                    raise RuntimeError((run_dir / "buffer.log").read_text()[-2000:])
            base_cpu, _, _ = _proc_stat(buf.pid)
            stop, sent, q = ctx.Event(), ctx.Value("l", 0), ctx.Queue()
            per = [n // PRODUCER_PROCS + (i < n % PRODUCER_PROCS) for i in range(PRODUCER_PROCS)]
            producers = [ctx.Process(target=_produce, args=(traj_ep, ctl_ep, c, sum(per[:i]), stop, sent,
                                                            str(run_dir)))
                         for i, c in enumerate(per) if c]
            lineage = uuid.uuid4().hex   # the simulated ranks are one learner start
            step = ctx.Barrier(RANKS)
            ranks = [ctx.Process(target=_rank, args=(str(cfg_path), str(run_dir), r, batches, q, lineage, step))
                     for r in range(RANKS)]
            prober = ctx.Process(target=_probe_grants, args=(ctl_ep, stop, q, str(run_dir)))
            t_start = time.monotonic()
            for p in ranks + producers + [prober]:
                p.start()
            peak_rss, first_batch_at, received_at_first = 0, None, 0
            while any(p.is_alive() for p in ranks):
                _, rss, hwm_rss = _proc_stat(buf.pid)
                peak_rss = max(peak_rss, hwm_rss)
                if first_batch_at is None:
                    st = buffer_stats(ctl_ep, 2.0) or {}
                    if st.get("ledger", {}).get("trained", 0) >= B * G:
                        first_batch_at, received_at_first = time.monotonic(), st["received"]
                time.sleep(0.5)
            t_end = time.monotonic()
            st = buffer_stats(ctl_ep, 5.0) or {}
            cpu, _, hwm_rss = _proc_stat(buf.pid)
            peak_rss = max(peak_rss, hwm_rss)
            stop.set()
            lat = {}
            grants: list = []
            for _ in range(RANKS + 1):
                item = q.get(timeout=60)
                if isinstance(item, tuple):
                    lat[item[0]] = item[1]
                else:
                    grants = item
            for p in producers + [prober]:
                p.join(30)
                if p.is_alive():
                    p.terminate()
        finally:
            buf.terminate()
            buf.wait(60)
            log.close()
    received = st.get("received", 0)
    reported = st.get("metrics", {})   # the buffer's own view (TensorBoard buffer/*), producers still connected
    window = t_end - (first_batch_at or t_start)
    steady = [x for r in lat.values() for x in r[1:]]
    bound = cfg["buffer"]["max_bytes"] + n * (hwm + 1) * traj
    grants_sorted = sorted(grants) or [float("nan")]
    return {
        "N": n, "B": B, "trajectory_hwm": hwm, "traj_bytes": traj, "received": received,
        "ingest_traj_s": (received - received_at_first) / window if window > 0 else float("nan"),
        "ingest_mb_s": (received - received_at_first) * traj / 1e6 / window if window > 0 else float("nan"),
        "first_batch_s": max(r[0] for r in lat.values()) if lat else float("nan"),
        "steady_batch_s_median": sorted(steady)[len(steady) // 2] if steady else float("nan"),
        "steady_batch_s_max": max(steady) if steady else float("nan"),
        "grant_ms_median": 1e3 * grants_sorted[len(grants_sorted) // 2],
        "grant_ms_max": 1e3 * grants_sorted[-1],
        "peak_rss_gb": peak_rss / 1e9, "bound_gb": bound / 1e9, "max_bytes_gb": cfg["buffer"]["max_bytes"] / 1e9,
        "reported_rss_gb": reported.get("buffer/rss_bytes", float("nan")) / 1e9,
        "reported_bound_gb": reported.get("buffer/memory_bound_bytes", float("nan")) / 1e9,
        "reported_connections": reported.get("buffer/trajectory_connections", float("nan")),
        "cpu_ms_per_traj": 1e3 * (cpu - base_cpu) / received if received else float("nan"),
        "wall_s": t_end - t_start, "loadavg_1m": os.getloadavg()[0],
    }


def run(quick: bool = False, ns: Optional[list[int]] = None) -> dict:
    B = 8 if quick else 16
    batches = 3 if quick else 5
    ns = ns or ([16, 64] if quick else [16, 64, 256])
    rows = [one(n, B, batches, hwm=1 if n >= 256 else 4) for n in ns]
    lines = [f"One bin/buffer, LIBERO-sized trajectories ({CALLS} calls x {IMAGE} px, "
             f"{rows[0]['traj_bytes'] / 2**20:.1f} MiB), {RANKS} rank clients, B={B} groups x G={G} per batch "
             f"({batches} batches), pacing on (eta 1)", "",
             "| N | traj/s | MB/s | first batch s | steady batch s (median / max) | grant ms (median / max) | "
             "peak RSS GB | bound GB (max_bytes + N x (hwm+1) traj) | buffer's own RSS / bound GB (connections) | "
             "CPU ms/traj | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['N']} | {r['ingest_traj_s']:.0f} | {r['ingest_mb_s']:.0f} | {r['first_batch_s']:.1f} | "
                     f"{r['steady_batch_s_median']:.2f} / {r['steady_batch_s_max']:.2f} | "
                     f"{r['grant_ms_median']:.0f} / {r['grant_ms_max']:.0f} | {r['peak_rss_gb']:.2f} | "
                     f"{r['bound_gb']:.2f} (hwm {r['trajectory_hwm']}) | {r['reported_rss_gb']:.2f} / "
                     f"{r['reported_bound_gb']:.2f} ({r['reported_connections']:.0f}) | {r['cpu_ms_per_traj']:.2f} | "
                     f"{r['loadavg_1m']:.0f} |")
    lines += ["", "Measured on a shared 2-core machine (load = 1-minute load average during the run): absolute "
              "rates are what was left over, not what the buffer can do alone. The buffer's own RSS and bound are "
              "its metrics buffer/rss_bytes and buffer/memory_bound_bytes at the end of the run (its connections "
              "counted by ZeroMQ's socket monitor)."]
    return {"section": "scale", "results": rows, "markdown": "\n".join(lines)}


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(json.dumps(run(quick=True, ns=args or None)["results"], indent=1))
