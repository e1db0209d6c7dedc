"""Security: loopback by default, CURVE for remote actors (a peer without the key is rejected, for real), bounded
msgpack decoding, nothing on the wire unpickled, TensorBoard from bin/train on loopback by default.
(The live system's listening sockets are checked in test_live_faults.py.)"""

from __future__ import annotations

import contextlib
import json
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq
from test_buffer import make_traj
from test_buffer_service import as_run_actor, learner_request

from async_vla import messages as M
from async_vla.buffer.service import BufferService
from async_vla.config import load_config, write_resolved
from async_vla.transport import ControlClient, ControlTimeout, CurveKeys, TrajectorySender, endpoints
from timing import slack

REPO = Path(__file__).resolve().parents[2]
RUN = "sec"


def test_every_default_bind_is_loopback(tmp_path):
    cfg = load_config()
    assert cfg.transport.host == cfg.transport.connect_host == cfg.logging.tensorboard_host == "127.0.0.1"
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints(cfg.transport, tmp_path).values())
    from async_vla.weights import WeightPublisher

    pub = WeightPublisher(load_config(None, ["transport.weights_port=0"]), tmp_path)
    try:
        mine = [c.laddr for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == pub.port]
        assert mine and all(a.ip == "127.0.0.1" for a in mine)   # TCPStore alone would listen on every interface
    finally:
        pub.close()


def test_gloo_pair_sockets_listen_on_loopback_in_a_one_host_run(tmp_path, monkeypatch):
    # gloo picks its own address otherwise (GLOO_SOCKET_IFNAME, else the host name's): point it at this
    # machine's non-loopback interface and check that the weight broadcast's pair sockets stay on loopback.
    ifaces = [name for name, addrs in psutil.net_if_addrs().items()
              if any(a.family == 2 and not a.address.startswith("127.") for a in addrs)]   # AF_INET
    if not ifaces:
        pytest.skip("no non-loopback interface")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifaces[0])
    from weight_helpers import mixed_model, weights_cfg

    from async_vla.weights import WeightPublisher, WeightSubscriber

    cfg = weights_cfg()                       # every byte over gloo
    pub = WeightPublisher(cfg, tmp_path)
    sub = WeightSubscriber(cfg, 1, tmp_path)
    try:
        assert pub.wait_for_actors(1, slack(20)) == 1
        st = pub.publish(1, mixed_model(1).items())
        assert st["transport"] == "gloo" and st["confirmed"] == 1, st
        assert sub.poll(timeout=slack(10))[0].version == 1
        listening = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert len(listening) >= 3, listening     # the store plus a gloo listener on each side
        assert all(psutil_ip_is_loopback(a.ip) for a in listening), listening
    finally:
        sub.close()
        pub.close()


def psutil_ip_is_loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


def test_binding_beyond_loopback_requires_curve(tmp_path):
    from async_vla.config import ConfigError

    for host in ("0.0.0.0", "10.1.2.3", "buffer.example.org"):
        with pytest.raises(ConfigError, match="transport.curve=true"):
            load_config(None, [f"transport.host={host}"])
    with pytest.raises(ConfigError, match="transport.curve_dir"):
        load_config(None, ["transport.host=0.0.0.0", "transport.curve=true"])
    with pytest.raises(ConfigError, match="transport.weights_allowed_peers"):   # the weight store's allow-list
        load_config(None, ["transport.host=0.0.0.0", "transport.curve=true", f"transport.curve_dir={tmp_path}"])
    ok = load_config(None, ["transport.host=0.0.0.0", "transport.curve=true", f"transport.curve_dir={tmp_path}",
                            "transport.weights_allowed_peers=[10.0.0.0/24]"])
    assert ok.transport.curve
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert load_config(None, [f"transport.host={host}"]).transport.host == host


def test_bin_train_serves_tensorboard_on_loopback_by_default(tmp_path, monkeypatch):
    """What start_children (bin/train --tensorboard) runs, captured instead of started."""
    import runner.launch as launch

    started = {}

    class FakeChild:
        def __init__(self, name, argv, run_dir, **kw):
            started[name] = argv

        def alive(self):
            return True

    monkeypatch.setattr(launch, "Child", FakeChild)
    monkeypatch.setattr(launch, "buffer_stats", lambda *a, **k: {})
    cfg = launch.resolve_ports(load_config(None, ["logging.serve_tensorboard=true", "logging.tensorboard_port=0"]))
    launch.start_children(cfg, tmp_path, write_resolved(cfg, tmp_path), resume=False)
    argv = started["tensorboard"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


# ---------------------------------------------------------------------------------------------- CURVE
@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys") / "curve"
    out = subprocess.run([sys.executable, str(REPO / "bin" / "keys"), str(d)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    again = subprocess.run([sys.executable, str(REPO / "bin" / "keys"), str(d)], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "--force" in again.stderr      # never silently replaces keys
    for f in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((d / f).stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and (d / "authorized" / "client.key").is_file()
    return d


@contextlib.contextmanager
def curve_service(tmp_path, keys_dir):
    cfg = load_config(None, [f"run.name={RUN}", "transport.curve=true", f"transport.curve_dir={keys_dir}"])
    svc = BufferService(cfg, tmp_path, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                        valid_task_ids=[0], keys=CurveKeys.load(str(keys_dir), "server"))
    stop = threading.Event()
    th = threading.Thread(target=svc.serve, args=(stop,), daemon=True)
    th.start()
    try:
        yield svc
    finally:
        stop.set()
        th.join(10)
        svc.close()


def test_curve_admits_the_key_holder_and_rejects_everyone_else(tmp_path, keys):
    import zmq.auth

    client_keys = CurveKeys.load(str(keys), "client")
    stranger_dir = tmp_path / "stranger"
    stranger_dir.mkdir()
    pub, sec = zmq.auth.load_certificate(zmq.auth.create_certificates(str(stranger_dir), "client")[1])
    stranger = CurveKeys(client_keys.server_public, None, pub, sec, None)   # knows the server key, not authorized
    with curve_service(tmp_path / "run", keys) as svc, contextlib.ExitStack() as closing:
        # Everything is closed even when an assertion fails: a leaked socket + context pair collected later in a
        # reference cycle can block the garbage collector in Context.term() (seen on CI, in the next test).
        ok = ControlClient(svc.control_endpoint, keys=client_keys)
        closing.callback(ok.close)
        assert ok.call(M.ControlCommand("stats"), timeout_s=10).command == "stats"
        rank = ControlClient(svc.batch_endpoint, keys=client_keys)   # the batch socket has its own context
        closing.callback(rank.close)
        rank.request(learner_request(tmp_path / "run", rank=0, world=1, version=0, timeout_s=0.0), timeout_s=10)
        assert not rank.recv_bundle(10)[0].ready
        for who in (None, stranger):   # a plain-text peer, and a CURVE peer whose key is not in authorized/
            c = ControlClient(svc.control_endpoint, keys=who)
            closing.callback(c.close)
            # Refused either way: the request queued and never answered, or (a loaded machine, where the
            # handshake that never completes leaves no room) never queued at all.
            with pytest.raises(ControlTimeout, match="no reply|stayed full"):
                c.call(M.ControlCommand("stats"), timeout_s=1.5)
            b = ControlClient(svc.batch_endpoint, keys=who)
            closing.callback(b.close)
            with pytest.raises(ControlTimeout, match="no reply|stayed full"):
                b.call(M.BatchRequest(rank=0, world=1, version=0, timeout_s=0.0), timeout_s=1.5)
            s = TrajectorySender(svc.trajectory_endpoint, keys=who)
            closing.callback(s.close, flush_s=0.5)
            t0 = time.monotonic()
            s.send(make_traj("x", 0, True, run_id=RUN), timeout_s=1.0)   # queued or not: never blocks past it
            assert time.monotonic() - t0 < slack(3.0)
        good = TrajectorySender(svc.trajectory_endpoint, keys=client_keys)
        closing.callback(good.close)
        (gid,) = ok.call(as_run_actor(tmp_path / "run", M.GrantRequest(actor_id=0, want=1)),
                         timeout_s=10).group_ids
        assert good.send(make_traj(gid, 0, True, run_id=RUN), timeout_s=5)
        deadline = time.monotonic() + 10
        while svc.buffer.received < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert svc.buffer.received == 1                        # only the key holder's trajectory got in
        assert svc.buffer.ledger["pending"] == 1 and svc.buffer.ledger["malformed"] == 0


def test_with_curve_an_actor_id_belongs_to_the_key_that_first_spoke_for_it(tmp_path, keys):
    import shutil

    import zmq.auth

    mine = tmp_path / "curve"
    shutil.copytree(keys, mine)
    public, _ = zmq.auth.create_certificates(str(mine), "host2")      # a second actor host, authorized too
    shutil.copy(public, mine / "authorized" / "host2.key")
    first = CurveKeys.load(str(mine), "client")
    pub, sec = zmq.auth.load_certificate(mine / "host2.key_secret")
    second = CurveKeys(first.server_public, None, pub, sec, None)
    with curve_service(tmp_path / "run", mine) as svc, contextlib.ExitStack() as closing:
        a, b = ControlClient(svc.control_endpoint, keys=first), ControlClient(svc.control_endpoint, keys=second)
        closing.callback(a.close)
        closing.callback(b.close)
        grant = a.call(as_run_actor(tmp_path / "run", M.GrantRequest(actor_id=0, want=1)), timeout_s=10)
        assert len(grant.group_ids) == 1
        # the other key, with actor 0's valid token: not actor 0 (counted); for an id of its own it is served
        taken = b.call(as_run_actor(tmp_path / "run", M.GrantRequest(actor_id=0, want=1)), timeout_s=10)
        assert taken.group_ids == [] and taken.refused == "unauthenticated" and "other_key" in taken.error
        own = b.call(as_run_actor(tmp_path / "run", M.GrantRequest(actor_id=1, want=1)), timeout_s=10)
        assert len(own.group_ids) == 1 and own.refused == ""
        s = json.loads(a.call(M.ControlCommand("stats"), timeout_s=10).value)
        assert s["service"]["actor_refused_other_key"] == 1 and s["actors_holding_grants"] == 2


# ---------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("header, reason", [
    (b"\xdd\x7f\xff\xff\xff", "msgpack"),                                  # array32 of 2**31 - 1 elements
    (b"\xdf\x7f\xff\xff\xff", "msgpack"),                                  # map32 of 2**31 - 1 pairs
    (b"\xdb\x7f\xff\xff\xff" + b"x" * 10, "msgpack"),                      # str32 claiming 2 GiB
    (b"\x91" * 2000 + b"\xc0", "msgpack"),                                 # 2000-deep nesting
    (msgpack.packb({"v": 1, "k": "x" * 70_000}), "oversize"),              # header over MAX_HEADER_BYTES
    (msgpack.packb(list(range(5000))), "msgpack"),                         # over max_array_len
])
def test_msgpack_decoding_is_size_limited(header, reason):
    with pytest.raises(M.MalformedMessage) as err:
        M.decode([header])
    assert err.value.reason == reason
    with pytest.raises(M.MalformedMessage):
        M.decode_bundle([header, b"x"])


WIRE_MODULES = ["async_vla/messages.py", "async_vla/transport.py", "async_vla/buffer/group_buffer.py",
                "async_vla/buffer/service.py", "async_vla/buffer/recording.py", "async_vla/buffer/client.py",
                "async_vla/weights/publisher.py", "async_vla/weights/subscriber.py", "async_vla/weights/buckets.py",
                "async_vla/weights/export.py", "async_vla/weights/wire.py", "async_vla/weights/files.py",
                "actors/actor.py", "actors/status.py", "actors/vllm_weights.py",
                "learner/__main__.py", "runner/launch.py"]
UNSAFE = [r"\bimport pickle\b", r"\bpickle\.loads?\b", r"\bcPickle\b", r"\bdill\b", r"\bmarshal\.loads?\b",
          r"recv_pyobj", r"send_pyobj", r"recv_serialized", r"allow_pickle\s*=\s*True", r"(?<![.\w])eval\(",
          r"(?<![.\w])exec\(", r"yaml\.load\((?![^)]*Loader=yaml\.SafeLoader)", r"yaml\.unsafe_load"]


def test_nothing_on_the_wire_is_unpickled():
    for rel in WIRE_MODULES:
        path = REPO / rel
        assert path.is_file(), f"{rel} moved: update WIRE_MODULES"   # a moved module must not drop out unchecked
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        for pattern in UNSAFE:
            assert not re.search(pattern, code), f"{rel}: {pattern}"
        for call in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", code):   # only with weights_only=True
            assert "weights_only=True" in call.group(0), f"{rel}: {call.group(0)}"
    assert (REPO / "async_vla/messages.py").read_text().count("msgpack.unpackb(") == 2   # both calls bounded
    assert "max_array_len" in (REPO / "async_vla/messages.py").read_text()
