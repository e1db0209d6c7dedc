"""The Actor main loop in-process against the real BufferService over loopback TCP (threads, no fleet).

Covers: grants -> groups -> streamed trajectories that the buffer assembles; heartbeats and ActorStats reach the
buffer; a real broadcast from a WeightPublisher (a learner of its own lineage) is taken at the next group and
recorded per chunk; request_stop ends the loop with exit code 0 and closed sockets.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from async_vla.config import load_config
from async_vla.messages import ControlCommand
from async_vla.transport import ControlClient

OVERRIDES = ["actor.group_size=2", "env.envs_per_actor=2", "policy.hidden_size=32", "policy.intermediate_size=64",
             "policy.num_layers=1", "buffer.dynamic_sampling=false", "buffer.pacing=false", "run.name=loop",
             "actor.heartbeat_s=0.2", "actor.stats_every_s=0.5", "buffer.max_staleness=100", "buffer.max_staleness_limit=100", "env.task_ids=[0,2]",
             # weights port 0: the subscriber finds the publisher through <run>/weights/endpoint.json only,
             # never a stranger's publisher on the default port
             "transport.weights_port=0", "weights.export=false"]


def wait_for(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture()
def service(tmp_path):
    from async_vla.buffer.service import BufferService

    cfg = load_config(None, OVERRIDES)
    svc = BufferService(cfg, tmp_path / "run", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    received = []
    add = svc.buffer.add

    def spy(traj):  # keep every trajectory the buffer saw, to check versions afterwards
        received.append(traj)
        return add(traj)

    svc.buffer.add = spy
    stop = threading.Event()
    th = threading.Thread(target=svc.serve, args=(stop,), daemon=True)
    th.start()
    yield cfg, svc, received
    stop.set()
    th.join(10)
    svc.close()


def command(endpoint, cmd, value=None):
    client = ControlClient(endpoint)
    try:
        client.send(ControlCommand(cmd, value))
        reply = client.recv(5.0)
        assert reply is not None and reply.command in ("ok", "stats"), reply
        return reply.value
    finally:
        client.close()


@pytest.mark.slow  # ~10 s alone, over 20 s on a loaded 2-core host
def test_actor_loop_with_buffer_service(service, tmp_path):
    from actors.actor import Actor
    from actors.status import read_status, status_path
    from async_vla.policy import build_policy

    cfg, svc, received = service
    run_dir = tmp_path / "run"
    policy = build_policy(cfg)
    endpoints = {"trajectory": svc.trajectory_endpoint, "control": svc.control_endpoint}
    actor = Actor(cfg, 4, run_dir, endpoints, policy_factory=lambda c: policy)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("rc", actor.run()), daemon=True)
    th.start()
    wait_for(lambda: len(received) >= 6, 120, "6 trajectories")

    # A real broadcast (learner rank 0's publisher, gloo): the actor's subscriber receives v5 and swaps it in.
    import torch

    from async_vla.weights import WeightPublisher

    publisher = WeightPublisher(cfg, run_dir)
    lineage = publisher.lineage
    try:
        assert publisher.wait_for_actors(1, 30) == 1
        new = {n: p.detach() + 0.01 for n, p in build_policy(cfg).named_parameters()}  # tied lm_head not listed
        out = publisher.publish(5, new.items())
        assert out["confirmed"] == 1, out
        wait_for(lambda: any(t.chunk_versions[0] == 5 for t in received), 60, "a trajectory at version 5")
        with torch.no_grad():
            own = dict(policy.named_parameters())
            assert all(torch.equal(own[n], t) for n, t in new.items())
    finally:
        publisher.close()
    stats = wait_for(lambda: (lambda s: s if s["metrics"]["perf/env_steps_per_s"] > 0 else None)(
        json.loads(command(svc.control_endpoint, "stats"))), 30, "ActorStats with env steps at the buffer")
    actor.request_stop("test done")
    th.join(30)
    assert not th.is_alive() and result["rc"] == 0

    for t in received:
        assert t.behaviour_version == int(t.chunk_versions.min()) and set(t.chunk_versions.tolist()) <= {0, 5}
        assert {(t.lineage, v) for v in t.chunk_versions.tolist()} <= {("", 0), (lineage, 5)}   # one lineage each
        assert t.run_id == "loop" and t.actor_id == 4 and t.group_size == 2 and t.task_id in (0, 2)
    groups = {}
    for t in received:
        groups.setdefault(t.group_id, []).append(t)
    complete = [g for g in groups.values() if len(g) == 2]
    assert len(complete) >= 3
    assert all(len({(t.task_id, t.init_state_id) for t in g}) == 1 for g in complete)
    assert stats["ledger"]["malformed"] == 0 and stats["ledger"]["duplicate"] == 0
    assert stats["metrics"]["perf/actors_alive"] >= 1 and stats["metrics"]["perf/env_steps_per_s"] > 0
    st = read_status(status_path(run_dir, 4))
    wait_for(lambda: len(received) >= st["sent"], 30, "every trajectory sent at the buffer")   # (in flight at stop)
    assert st["state"] == "stopped" and st["version"] == 5 and st["trajectories"] == len(received)
    # The actor's own count of what it sent, by buffer incarnation: every one of them reached the buffer.
    from actors.status import read_sent_logs

    assert read_sent_logs(run_dir) == {svc.incarnation: [t.traj_id for t in received]}
    assert st["sent_by_buffer"] == {svc.incarnation: len(received)}
    assert st["learner_version"] == 0 and st["swaps"] == 1
