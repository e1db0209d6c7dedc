"""BufferService over real ZeroMQ sockets (tcp://127.0.0.1:0): grants, trajectories, batch bundles to 2 ranks,
live eta changes (control message and file), actor stats, recording + replay. (Flood: tests/faults/test_flood.py.)"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq
from test_buffer import make_traj

from async_vla.buffer.service import BufferService
from async_vla.learner_secret import ACTOR_SECRET_FILE, SECRET_FILE, actor_secret, as_actor, learner_secret, sign
from async_vla.config import BufferConfig, Config, RunConfig, TransportConfig, write_resolved
from async_vla.messages import (ROOT, ActorStats, AdmissionGrant, BatchRequest, ControlCommand, GrantRequest, Lineage,
                                Trajectory, decode)
from async_vla.buffer.recording import iter_recording, replay_recording
from async_vla.transport import ControlClient, TrajectorySender

RUN = "svc"
REPO = Path(__file__).resolve().parent.parent


def service_cfg(hwm: int = 64, **buffer) -> Config:
    return Config(run=RunConfig(name=RUN), buffer=BufferConfig(**buffer), transport=TransportConfig(hwm=hwm))


@contextlib.contextmanager
def running(tmp_path, cfg: Config):
    """A BufferService serving in a background thread; stopped, joined and closed on exit."""
    write_resolved(cfg, tmp_path)
    svc = BufferService(cfg, tmp_path, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                        valid_task_ids=[0, 1])
    stop = threading.Event()
    thread = threading.Thread(target=svc.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield svc
    finally:
        stop.set()
        thread.join(10)
        svc.close()


def learner_request(run_dir, **fields) -> BatchRequest:
    """A BatchRequest signed with the run's learner secret, as a learner rank (BatchClient) sends it."""
    return sign(learner_secret(Path(run_dir) / SECRET_FILE), BatchRequest(**fields))


def as_run_actor(run_dir, msg):
    """``msg`` (a GrantRequest, Heartbeat or ActorStats) with its actor's token under the run's actor secret, as
    an actor sends it."""
    return as_actor(actor_secret(Path(run_dir) / ACTOR_SECRET_FILE), msg)


def stats(client: ControlClient) -> dict:
    client.send(ControlCommand("stats"))
    reply = client.recv(10)
    assert reply is not None and reply.command == "stats"
    return json.loads(reply.value)


def wait_stats(client: ControlClient, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(client)
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def send_group(sender: TrajectorySender, gid: str, pattern, bv: int = 0, **kw) -> None:
    for i, s in enumerate(pattern):
        assert sender.send(make_traj(gid, i, s, bv=bv, G=len(pattern), run_id=RUN, **kw), timeout_s=5)


def test_grants_batches_to_two_ranks_and_live_eta(tmp_path):
    cfg = service_cfg(groups_per_batch=2, max_staleness=1)
    with running(tmp_path, cfg) as svc:
        actor = ControlClient(svc.control_endpoint, identity=b"actor-1")
        ranks = [ControlClient(svc.batch_endpoint, identity=f"rank-{r}".encode()) for r in range(2)]
        sender = TrajectorySender(svc.trajectory_endpoint)
        actor.send(as_run_actor(tmp_path, GrantRequest(actor_id=1, want=8)))
        grant = actor.recv(10)
        assert isinstance(grant, AdmissionGrant) and grant.max_staleness == 1 and grant.learner_version == 0
        assert len(grant.group_ids) == (1 + 0 + 1) * 2                       # pacing: (eta + v + 1) * B
        ranks[1].send(learner_request(tmp_path, rank=1, world=2, version=0, timeout_s=10))  # parked until a batch exists
        ids = grant.group_ids
        send_group(sender, ids[0], (1, 0), actor_id=1)
        send_group(sender, ids[1], (0, 1), actor_id=1)
        send_group(sender, ids[2], (1, 1), actor_id=1)                                    # uniform: filtered, slot freed
        ranks[0].send(learner_request(tmp_path, rank=0, world=2, version=0, timeout_s=10))
        replies = [r.recv_bundle(10) for r in ranks]
        assert all(rep is not None for rep in replies)
        headers = [rep[0] for rep in replies]
        assert all(h.ready for h in headers) and headers[0].batch_id == headers[1].batch_id
        assert [h.group_sizes for h in headers] == [[2], [2]]
        got = [{t.group_id for t in rep[1]} for rep in replies]
        assert got[0] | got[1] == {ids[0], ids[1]} and not got[0] & got[1]

        s = wait_stats(actor, lambda s: s["ledger"]["filtered_uniform"] == 2)
        assert s["ledger"]["trained"] == 4 and s["ledger"]["filtered_uniform"] == 2

        actor.send(ControlCommand("set_max_staleness", 3))                   # not signed: refused
        assert actor.recv(10).command == "error" and stats(actor)["service"]["control_refused_no_credential"] == 1
        actor.send(sign(learner_secret(tmp_path / SECRET_FILE), ControlCommand("set_max_staleness", 3)))
        assert actor.recv(10) == ControlCommand("ok", 3)
        actor.send(as_run_actor(tmp_path, GrantRequest(actor_id=2, want=8)))
        grant2 = actor.recv(10)
        # running = ids[3]; accepted = 2: (3 + 0 + 1) * 2 - 1 - 2 = 5 free (with eta 1 it would have been 1); one
        # actor holds at most max_groups_per_actor=4 open groups (it is told why it got fewer than it asked for),
        # and its fair share of the 5 + 1 slots for running groups among 2 live actors is 3
        assert grant2.max_staleness == 3 and len(grant2.group_ids) == 3 and "max_groups_per_actor" in grant2.error
        actor.send(as_run_actor(tmp_path, GrantRequest(actor_id=3, want=8)))
        assert len(actor.recv(10).group_ids) == 2          # 2 free, its share of 6 among 3 live actors: 2
        s = stats(actor)
        assert s["metrics"]["buffer/max_staleness"] == 3.0 and s["eta_changes"][-1]["source"] == "control"
        actor.send(sign(learner_secret(tmp_path / SECRET_FILE), ControlCommand("set_max_staleness", "x")))
        assert actor.recv(10).command == "error"

        ranks[0].send(learner_request(tmp_path, rank=0, world=2, version=1, timeout_s=0.2))
        header, members = ranks[0].recv_bundle(10)
        assert not header.ready and members == []

        actor.send(as_run_actor(tmp_path, ActorStats(actor_id=1, interval_s=2.0, env_steps=300, episodes=4,
                              successes_by_task={"0": 1, "1": 2}, episodes_by_task={"0": 2, "1": 2})))
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.linger = 0
        raw.connect(svc.trajectory_endpoint)
        raw.send_multipart([b"garbage"])
        s = wait_stats(actor, lambda s: s["ledger"]["malformed"] == 1 and "rollout/success_rate" in s["metrics"])
        m = s["metrics"]
        assert m["rollout/success_rate"] == 0.75 and m["rollout/success_rate_by_task/0"] == 0.5
        assert m["rollout/episodes"] == 4.0     # what the rate is over
        assert m["perf/env_steps_per_s"] == 150.0
        assert s["received"] == sum(s["ledger"].values()) == 7
        for c in (actor, *ranks, sender):
            c.close()
        raw.close()


def test_batches_travel_on_their_own_socket_and_a_batch_request_on_the_control_socket_is_refused(tmp_path):
    with running(tmp_path, service_cfg(groups_per_batch=1)) as svc:
        assert len({svc.trajectory_endpoint, svc.control_endpoint, svc.batch_endpoint}) == 3
        control, rank = ControlClient(svc.control_endpoint), ControlClient(svc.batch_endpoint)
        sender = TrajectorySender(svc.trajectory_endpoint)
        (a,) = control.call(as_run_actor(tmp_path, GrantRequest(actor_id=0, want=1)), 10).group_ids
        send_group(sender, a, (1, 0))
        wait_stats(control, lambda s: s["groups_ready"] == 1)
        control.send(BatchRequest(rank=0, world=1, version=0, timeout_s=10))   # its one reply, not the batch
        header, members = control.recv_bundle(10)
        assert not header.ready and members == []
        s = stats(control)
        assert s["service"]["batch_requests_on_control"] == 1 and s["groups_ready"] == 1   # nothing was taken
        rank.send(GrantRequest(actor_id=1, want=1))                 # control traffic on the batch socket: counted
        rank.send(learner_request(tmp_path, rank=0, world=1, version=0, timeout_s=10))
        header, members = rank.recv_bundle(10)
        assert header.ready and sorted(t.traj_id for t in members) == [f"{a}-t0", f"{a}-t1"]
        assert stats(control)["service"]["batch_socket_unexpected"] == 1
        for c in (control, rank, sender):
            c.close()


def test_memory_metrics_count_trajectory_connections_against_the_bound(tmp_path):
    cfg = service_cfg()
    with running(tmp_path, cfg) as svc:
        control = ControlClient(svc.control_endpoint)
        senders = [TrajectorySender(svc.trajectory_endpoint) for _ in range(2)]
        for k, snd in enumerate(senders):
            assert snd.send(make_traj(f"m{k}", 0, True, run_id=RUN), timeout_s=5)
        m = wait_stats(control, lambda s: s["metrics"]["buffer/trajectory_connections"] == 2)["metrics"]
        per_connection = (cfg.transport.trajectory_hwm + 1) * int(cfg.transport.max_message_mb * 2**20)   # the cap
        assert m["buffer/memory_bound_bytes"] == cfg.buffer.max_bytes + 2 * per_connection
        assert m["buffer/rss_bytes"] > 10 * 2**20          # this interpreter, its numpy and ZeroMQ at least
        senders[0].close()
        m = wait_stats(control, lambda s: s["metrics"]["buffer/trajectory_connections"] == 1)["metrics"]
        assert m["buffer/memory_bound_bytes"] == cfg.buffer.max_bytes + per_connection
        senders[1].close()
        control.close()


def test_eta_file_watch(tmp_path):
    cfg = service_cfg(control_poll_s=0.05)
    with running(tmp_path, cfg) as svc:
        client = ControlClient(svc.control_endpoint)
        assert (tmp_path / "control").is_dir()          # made by the service: `echo 5 > .../max_staleness` works
        (tmp_path / "control" / "max_staleness").write_text("5\n")
        s = wait_stats(client, lambda s: s["max_staleness"] == 5)
        assert s["max_staleness"] == 5 and s["eta_changes"][-1]["source"].startswith("file")
        (tmp_path / "control" / "max_staleness").write_text("not a number")
        time.sleep(0.3)
        assert stats(client)["max_staleness"] == 5
        (tmp_path / "control" / "max_staleness").write_bytes(b"\xff\xfe\x00")   # not text: ignored, still serving
        time.sleep(0.3)
        assert stats(client)["max_staleness"] == 5
        client.send(as_run_actor(tmp_path, GrantRequest(actor_id=0, want=100)))
        assert client.recv(10).max_staleness == 5
        client.close()


def test_recording_and_replay_reproduce_the_ledger(tmp_path):
    cfg = service_cfg(groups_per_batch=1, max_staleness=1, record=True, record_file_bytes=4096,
                      group_timeout_s=0.3, expire_every_s=0.05, pacing=False)
    with running(tmp_path, cfg) as svc:
        client, learner = ControlClient(svc.control_endpoint), ControlClient(svc.batch_endpoint)
        sender = TrajectorySender(svc.trajectory_endpoint)
        a, u, partial = client.call(as_run_actor(tmp_path, GrantRequest(actor_id=0, want=3)), 10).group_ids
        send_group(sender, a, (1, 0, 1, 0))
        send_group(sender, u, (1, 1))
        sender.send(make_traj(partial, 0, True, run_id=RUN))                    # its actor "dies"
        sender.send(make_traj("b", 0, True, run_id=RUN, task_id=9, G=2))        # unknown task
        sender.send(make_traj(a, 1, False, run_id=RUN))                         # duplicate
        learner.send(learner_request(tmp_path, rank=0, world=1, version=3, timeout_s=5))     # "a" is too old now
        assert not learner.recv_bundle(10)[0].ready
        (c,) = client.call(as_run_actor(tmp_path, GrantRequest(actor_id=0, want=1, policy_version=3)),
                           10).group_ids   # now: grants expire in 0.3 s
        send_group(sender, c, (0, 1), bv=3)
        learner.send(learner_request(tmp_path, rank=0, world=1, version=3, timeout_s=5))
        assert learner.recv_bundle(10)[0].ready
        wait_stats(client, lambda s: s["ledger"]["expired_partial"] == 1)
        client.close()
        learner.close()
        sender.close()
    recorded = json.loads((tmp_path / "ledger.json").read_text())
    assert recorded["ledger"] == {"trained": 2, "filtered_uniform": 2, "filtered_difficulty": 0, "stale": 4,
                                  "expired_partial": 1, "duplicate": 1, "malformed": 1, "ahead": 0,
                                  "pending": 0}
    assert len(list((tmp_path / "recording").glob("rec-*.bin"))) > 1                  # it rotated
    trajectories = [m for m in map(decode, iter_recording(tmp_path / "recording")) if isinstance(m, Trajectory)]
    assert len(trajectories) == recorded["received"] == 11
    replayed = replay_recording(tmp_path, limit=recorded["recorded_records"]).ledger_snapshot()
    for key in ("received", "ledger", "malformed_by_reason", "lag_histogram", "groups"):
        assert replayed[key] == recorded[key], key
    out = subprocess.run([sys.executable, str(REPO / "bin" / "replay"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ledger reproduced" in out.stdout


def _stepped(tmp_path, clock, **buffer):
    """A BufferService driven by hand (``step``), on a fake clock: the order of inputs is the test's."""
    cfg = service_cfg(**buffer)
    write_resolved(cfg, tmp_path)
    return BufferService(cfg, tmp_path, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                         valid_task_ids=[0], clock=clock)


def _step_until(svc, pred, what: str):
    for _ in range(4000):   # a count of service steps, not a wall-clock bound: ends as soon as pred holds
        svc.step(0.005)
        got = pred()
        if got:
            return got
    raise AssertionError(f"the service never got to: {what}")


def test_a_parked_batch_request_is_served_by_the_last_trajectory_even_when_it_comes_while_the_service_idles(tmp_path):
    # The trajectory completing the batch arrived during step()'s idle wait and then nothing else came: the parked
    # request was retried only after a busy step's reads, so it waited for its timeout (seen: a 60 s first batch).
    from test_buffer import FakeClock

    with _stepped(tmp_path, FakeClock(100.0), groups_per_batch=1, pacing=False) as svc:
        learner, sender = ControlClient(svc.batch_endpoint), TrajectorySender(svc.trajectory_endpoint)
        actor = ControlClient(svc.control_endpoint)
        actor.send(as_run_actor(tmp_path, GrantRequest(actor_id=0, want=1)))
        (a,) = _step_until(svc, lambda: actor.recv(0.0), "the grant").group_ids
        assert sender.send(make_traj(a, 0, True, G=2, run_id=RUN), timeout_s=5)
        learner.send(learner_request(tmp_path, rank=0, world=1, version=0, timeout_s=60))
        _step_until(svc, lambda: svc.buffer.received == 1 and svc.metrics()["buffer/parked_requests"] == 1,
                    "the request parked")
        late = threading.Timer(0.3, lambda: sender.send(make_traj(a, 1, False, G=2, run_id=RUN), timeout_s=5))
        late.start()
        svc.step(wait_s=30.0)          # idle until the last member comes (returns as soon as it did)
        late.join()
        got = _step_until(svc, lambda: learner.recv_bundle(0.0), "the batch for the parked request")
        assert got[0].ready and len(got[1]) == 2
        actor.close()
        learner.close()
        sender.close()


def test_a_grant_says_why_it_is_empty_and_whose_learner_it_answers_for(tmp_path):
    # The actor decides from the reply alone: "wait" (pacing) means ask again later, "behind" / "dead" mean load the
    # learner's newest weights first (its lineage and version travel with every grant).
    from test_buffer import FakeClock

    learner_lineage = Lineage(ROOT).descend("l", 0)
    with _stepped(tmp_path, FakeClock(100.0), groups_per_batch=1, max_staleness=0) as svc:
        actor, learner = ControlClient(svc.control_endpoint), ControlClient(svc.batch_endpoint)
        learner.send(learner_request(tmp_path, rank=0, world=1, version=2, timeout_s=0.0, lineage=learner_lineage.encode()))
        assert not _step_until(svc, lambda: learner.recv_bundle(0.0), "the learner's request")[0].ready
        replies = []
        for n, (lineage, version) in enumerate((("l", 2), ("l", 2), ("l", 1), ("gone", 2))):
            actor.send(as_run_actor(tmp_path, GrantRequest(actor_id=n, want=1, policy_version=version,
                                                           policy_lineage=lineage)))
            replies.append(_step_until(svc, lambda: actor.recv(0.0), f"grant reply {n}"))
        assert [(len(g.group_ids), g.refused) for g in replies] == [(1, ""), (0, "wait"), (0, "behind"), (0, "dead")]
        assert all((g.learner_lineage, g.learner_version) == ("l", 2) for g in replies)
        assert replies[1].retry_after_s == svc.cfg.buffer.grant_retry_s
        for c in (actor, learner):
            c.close()
