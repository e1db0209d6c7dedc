"""Benchmark "buffer": cost per trajectory to receive, decode, assemble and emit (issue goal: <= 5% of a step).

Two measurements per trajectory size, in one run:
  * service: a producer process PUSHes N trajectories over tcp loopback, a learner process requests batches
    (B groups of G) over the batch channel; the BufferService runs in this process's main thread and this
    process's CPU time (process_time: the main thread *and* ZeroMQ's I/O thread, which does the socket reads
    and writes) is the buffer's cost (receive + decode + validate + assemble + filter + bundle reply). Producer
    and learner run in their own (spawned) processes so their work is not counted (they still share cores);
  * in-process stages, no sockets: decode(frames), GroupBuffer.add, take_batch + encode_bundle.
Sizes: "small" 4 policy calls x 32x32x3 images x 56 tokens per call (the built-in task), and "libero"
64 calls x 128x128x3 (a LIBERO episode). Per batch = B*G trajectories at the default B = 4, G = 8.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from typing import Optional

import numpy as np

from async_vla.config import BufferConfig, Config, RunConfig
from async_vla.messages import BatchRequest, Trajectory, decode, encode, encode_bundle

RUN = "bench"
G = 8
GOAL_FRACTION = 0.05


def make_trajectory(calls: int, image: int, tokens: int = 56, proprio: int = 8) -> Trajectory:
    """A realistic-size trajectory template (random pixels and tokens, valid log-probs)."""
    rng = np.random.default_rng(0)
    return Trajectory(
        run_id=RUN, actor_id=0, group_id="g", traj_id="t", task_id=0, init_state_id=0, instruction="pick up the cup",
        behaviour_version=0, success=True, reward=1.0, env_steps=calls * 8, t_start=0.0, t_end=1.0, group_size=G,
        chunk_versions=np.zeros(calls, np.int64),
        images=rng.integers(0, 256, (calls, image, image, 3), dtype=np.uint8),
        proprio=rng.standard_normal((calls, proprio)).astype(np.float32),
        action_tokens=rng.integers(31744, 32000, (calls, tokens)).astype(np.int64),
        behav_logprobs=-rng.random((calls, tokens), dtype=np.float32),
        token_mask=np.ones((calls, tokens), bool))


def member(template: Trajectory, k: int, gids: list[str]) -> Trajectory:
    """Trajectory k of the stream: of granted group gids[k // G], mixed outcomes (so every group is admitted)."""
    return dataclasses.replace(template, group_id=gids[k // G], traj_id=f"t{k}", success=k % 2 == 0)


def _grants(grant, groups: int) -> list[str]:
    """``groups`` group ids for actor 0, from ``grant(want)`` (at most MAX_WANT a call)."""
    from async_vla.buffer.group_buffer import MAX_WANT

    ids: list[str] = []
    while len(ids) < groups:
        got = grant(min(MAX_WANT, groups - len(ids)))
        if not got:
            raise RuntimeError("the buffer granted nothing")
        ids += got
    return ids


def _config(B: int) -> Config:
    # Pacing off (the producer's groups are granted up front) and staleness unbounded: the stream must all be
    # emitted.
    return Config(run=RunConfig(name=RUN), buffer=BufferConfig(groups_per_batch=B, pacing=False,
                                                              max_staleness=10**9, max_staleness_limit=10**9,
                                                              max_bytes=512 * 1024**2, max_groups_per_actor=10**6,
                                                              reclaim_after_s=10**6))


def _produce(endpoint: str, n: int, calls: int, image: int, release, gids: list[str]) -> None:
    from async_vla.transport import TrajectorySender

    template = make_trajectory(calls, image)
    sender = TrajectorySender(endpoint, hwm=64)
    for k in range(n):
        sender.send(member(template, k, gids))
    release.wait(600)  # queued frames die with the socket (short linger): close only once all were consumed
    sender.close()


def _consume(endpoint: str, batches: int, run_dir: str) -> None:
    from async_vla.learner_secret import SECRET_FILE, learner_secret, sign
    from async_vla.transport import ControlClient

    secret = learner_secret(f"{run_dir}/{SECRET_FILE}")

    client = ControlClient(endpoint)
    version = 0
    while version < batches:
        client.send(sign(secret, BatchRequest(rank=0, world=1, version=version, timeout_s=30.0)))
        reply = client.recv_bundle(60.0)
        if reply is None:
            raise RuntimeError("no reply from the buffer")
        if reply[0].ready:
            version += 1
    client.close()


def service_cost(n: int, calls: int, image: int, B: int = 4) -> dict:
    """Run producer and learner processes against a BufferService in this thread; buffer CPU per trajectory."""
    import tempfile

    from async_vla.buffer.service import BufferService, keep_trajectory_memory

    keep_trajectory_memory()   # as bin/buffer does: this process hosts the buffer
    batches = n // (B * G)
    ctx = mp.get_context("spawn")  # never fork a process that holds ZeroMQ sockets
    with tempfile.TemporaryDirectory() as run_dir:
        svc = BufferService(_config(B), run_dir, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        from async_vla.learner_secret import ACTOR_SECRET_FILE, actor_secret, as_actor
        from async_vla.messages import GrantRequest
        from async_vla.transport import ControlClient

        client = ControlClient(svc.control_endpoint)
        secret = actor_secret(f"{run_dir}/{ACTOR_SECRET_FILE}")

        def grant(want: int) -> list[str]:
            client.send(as_actor(secret, GrantRequest(actor_id=0, want=want)))
            while (reply := client.recv(0.0)) is None:
                svc.step(wait_s=0.005)
            return reply.group_ids

        gids = _grants(grant, -(-n // G))
        client.close()
        release = ctx.Event()
        procs = [ctx.Process(target=_produce, args=(svc.trajectory_endpoint, n, calls, image, release, gids)),
                 ctx.Process(target=_consume, args=(svc.batch_endpoint, batches, run_dir))]
        for p in procs:
            p.start()
        cpu0, thread0 = time.process_time(), time.thread_time()
        first, deadline = None, time.monotonic() + 300
        while procs[1].is_alive() and time.monotonic() < deadline:
            svc.step(wait_s=0.005)
            if first is None and svc.buffer.received:
                first = time.monotonic()
        cpu, thread_cpu = time.process_time() - cpu0, time.thread_time() - thread0
        wall = time.monotonic() - (first or time.monotonic())
        release.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)
        received, trained = svc.buffer.received, svc.buffer.ledger["trained"]
        svc.close()
    if trained != batches * B * G:
        raise RuntimeError(f"benchmark lost data: trained {trained}, expected {batches * B * G}")
    return {"trajectories": received, "emitted": trained, "buffer_cpu_us_per_traj": 1e6 * cpu / received,
            "main_thread_cpu_us_per_traj": 1e6 * thread_cpu / received,
            "wall_us_per_traj": 1e6 * wall / received, "buffer_cpu_ms_per_batch": 1e3 * cpu / received * B * G}


def stage_costs(n: int, calls: int, image: int, B: int = 4) -> dict:
    """In-process µs per trajectory of decode, add (assemble + filter) and take_batch + encode_bundle."""
    from async_vla.buffer import GroupBuffer
    from async_vla.messages import BatchHeader

    template = make_trajectory(calls, image)
    n -= n % (B * G)
    buf = GroupBuffer.from_config(_config(B), RUN)
    gids = _grants(lambda want: buf.grant(0, want), n // G)
    frames = [[bytes(memoryview(f)) for f in encode(member(template, k, gids))] for k in range(n)]
    t0 = time.perf_counter()
    msgs = [decode(f) for f in frames]
    t1 = time.perf_counter()
    for m in msgs:
        buf.add(m)
    t2 = time.perf_counter()
    for v in range(n // (B * G)):
        bid, groups = buf.take_batch(v)
        encode_bundle(BatchHeader(bid, [len(g) for g in groups], v, True), [t for g in groups for t in g])
    t3 = time.perf_counter()
    return {"decode_us": 1e6 * (t1 - t0) / n, "add_us": 1e6 * (t2 - t1) / n, "emit_us": 1e6 * (t3 - t2) / n}


def run(quick: bool = False, learner_step_s: Optional[float] = None) -> dict:
    """Both sizes; ``learner_step_s`` (a measured learner step at the default batch) adds the 5% goal check."""
    sizes = {"small (4 calls x 32x32x3)": (4, 32, 2000 if quick else 10000),
             "libero (64 calls x 128x128x3)": (64, 128, 96 if quick else 320)}
    B = BufferConfig().groups_per_batch
    import os

    # The load average says how much the timings were shared with other work on the machine.
    results: dict = {"B": B, "G": G, "learner_step_s": learner_step_s, "loadavg_1m": os.getloadavg()[0],
                     "variants": {}}
    for name, (calls, image, n) in sizes.items():
        r = {"traj_bytes": make_trajectory(calls, image).nbytes, **stage_costs(min(n, 2000), calls, image, B),
             **service_cost(n, calls, image, B)}
        if learner_step_s:
            r["fraction_of_step"] = r["buffer_cpu_ms_per_batch"] / 1e3 / learner_step_s
            r["meets_goal"] = r["fraction_of_step"] <= GOAL_FRACTION
        results["variants"][name] = r
    lines = [f"Buffer cost per trajectory (B={B} groups x G={G} = {B * G} trajectories per batch)", "",
             "| size | KiB/traj | decode µs | add µs | emit µs | service CPU µs/traj | of which main thread | "
             "wall µs/traj | CPU ms/batch | % of step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["variants"].items():
        frac = f"{100 * r['fraction_of_step']:.2f}" if learner_step_s else "n/a"
        lines.append(f"| {name} | {r['traj_bytes'] / 1024:.0f} | {r['decode_us']:.1f} | {r['add_us']:.1f} | "
                     f"{r['emit_us']:.1f} | {r['buffer_cpu_us_per_traj']:.1f} | "
                     f"{r['main_thread_cpu_us_per_traj']:.1f} | {r['wall_us_per_traj']:.1f} | "
                     f"{r['buffer_cpu_ms_per_batch']:.2f} | {frac} |")
    lines += ["", "service CPU = the buffer process's CPU time (process_time: its main thread - decode, assemble, "
              "filter, bundle reply - and ZeroMQ's I/O thread - socket reads and writes) over trajectories received; "
              "the main thread's share alone is beside it; wall includes the producer's pace. Goal: <= 5% of a "
              "learner step.",
              f"Load average during the run: {results['loadavg_1m']:.1f} (timings on a shared machine run high)."]
    return {"section": "buffer", "results": results, "markdown": "\n".join(lines)}


if __name__ == "__main__":
    print(run(quick=True)["markdown"])
