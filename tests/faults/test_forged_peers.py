"""Peers that pretend to be someone else, against ``bin/buffer`` as its own process (issue 42): batch requests
without the learner's credential, or replayed (async_vla/learner_secret.py); trajectories for groups nobody granted
them; actor ids that do not authenticate (the run's actor credential), and churn of ids that do; identities
that ask for the whole pacing budget; messages of many frames and frames sent slowly. Each test asserts the process
stays up, its memory within its bound, the hostile input is counted by reason and moves nothing, and an honest
actor's next group is granted and trained (the honest learner is a real ``BatchClient``, signing with the run's
secret) with every trajectory in its expected ledger state."""

from __future__ import annotations

import pytest
from buffer_process import live_buffer
from test_buffer import make_traj
from test_buffer_service import stats, wait_stats

from test_buffer_service import as_run_actor, learner_request

from async_vla.buffer.client import BatchClient
from async_vla.learner_secret import ACTOR_SECRET_FILE, SECRET_FILE, as_actor, learner_secret, sign
from async_vla.messages import ROOT, BatchRequest, ControlCommand, GrantRequest, Heartbeat, Lineage, PolicyTag
from async_vla.transport import ControlClient, TrajectorySender

RUN = "forged"
OVERRIDES = ["transport.use_ipc=true", "buffer.groups_per_batch=1", "buffer.max_staleness=1",
             "env.task_ids=[0]", "learner.batch_timeout_s=5"]
HONEST = Lineage("honest", (PolicyTag(ROOT, 0),))


def within_bound(s0: dict, s: dict) -> bool:
    """Has the buffer's resident memory grown by at most its memory bound since ``s0`` (the interpreter, code and
    sockets it held then come on top of the bound)?"""
    m0, m = s0["metrics"], s["metrics"]
    return m["buffer/rss_bytes"] - m0["buffer/rss_bytes"] <= m["buffer/memory_bound_bytes"]


def honest_group_is_trained(cfg, run_dir, eps, client, actor_id: int = 5, version: int = 0) -> dict:
    """An honest actor asks for a group, sends its 2 members, and the honest learner (BatchClient) trains it at
    ``version``; returns the stats after, with the group's members asserted "trained"."""
    grant = client.call(as_run_actor(run_dir, GrantRequest(actor_id=actor_id, want=1)), 10)
    assert len(grant.group_ids) == 1 and not grant.error and grant.refused == ""
    (gid,) = grant.group_ids
    return group_is_trained(cfg, run_dir, eps, client, gid, actor_id, version)


def group_is_trained(cfg, run_dir, eps, client, gid: str, actor_id: int, version: int) -> dict:
    """The honest actor ``actor_id`` sends the 2 members of its granted group ``gid`` and the honest learner trains
    it at ``version``: the stats after, with its members asserted "trained" and the books balanced."""
    before = stats(client)["ledger"]["trained"]
    sender = TrajectorySender(eps["trajectory"])
    for i in range(2):
        assert sender.send(make_traj(gid, i, i == 0, G=2, run_id=RUN, actor_id=actor_id), timeout_s=10)
    learner = BatchClient(cfg, run_dir, 0, 1, lineage=HONEST)
    try:
        groups = None
        for _ in range(20):
            groups = learner.poll(version)
            if groups is not None:
                break
        assert groups is not None and [t.group_id for t in groups[0]] == [gid, gid]
    finally:
        learner.close()
        sender.close()
    s = stats(client)
    assert s["ledger"]["trained"] == before + 2 and s["received"] == sum(s["ledger"].values())
    return s


@pytest.mark.slow
def test_forged_learner_requests_are_refused_and_counted_and_the_learner_still_trains(tmp_path):
    with live_buffer(tmp_path, RUN, OVERRIDES) as (cfg, run_dir, eps, client, proc):
        honest_group_is_trained(cfg, run_dir, eps, client)                 # the learner at v0: followed
        forger = ControlClient(eps["batch"])
        other_secret = b"0" * 64                                          # a credential, not this run's
        forged = [
            BatchRequest(rank=0, world=1, version=50, timeout_s=0.0),                          # no credential
            BatchRequest(rank=0, world=1, version=0, timeout_s=0.0, lineage=Lineage("x").encode(),
                         auth="ab" * 32),                                                      # a made-up one
            sign(other_secret, BatchRequest(rank=0, world=1, version=9, timeout_s=0.0,
                                            lineage=Lineage("y", (PolicyTag("honest", 0),)).encode())),
        ]
        for msg in forged:
            forger.send(msg)
            header, members = forger.recv_bundle(10)                      # one reply each, never a batch
            assert not header.ready and members == []
        s = wait_stats(client, lambda s: s["service"].get("learner_refused_bad_credential") == 2)
        assert s["service"]["learner_refused_no_credential"] == 1
        assert s["learner_version"] == 0 and s["learner_lineage"] == HONEST.encode() and not s["rollbacks"]
        assert proc.poll() is None
        forger.close()
        s = honest_group_is_trained(cfg, run_dir, eps, client, version=1)  # the next version, as the learner says
        assert s["learner_version"] == 1 and s["ledger"]["trained"] == 4


def test_the_learner_secret_is_private_and_one_per_run(tmp_path):
    from async_vla.learner_secret import SECRET_FILE, learner_secret, verify

    path = tmp_path / SECRET_FILE
    first = learner_secret(path)
    assert learner_secret(path) == first and learner_secret(tmp_path / "other" / SECRET_FILE) != first
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    req = BatchRequest(rank=0, world=1, version=3, lineage=HONEST.encode())
    assert verify(first, sign(first, req)) == "" and verify(first, req) == "no_credential"
    moved = sign(first, req)
    moved.version = 4                                   # a signed request with a field changed
    assert verify(first, moved) == "bad_credential"
    path.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        learner_secret(path)


@pytest.mark.slow
def test_trajectories_for_groups_nobody_granted_them_are_refused_and_the_honest_actor_still_trains(tmp_path):
    with live_buffer(tmp_path, RUN, OVERRIDES) as (cfg, run_dir, eps, client, proc):
        victim = client.call(as_run_actor(run_dir, GrantRequest(actor_id=5, want=1)), 10)   # an honest open group
        (open_gid,) = victim.group_ids
        forger = TrajectorySender(eps["trajectory"])
        guessed = [f"{RUN}-g{n}" for n in range(2000)]                       # ids of the old counter scheme
        for gid in guessed:
            assert forger.send(make_traj(gid, 0, True, G=2, run_id=RUN, actor_id=5), timeout_s=10)
        for i in range(2):                   # the victim's real id, sent as another actor: a complete forged group
            assert forger.send(make_traj(open_gid, 10 + i, i == 0, G=2, run_id=RUN, actor_id=6), timeout_s=10)
        s = wait_stats(client, lambda s: s["received"] == len(guessed) + 2, timeout=120)
        assert proc.poll() is None
        assert s["malformed_by_reason"] == {"ungranted_group": len(guessed), "not_granted_to_actor": 2}
        assert s["groups_in_flight"] == 1 and s["groups_ready"] == 0 and s["ledger"]["pending"] == 0
        forger.close(flush_s=0)
        # The victim's group is intact: its own members complete it and it is trained; so is a new actor's next one.
        sender = TrajectorySender(eps["trajectory"])
        for i in range(2):
            assert sender.send(make_traj(open_gid, i, i == 0, G=2, run_id=RUN, actor_id=5), timeout_s=10)
        sender.close()
        learner = BatchClient(cfg, run_dir, 0, 1, lineage=HONEST)
        try:
            groups = next(filter(None, (learner.poll(0) for _ in range(20))), None)
            assert groups is not None and {t.traj_id for t in groups[0]} == {f"{open_gid}-t0", f"{open_gid}-t1"}
        finally:
            learner.close()
        s = honest_group_is_trained(cfg, run_dir, eps, client, actor_id=8, version=1)
        assert s["ledger"]["trained"] == 4 and s["ledger"]["malformed"] == len(guessed) + 2
        assert s["received"] == sum(s["ledger"].values())


@pytest.mark.slow
def test_actor_ids_that_do_not_authenticate_are_refused_and_churn_cannot_evict_an_actor_holding_a_grant(tmp_path):
    from async_vla.buffer.service import MAX_ACTORS_TRACKED

    with live_buffer(tmp_path, RUN, OVERRIDES) as (cfg, run_dir, eps, client, proc):
        s0 = stats(client)
        (gid,) = client.call(as_run_actor(run_dir, GrantRequest(actor_id=5, want=1)), 10).group_ids
        sender = TrajectorySender(eps["trajectory"])
        assert sender.send(make_traj(gid, 0, True, G=2, run_id=RUN, actor_id=5), timeout_s=10)   # half-finished
        wait_stats(client, lambda s: s["ledger"]["pending"] == 1)
        churn = ControlClient(eps["control"])
        outsider = b"1" * 64                                   # an actor secret, not this run's
        n_plain, n_forged = 3000, 1000
        for k in range(n_plain):                               # made-up ids without a token
            msg = Heartbeat(actor_id=10_000 + k) if k % 3 else GrantRequest(actor_id=10_000 + k, want=4)
            assert churn.send(msg, timeout_s=10)
        for k in range(n_forged):                              # tokens of another secret, the honest id among them
            assert churn.send(as_actor(outsider, Heartbeat(actor_id=5 if k % 2 else 20_000 + k)), timeout_s=10)
        s = wait_stats(client, lambda s: s["service"].get("actor_refused_bad_credential") == n_forged
                       and s["service"].get("actor_refused_no_credential") == n_plain, timeout=120)
        assert s["service"]["actor_refused_no_credential"] == n_plain, s["service"]
        assert proc.poll() is None and within_bound(s0, s)
        # nothing of theirs is tracked or granted: one actor holds one group, none was forgotten or reclaimed
        assert s["actors_holding_grants"] == 1 and s["groups_in_flight"] == 1 and s["metrics"][
            "perf/actors_alive"] == 1
        assert "actors_forgotten" not in s["service"] and "groups_reclaimed" not in s["service"]
        # An insider holding the run's actor credential can make up ids: they are tracked, the oldest idle ones
        # forgotten, but never an actor holding a grant (only its own silence, buffer.reclaim_after_s, reclaims).
        fakes = MAX_ACTORS_TRACKED + 1000
        for k in range(fakes):
            assert churn.send(as_run_actor(run_dir, Heartbeat(actor_id=30_000 + k)), timeout_s=10)
        s = wait_stats(client, lambda s: s["service"].get("actors_forgotten") == fakes + 1 - MAX_ACTORS_TRACKED,
                       timeout=120)
        assert s["service"].get("actors_forgotten") == fakes + 1 - MAX_ACTORS_TRACKED, s["service"]
        assert proc.poll() is None and "groups_reclaimed" not in s["service"] and s["groups_in_flight"] == 1
        assert within_bound(s0, s)
        churn.close()
        assert sender.send(make_traj(gid, 1, False, G=2, run_id=RUN, actor_id=5), timeout_s=10)
        sender.close()
        learner = BatchClient(cfg, run_dir, 0, 1, lineage=HONEST)
        try:
            groups = next(filter(None, (learner.poll(0) for _ in range(20))), None)
            assert groups is not None and [t.group_id for t in groups[0]] == [gid, gid]
        finally:
            learner.close()
        s = stats(client)
        assert s["ledger"]["trained"] == 2 and s["ledger"]["expired_partial"] == 0 and s["ledger"]["pending"] == 0
        assert s["received"] == sum(s["ledger"].values())
        s = honest_group_is_trained(cfg, run_dir, eps, client, actor_id=6, version=1)   # a new actor's next group
        assert s["ledger"]["trained"] == 4


@pytest.mark.slow
def test_identities_asking_for_everything_leave_an_honest_actor_its_fair_share(tmp_path):
    # 4 groups of pacing budget ((eta + 0 + 1) * B); each actor may hold up to 4 (buffer.max_groups_per_actor)
    overrides = [*OVERRIDES[:2], "buffer.max_staleness=3", *OVERRIDES[3:]]
    with live_buffer(tmp_path, RUN, overrides) as (cfg, run_dir, eps, client, proc):
        s0 = stats(client)
        honest, greedy = ControlClient(eps["control"]), ControlClient(eps["control"])
        assert honest.send(as_run_actor(run_dir, Heartbeat(actor_id=5)), timeout_s=10)   # a live actor, asking later
        for actor_id in (100, 101, 102):                   # 3 other live identities
            assert greedy.send(as_run_actor(run_dir, Heartbeat(actor_id=actor_id)), timeout_s=10)
        wait_stats(client, lambda s: s["metrics"]["perf/actors_alive"] == 4)
        asked = 0
        for _ in range(50):                                # which ask for all of it, again and again
            for actor_id in (100, 101, 102):
                reply = greedy.call(as_run_actor(run_dir, GrantRequest(actor_id=actor_id, want=4)), 10)
                assert len(reply.group_ids) <= 1           # 4 live identities: a share of 4 // 4 = 1 each
                asked += 1
        s = stats(client)
        assert proc.poll() is None and within_bound(s0, s)
        assert s["most_groups_held_by_one_actor"] == 1 and s["groups_in_flight"] == 3
        assert s["grants_refused_share"] == asked          # every ask was held back to its share (3 got 1 each)
        grant = honest.call(as_run_actor(run_dir, GrantRequest(actor_id=5, want=1)), 10)
        assert len(grant.group_ids) == 1 and grant.refused == ""      # the honest actor's share was still free
        s = group_is_trained(cfg, run_dir, eps, client, grant.group_ids[0], 5, 0)
        assert s["ledger"] == {**s["ledger"], "trained": 2, "pending": 0, "malformed": 0}
        honest.close()
        greedy.close()


@pytest.mark.slow
def test_replayed_learner_messages_are_refused_and_counted(tmp_path):
    with live_buffer(tmp_path, RUN, OVERRIDES) as (cfg, run_dir, eps, client, proc):
        s0 = stats(client)
        honest_group_is_trained(cfg, run_dir, eps, client)                  # the learner at v0
        secret = learner_secret(run_dir / SECRET_FILE)
        eta_2, eta_1 = sign(secret, ControlCommand("set_max_staleness", 2)), sign(secret, ControlCommand(
            "set_max_staleness", 1))
        assert client.call(eta_2, 10).value == 2 and client.call(eta_1, 10).value == 1   # the operator's, in order
        replay = client.call(eta_2, 10)                    # the same signed message again: eta must not go back
        assert replay.command == "error" and "replayed" in replay.value
        batch = ControlClient(eps["batch"])
        old = learner_request(run_dir, rank=0, world=1, version=0, timeout_s=0.0, lineage=HONEST.encode())
        for _ in range(3):                                 # one taken (idempotent at v0), then its replays
            batch.send(old)
            header, members = batch.recv_bundle(10)
        assert not header.ready and members == []
        s = wait_stats(client, lambda s: s["service"].get("learner_refused_replayed") == 2)
        assert s["service"]["learner_refused_replayed"] == 2 and s["service"]["control_refused_replayed"] == 1
        assert s["max_staleness"] == 1 and s["learner_version"] == 0 and not s["rollbacks"]
        assert proc.poll() is None and within_bound(s0, s)
        batch.close()
        s = honest_group_is_trained(cfg, run_dir, eps, client, version=1)
        assert s["ledger"]["trained"] == 4 and s["learner_version"] == 1


def test_a_replay_guard_takes_each_message_once_and_nothing_signed_before_the_buffer_started():
    from async_vla.learner_secret import MAX_CLOCK_SKEW_S, REPLAY_WINDOW_S, ReplayGuard

    guard = ReplayGuard(started_ns=10**18)
    first, second = (BatchRequest(rank=0, world=1, version=0, session="a", seq=10**18 + k) for k in (1, 2))
    assert guard.fresh(second) and guard.fresh(first)          # out of order (two sockets): both taken, once
    assert not guard.fresh(first) and not guard.fresh(second)
    assert guard.fresh(BatchRequest(rank=0, world=1, version=0, session="b", seq=10**18 + 1))   # its own seqs
    late = 10**18 + 3 + int(REPLAY_WINDOW_S * 1e9)
    assert guard.fresh(BatchRequest(rank=0, world=1, version=0, session="a", seq=late))
    assert not guard.fresh(BatchRequest(rank=0, world=1, version=0, session="a", seq=10**18 + 3))  # out of window
    early = 10**18 - int(2 * MAX_CLOCK_SKEW_S * 1e9)          # signed well before this buffer started
    assert not guard.fresh(BatchRequest(rank=0, world=1, version=0, session="c", seq=early))
    assert ReplayGuard().fresh(sign(b"0" * 64, BatchRequest(rank=0, world=1, version=0)))   # now: fresh


@pytest.mark.slow
def test_messages_of_many_frames_and_frames_sent_slowly_stay_within_the_bound(tmp_path):
    import socket

    import zmq

    overrides = [*OVERRIDES, "transport.max_message_mb=1", "buffer.max_bytes=64000000"]
    with live_buffer(tmp_path, RUN, overrides) as (cfg, run_dir, eps, client, proc):
        s0 = stats(client)
        cap = 2**20
        # Messages of 8 frames of half the cap each: every frame passes ZeroMQ's cap, the whole message does not
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.linger = 0
        push.connect(eps["trajectory"])
        n_multi = 100
        for _ in range(n_multi):
            push.send_multipart([b"\x00" * (cap // 2)] * 8)
        s = wait_stats(client, lambda s: s["malformed_by_reason"].get("oversize", 0) == n_multi, timeout=120)
        assert s["malformed_by_reason"]["oversize"] == n_multi and proc.poll() is None and within_bound(s0, s)
        push.close()
        # Frames that declare almost the cap and then trickle: each reserves its declared size (ZeroMQ allocates a
        # frame whole at its header), one per connection, which the bound counts per connection
        path = eps["trajectory"][len("ipc://"):]
        slow = []
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(ZMTP_PUSH_GREETING + ZMTP_PUSH_READY + b"\x02" + (cap - 64).to_bytes(8, "big") + b"\x01" * 16)
            slow.append(sock)
        s = wait_stats(client, lambda s: s["metrics"]["buffer/trajectory_connections"] >= 20, timeout=60)
        assert s["metrics"]["buffer/memory_bound_bytes"] >= cfg.buffer.max_bytes + 20 * (
            cfg.transport.trajectory_hwm + 1) * cap
        assert proc.poll() is None and within_bound(s0, s)
        s = honest_group_is_trained(cfg, run_dir, eps, client)             # served while the frames trickle
        for sock in slow:                                                    # the frames end: garbage, counted
            sock.sendall(b"\x01" * (cap - 64 - 16))
        s = wait_stats(client, lambda s: s["ledger"]["malformed"] == n_multi + 20, timeout=60)
        assert s["ledger"]["malformed"] == n_multi + 20 and s["ledger"]["trained"] == 2, s["malformed_by_reason"]
        assert proc.poll() is None and within_bound(s0, s) and s["received"] == sum(s["ledger"].values())
        for sock in slow:
            sock.close()


# ZMTP 3.0 by hand (rfc.zeromq.org/spec/23): a NULL-mechanism greeting and a READY command as a PUSH socket sends
# them, so a test can then write a frame header and its body at its own pace.
ZMTP_PUSH_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH"
ZMTP_PUSH_READY = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY
