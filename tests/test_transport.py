"""Transport: real ZeroMQ sockets on loopback and the in-process twin. (Fuzzing, oversize frames and non-blocking
control sends: tests/faults/.)"""

import time

import pytest

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
from tests.test_messages import make_traj
from timing import slack


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
        assert time.monotonic() - t0 < slack(30), "HWM never pushed back"
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


def test_use_ipc_puts_every_endpoint_in_the_run_directory(tmp_path):
    # (the loopback tcp defaults: tests/faults/test_security.py::test_every_default_bind_is_loopback)
    ipc = endpoints(load_config(None, ["transport.use_ipc=true"]).transport, tmp_path)
    assert ipc and all(e.startswith(f"ipc://{tmp_path}") for e in ipc.values()), ipc
    import stat

    import zmq

    from async_vla.transport import bind

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        assert bind(sock, ipc["trajectory"]) == ipc["trajectory"]
        sockets_dir = (tmp_path / "sockets").resolve()
        assert ipc["trajectory"] == f"ipc://{sockets_dir}/trajectory"
        assert stat.S_IMODE(sockets_dir.stat().st_mode) == 0o700    # other users cannot reach the socket files
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_connection_storm_does_not_stall_intake_when_nobody_asks_for_metrics():
    # libzmq's I/O thread blocks on a full monitor queue (~2,000 events), and trajectory intake with it; the
    # receiver reads its connection events while it receives, not only when metrics ask for them.
    import zmq

    rx = TrajectoryReceiver("tcp://127.0.0.1:0")
    ctx = zmq.Context()
    # closed sockets keep their slot until libzmq's reaper thread destroys them, which can lag the loop by more than
    # the default 1,023 slots (then socket() fails with EMFILE): room for all of them
    ctx.set(zmq.MAX_SOCKETS, 4096)
    try:
        for i in range(3000):                      # 6,000 accept / disconnect events
            s = ctx.socket(zmq.PUSH)
            s.linger = 0
            s.connect(rx.endpoint)
            s.send(b"x")                           # forces the connection to be accepted
            s.close()
            if i % 50 == 0:
                rx.recv(0)                         # the service's loop: receiving, never metrics
        tx = TrajectorySender(rx.endpoint)
        assert tx.send(make_traj(seed=3), timeout_s=30)
        deadline = time.monotonic() + slack(30)
        got = None
        while got is None and time.monotonic() < deadline:
            got = rx.recv(0.5)
        assert got is not None and got.traj_id == make_traj(seed=3).traj_id
        assert rx.connections >= 1                 # the sender still connected was counted
        tx.close()
    finally:
        ctx.term()
        rx.close()
