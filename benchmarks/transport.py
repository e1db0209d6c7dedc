"""Transport benchmark: trajectories/s and MB/s over ipc:// and tcp:// loopback vs memcpy.

A sender process streams encoded trajectories through a real PUSH socket; the receiver (this process)
decodes and validates each one (the buffer's real work on arrival). Reported next to single-core memcpy
measured in the same run. Goal: >= 50% of memcpy for image-heavy (LIBERO-sized) trajectories.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time

import numpy as np

from benchmarks.common import md_table, memcpy_gbps

SIZES = {
    # name: (policy calls, image side, tokens per call)
    "builtin (4 calls, 32px)": (4, 32, 56),
    "libero (64 calls, 224px)": (64, 224, 56),
}


def make_trajectory(calls: int, side: int, tokens: int, seed: int = 0):
    from async_vla.messages import Trajectory

    rng = np.random.default_rng(seed)
    return Trajectory(
        run_id="bench", actor_id=0, group_id="g0", traj_id=f"t{seed}", task_id=0, init_state_id=0,
        instruction="put the red block on the green pad", behaviour_version=0, success=True, reward=1.0,
        env_steps=calls * 8, t_start=0.0, t_end=1.0, group_size=8,
        chunk_versions=np.zeros(calls, np.int64),
        images=rng.integers(0, 255, (calls, side, side, 3), dtype=np.uint8),
        proprio=rng.standard_normal((calls, 8)).astype(np.float32),
        action_tokens=rng.integers(31744, 32000, (calls, tokens)).astype(np.int64),
        behav_logprobs=-rng.random((calls, tokens)).astype(np.float32),
        token_mask=np.ones((calls, tokens), bool),
    )


def _sender(endpoint: str, calls: int, side: int, tokens: int, count: int) -> None:
    from async_vla.messages import encode
    from async_vla.transport import TrajectorySender

    sender = TrajectorySender(endpoint, hwm=16)
    frames = encode(make_trajectory(calls, side, tokens))
    for _ in range(count):
        sender.send_frames(frames)
    sender.close()


def measure(endpoint: str, calls: int, side: int, tokens: int, count: int) -> dict:
    from async_vla.messages import Trajectory
    from async_vla.transport import TrajectoryReceiver

    recv = TrajectoryReceiver(endpoint, hwm=16, max_bytes=256 * 1024**2)
    proc = mp.get_context("spawn").Process(target=_sender, args=(recv.endpoint, calls, side, tokens, count))
    proc.start()
    first = recv.recv(timeout_s=60)  # exclude process start-up from the timing
    assert isinstance(first, Trajectory)
    nbytes = first.nbytes
    t0 = time.perf_counter()
    got = 1
    while got < count:
        msg = recv.recv(timeout_s=30)
        if msg is None:
            break
        got += 1
    dt = time.perf_counter() - t0
    proc.join(30)
    recv.close()
    n = got - 1
    return {"trajectories": n, "bytes_per_trajectory": nbytes, "traj_per_s": n / dt, "mb_per_s": n * nbytes / dt / 1e6,
            "malformed": recv.malformed.total}


def run(quick: bool = False) -> dict:
    memcpy = memcpy_gbps()
    results = {"memcpy_gbps": memcpy, "cases": []}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (calls, side, tokens) in SIZES.items():
            per = calls * side * side * 3
            count = max(20, min(2000, int((200 if quick else 1500) * 1024**2 / per)))
            for scheme, ep in (("ipc", f"ipc://{tmp}/bench-{calls}"), ("tcp", "tcp://127.0.0.1:0")):
                r = measure(ep, calls, side, tokens, count)
                r.update(case=name, transport=scheme, frac_of_memcpy=r["mb_per_s"] / 1e3 / memcpy)
                results["cases"].append(r)
                rows.append([name, scheme, r["trajectories"], r["bytes_per_trajectory"] / 1e6, r["traj_per_s"],
                             r["mb_per_s"], f"{100 * r['frac_of_memcpy']:.0f}%"])
    md = (f"Single-core memcpy in the same run: {memcpy:.2f} GB/s. Receiver decodes and validates every message.\n\n"
          + md_table(["trajectory", "transport", "n", "MB each", "traj/s", "MB/s", "of memcpy"], rows))
    return {"section": "transport", "results": results, "markdown": md}
