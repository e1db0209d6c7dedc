"""Transport: real ZeroMQ sockets on loopback, the in-process twin, and a 10,000-frame fuzz of a live receiver."""

import threading
import time

import numpy as np
import pytest
import zmq

from async_vla import messages as M
from async_vla.transport import (
    ControlClient,
    ControlServer,
    LocalPipe,
    TrajectoryReceiver,
    TrajectorySender,
    endpoints,
)
from async_vla.config import load_config
from tests.test_messages import make_traj, mutate


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_trajectories_cross_a_real_socket(tmp_path, scheme):
    ep = "tcp://127.0.0.1:0" if scheme == "tcp" else f"ipc://{tmp_path}/t"
    recv = TrajectoryReceiver(ep)
    send = TrajectorySender(recv.endpoint)
    for i in range(5):
        assert send.send(make_traj(seed=i), timeout_s=5)
    got = [recv.recv(timeout_s=5) for _ in range(5)]
    assert [g.traj_id for g in got] == [f"t{i}" for i in range(5)]
    send.close()
    recv.close()


def test_control_round_trip_and_bundle():
    server = ControlServer("tcp://127.0.0.1:0")
    client = ControlClient(server.endpoint, identity=b"actor-3")
    client.send(M.GrantRequest(actor_id=3, want=2))
    peer, msg = server.recv(timeout_s=5)
    assert peer == b"actor-3" and isinstance(msg, M.GrantRequest) and msg.want == 2
    server.reply(peer, M.AdmissionGrant(actor_id=3, group_ids=["g1", "g2"]))
    assert client.recv(timeout_s=5).group_ids == ["g1", "g2"]
    server.reply_bundle(peer, M.BatchHeader(batch_id=0, group_sizes=[1], ready=True), [make_traj()])
    header, members = client.recv_bundle(timeout_s=5)
    assert header.ready and members[0].traj_id == "t0"
    client.close()
    server.close()


def test_sender_times_out_under_back_pressure():
    recv = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=1)
    send = TrajectorySender(recv.endpoint, hwm=1)
    big = make_traj(calls=16, side=128)
    sent = 0
    t0 = time.monotonic()
    while send.send(big, timeout_s=0.3):
        sent += 1
        assert time.monotonic() - t0 < 30, "HWM never pushed back"
    assert sent >= 1  # some fit in the pipes, then the sender is told to wait instead of dropping
    got = 0
    while recv.recv(timeout_s=1) is not None:
        got += 1
    assert got == sent  # nothing lost: everything accepted by send() arrived
    send.close()
    recv.close()


def test_local_pipe_same_interface_and_capacity():
    pipe = LocalPipe(capacity=2)
    assert pipe.send(make_traj(seed=1)) and pipe.send(make_traj(seed=2))
    assert not pipe.send(make_traj(seed=3), timeout_s=0.05)
    assert pipe.recv().traj_id == "t1"
    pipe.send_frames([b"garbage"])
    assert pipe.recv().traj_id == "t2"
    assert pipe.recv() is None and pipe.malformed.by_reason["msgpack"] == 1


def test_endpoints_default_to_loopback(tmp_path):
    cfg = load_config()
    eps = endpoints(cfg.transport, tmp_path)
    assert all(e.startswith("tcp://127.0.0.1:") for e in eps.values())
    ipc = endpoints(load_config(None, ["transport.use_ipc=true"]).transport, tmp_path)
    assert ipc["trajectory"].startswith("ipc://")


def _fuzz_frames(rng, valid_frames):
    """One hostile multipart message: random bytes, truncations, bit flips, or a semantic mutation."""
    kind = rng.integers(0, 6)
    if kind == 0:
        return [rng.bytes(int(rng.integers(0, 512))) for _ in range(int(rng.integers(1, 5)))]
    if kind == 1:  # truncated frame
        frames = [bytes(f) for f in valid_frames]
        i = int(rng.integers(0, len(frames)))
        frames[i] = frames[i][: int(rng.integers(0, max(1, len(frames[i]))))]
        return frames
    if kind == 2:  # bit flip in the header (may land in a string and still be a valid message)
        frames = [bytearray(bytes(f)) for f in valid_frames]
        j = int(rng.integers(0, len(frames[0])))
        frames[0][j] ^= 1 << int(rng.integers(0, 8))
        return [bytes(f) for f in frames]
    if kind == 3:  # dropped or extra frames
        frames = [bytes(f) for f in valid_frames]
        return frames[:-1] if rng.random() < 0.5 else frames + [b"x" * 8]
    if kind == 4:
        return [b"\xff" * 70_000]  # oversize header / garbage
    cases = ["schema_version", "unknown_kind", "dtype", "shape_lie", "negative_version", "type",
             "unknown_field", "missing_field", "nan_logprob", "huge_shape"]
    return mutate(cases[int(rng.integers(0, len(cases)))])


def test_fuzz_live_receiver_10000_frames():
    recv = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=100_000, max_bytes=1024**2)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.sndhwm = 100_000
    push.connect(recv.endpoint)
    rng = np.random.default_rng(1)
    valid = M.encode(make_traj())
    n_bad = 10_000
    stop = threading.Event()
    valid_seen, mutations_that_parsed = [], []

    def drain():
        deadline = time.monotonic() + 240
        while (not stop.is_set() or recv.received < n_bad + 3) and time.monotonic() < deadline:
            msg = recv.recv(timeout_s=0.2)
            if msg is not None:
                (valid_seen if msg.traj_id.startswith("ok") else mutations_that_parsed).append(msg)
            if stop.is_set() and recv.received >= n_bad + 3:
                break

    th = threading.Thread(target=drain)
    th.start()
    n_bitflip = 0
    for _ in range(n_bad):
        state = rng.bit_generator.state
        if rng.integers(0, 6) == 2:
            n_bitflip += 1
        rng.bit_generator.state = state
        push.send_multipart(_fuzz_frames(rng, valid))
    # Over MAXMSGSIZE: ZeroMQ drops it before allocation and disconnects that peer, so it gets its own socket.
    rogue = ctx.socket(zmq.PUSH)
    rogue.connect(recv.endpoint)
    rogue.send_multipart([b"x" * (2 * 1024**2)])
    for i in range(3):  # valid frames sent afterwards still arrive
        push.send_multipart(M.encode(make_traj(traj_id=f"ok{i}", seed=i)))
    time.sleep(0.5)
    stop.set()
    th.join(60)
    assert not th.is_alive(), "receiver stopped serving"
    assert [m.traj_id for m in valid_seen] == ["ok0", "ok1", "ok2"]
    # Every hostile frame was either counted as malformed by reason, or (only a bit flip inside a string or
    # number can do this) decoded into a message that passed every check.
    assert recv.malformed.total + len(mutations_that_parsed) == n_bad
    assert len(mutations_that_parsed) <= n_bitflip
    assert len(recv.malformed.by_reason) >= 8
    push.close(0)
    rogue.close(0)
    ctx.term()
    recv.close()
