"""Hostile input for the buffer's sockets: ``hostile_frames(rng, run_id)`` gives one multipart message and the
kind of damage done to it (``KINDS``), from a template trajectory of *another* run, so every frame sent adds exactly
one malformed entry to the ledger. Messages above ``transport.max_message_mb``: ``send_oversize``."""

from __future__ import annotations

import time
from typing import Callable, Optional

import msgpack
import numpy as np
import zmq

from async_vla import messages as M
from async_vla.learner_secret import as_actor

KINDS = ("random_bytes", "truncated", "bit_flip", "frame_count", "oversize_header", "schema_version", "unknown_kind",
         "dtype", "shape_lie", "huge_shape", "nan_logprob", "inf_logprob", "positive_logprob", "negative_version",
         "type", "unknown_field", "missing_field", "unknown_task", "wrong_run", "not_trajectory", "msgpack_bomb")


def template(run_id: str = "not-this-run", task_id: int = 0, calls: int = 2, side: int = 16,
             seed: int = 0) -> M.Trajectory:
    """A well-formed trajectory (actor 0, group "fuzz-g") to damage or to copy."""
    rng = np.random.default_rng(seed)
    tokens = 56
    return M.Trajectory(
        run_id=run_id, actor_id=0, group_id="fuzz-g", traj_id=f"fuzz-{seed}", task_id=task_id, init_state_id=0,
        instruction="pick up the red block", behaviour_version=0, success=True, reward=1.0, env_steps=8 * calls,
        t_start=0.0, t_end=1.0, group_size=4, chunk_versions=np.zeros(calls, np.int64),
        images=rng.integers(0, 255, (calls, side, side, 3), dtype=np.uint8),
        proprio=rng.standard_normal((calls, 8)).astype(np.float32),
        action_tokens=rng.integers(31744, 32000, (calls, tokens)).astype(np.int64),
        behav_logprobs=-rng.random((calls, tokens)).astype(np.float32), token_mask=np.ones((calls, tokens), bool))


def _frames(msg: M.Message) -> list[bytes]:
    return [bytes(f) for f in M.encode(msg)]


def _reheader(frames: list[bytes], edit: Callable[[dict], None]) -> list[bytes]:
    h = msgpack.unpackb(frames[0])
    edit(h)
    return [msgpack.packb(h)] + frames[1:]


def hostile_frames(rng: np.random.Generator, base: M.Trajectory, run_id: str) -> tuple[str, list[bytes]]:
    """(kind, frames) of one hostile message built from ``base`` (a trajectory of another run); unknown-task
    frames carry the live ``run_id`` (so "unknown_task", not "wrong_run", is what catches them)."""
    kind = KINDS[int(rng.integers(0, len(KINDS)))]
    frames = _frames(base)
    if kind == "random_bytes":
        return kind, [rng.bytes(int(rng.integers(0, 512))) for _ in range(int(rng.integers(1, 5)))]
    if kind == "truncated":
        i = int(rng.integers(0, len(frames)))
        frames[i] = frames[i][: int(rng.integers(0, max(1, len(frames[i]))))]
        return kind, frames
    if kind == "bit_flip":
        head = bytearray(frames[0])
        j = int(rng.integers(0, len(head)))
        head[j] ^= 1 << int(rng.integers(0, 8))
        return kind, [bytes(head)] + frames[1:]
    if kind == "frame_count":
        return kind, frames[:-1] if rng.random() < 0.5 else frames + [b"x" * 8]
    if kind == "oversize_header":
        return kind, [b"\x81" + msgpack.packb("v") + msgpack.packb("x" * (M.MAX_HEADER_BYTES + 10))]
    if kind == "msgpack_bomb":  # array32 header claiming 2**31 - 1 elements, 5 bytes long
        return kind, [b"\xdd\x7f\xff\xff\xff" + b"\x00" * 16]
    if kind in ("nan_logprob", "inf_logprob", "positive_logprob"):
        t = template(base.run_id, base.task_id, seed=int(rng.integers(0, 1000)))
        t.behav_logprobs[0, int(rng.integers(0, 56))] = {"nan_logprob": np.nan, "inf_logprob": -np.inf,
                                                         "positive_logprob": 3.0}[kind]
        return kind, _frames(t)
    if kind == "unknown_task":
        return kind, _frames(template(run_id, task_id=10_000 + int(rng.integers(0, 99))))
    if kind == "wrong_run":
        return kind, _frames(base)
    if kind == "not_trajectory":
        return kind, _frames(M.Heartbeat(actor_id=int(rng.integers(0, 100)), pid=1))
    edits: dict[str, Callable[[dict], None]] = {
        "schema_version": lambda h: h.__setitem__("v", int(rng.integers(2, 1000))),
        "unknown_kind": lambda h: h.__setitem__("k", "pickle"),
        "dtype": lambda h: h["a"][1].__setitem__(1, str(rng.choice(["float64", "object", "<U8", "complex64"]))),
        "shape_lie": lambda h: h["a"][1].__setitem__(2, [2, 16, 16, 4]),
        "huge_shape": lambda h: h["a"][1].__setitem__(2, [2**30, 2**30, 2**30, 3]),
        "negative_version": lambda h: h["f"].__setitem__("behaviour_version", -int(rng.integers(1, 10**6))),
        "type": lambda h: h["f"].__setitem__("task_id", "zero"),
        "unknown_field": lambda h: h["f"].__setitem__("__reduce__", "os.system"),
        "missing_field": lambda h: h["f"].pop("traj_id"),
    }
    return kind, _reheader(frames, edits[kind])


def _sender(ctx, socket_type: int, endpoint: str, curve_keys, hwm: int):
    """A connected sending socket whose queued messages still leave at close: a loaded buffer may take a while to
    read thousands of them, and the tests count every one."""
    from async_vla.transport import secure_client

    sock = ctx.socket(socket_type)
    sock.sndhwm = hwm
    sock.linger = 120_000
    secure_client(sock, curve_keys)
    sock.connect(endpoint)
    return sock


def fuzz(endpoint: str, n: int, run_id: str, seed: int = 0, curve_keys=None, hwm: int = 1000,
         until: Optional[Callable[[], bool]] = None, hold_s: float = 120.0) -> dict[str, int]:
    """Send ``n`` hostile messages to a trajectory endpoint; returns how many of each kind were sent. ``until``: a check
    polled before the socket closes, for at most ``hold_s`` (closing at once can lose the last frames the receiver had
    read but not queued)."""
    rng = np.random.default_rng(seed)
    base = template(run_id="not-" + run_id)
    ctx = zmq.Context()
    sock = _sender(ctx, zmq.PUSH, endpoint, curve_keys, hwm)
    sent: dict[str, int] = {}
    try:
        for _ in range(n):
            kind, frames = hostile_frames(rng, base, run_id)
            sock.send_multipart(frames)  # blocks (back-pressure) rather than drop: every frame must arrive
            sent[kind] = sent.get(kind, 0) + 1
        deadline = time.monotonic() + hold_s
        while until is not None and not until() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sock.close()   # linger: queued frames still leave
        ctx.term()
    return sent


def send_oversize(endpoint: str, nbytes: int, count: int = 3, curve_keys=None) -> int:
    """``count`` messages of ``nbytes`` each, every one from a fresh socket (ZeroMQ disconnects the sender)."""
    from async_vla.transport import secure_client

    ctx = zmq.Context()
    blob = b"\x00" * nbytes
    for _ in range(count):
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 2000
        secure_client(sock, curve_keys)
        sock.connect(endpoint)
        sock.send_multipart([blob])
        time.sleep(0.5)
        sock.close()
    ctx.term()
    return count


# ------------------------------------------------------------------------------------------ control channel
CONTROL_KINDS = ("eta_huge", "eta_negative", "eta_type", "eta_in_bounds", "grant_huge", "grant_zero",
                 "grant_negative", "grant_many_actors", "batch_bad_world", "batch_bad_rank", "batch_long_park",
                 "batch_forged_learner", "heartbeat_forged", "stats_forged", "unknown_command", "garbage")


def forged_control(rng: np.random.Generator, run_id: str, eta_limit: int,
                   actor_secret: Optional[bytes] = None) -> tuple[str, list[bytes]]:
    """(kind, frames) of one forged control message: it decodes, but is out of bounds or pretends to be someone else
    ("garbage": random bytes). No batch request or eta change carries a valid learner credential: the buffer must
    refuse each before it looks at its fields. With ``actor_secret`` (the run's) grant requests, heartbeats and stats
    carry a valid actor token (an insider whose made-up ids and wants must still stay within the bounds); without
    it each is refused for the missing credential."""
    kind = CONTROL_KINDS[int(rng.integers(0, len(CONTROL_KINDS)))]
    actor = int(rng.integers(0, 10**9))
    msg: M.Message
    if kind == "eta_huge":
        msg = M.ControlCommand("set_max_staleness", int(eta_limit + 1 + rng.integers(0, 10**9)))
    elif kind == "eta_negative":
        msg = M.ControlCommand("set_max_staleness", -int(rng.integers(1, 10**6)))
    elif kind == "eta_in_bounds":     # a value the limit allows: only the missing learner credential stops it
        msg = M.ControlCommand("set_max_staleness", int(rng.integers(0, eta_limit + 1)))
    elif kind == "eta_type":
        msg = M.ControlCommand("set_max_staleness", str(rng.choice(["4", "1e9", "nan", ""])))
    elif kind == "grant_huge":
        msg = M.GrantRequest(actor_id=int(rng.integers(0, 8)), want=int(rng.integers(5, 10**6)))
    elif kind == "grant_zero":
        msg = M.GrantRequest(actor_id=actor, want=0)
    elif kind == "grant_negative":
        msg = M.GrantRequest(actor_id=actor, want=-int(rng.integers(1, 10**6)))
    elif kind == "grant_many_actors":
        msg = M.GrantRequest(actor_id=actor, want=int(rng.integers(1, 100)), policy_version=0)
    elif kind == "batch_bad_world":
        msg = M.BatchRequest(rank=0, world=int(rng.choice([0, -1, 7, 10**6])), version=0, timeout_s=1.0)
    elif kind == "batch_bad_rank":
        msg = M.BatchRequest(rank=int(rng.choice([-1, 5, 10**6])), world=1, version=0, timeout_s=1.0)
    elif kind == "batch_long_park":
        msg = M.BatchRequest(rank=0, world=1, version=0, timeout_s=float(rng.choice([1e9, 600.0, -5.0])))
    elif kind == "batch_forged_learner":
        lineage = M.Lineage(rng.bytes(8).hex(), (M.PolicyTag(M.ROOT, 0),)).encode()
        msg = M.BatchRequest(rank=0, world=1, version=int(rng.integers(1, 10**6)), timeout_s=0.0, lineage=lineage,
                             auth=rng.bytes(32).hex())
    elif kind == "heartbeat_forged":
        msg = M.Heartbeat(actor_id=actor, pid=1, policy_version=int(rng.integers(0, 10**6)))
    elif kind == "stats_forged":
        tasks = {str(k): 1 for k in rng.integers(0, 10**6, int(rng.integers(1, 2000)))}
        msg = M.ActorStats(actor_id=actor, interval_s=1e-9, env_steps=10**12, episodes_by_task=tasks,
                           successes_by_task=tasks)
    elif kind == "unknown_command":
        msg = M.ControlCommand("".join(map(chr, rng.integers(97, 123, 20))), None)
    else:
        return kind, [rng.bytes(int(rng.integers(1, 300))) for _ in range(int(rng.integers(1, 4)))]
    if actor_secret is not None and isinstance(msg, (M.GrantRequest, M.Heartbeat, M.ActorStats)):
        msg = as_actor(actor_secret, msg)
    return kind, _frames(msg)


def forge_control(endpoint: str, batch_endpoint: str, n: int, run_id: str, eta_limit: int, seed: int = 0,
                  curve_keys=None, actor_secret: Optional[bytes] = None) -> dict[str, int]:
    """Send ``n`` forged control messages, the batch requests to ``batch_endpoint`` (where the learner's go) and
    the rest to ``endpoint``, one DEALER each (replies are read and dropped as they come, so the buffer's replies
    never back up); returns how many of each kind were sent."""
    rng = np.random.default_rng(seed)
    ctx = zmq.Context()
    socks = {}
    for name, ep in (("control", endpoint), ("batch", batch_endpoint)):
        socks[name] = _sender(ctx, zmq.DEALER, ep, curve_keys, 100_000)
        socks[name].rcvhwm = 100_000
    sent: dict[str, int] = {}
    try:
        for _ in range(n):
            kind, frames = forged_control(rng, run_id, eta_limit, actor_secret)
            socks["batch" if kind.startswith("batch_") else "control"].send_multipart(frames)
            sent[kind] = sent.get(kind, 0) + 1
            for sock in socks.values():
                while sock.poll(0, zmq.POLLIN):
                    sock.recv_multipart()
    finally:
        for sock in socks.values():
            sock.close()
        ctx.term()
    return sent
