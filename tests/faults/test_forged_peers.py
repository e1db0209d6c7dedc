"""Peers that pretend to be someone else, against ``bin/buffer`` as its own process (issue 42): batch requests
without the learner's credential (async_vla/learner_secret.py). Each test asserts the process stays up, the hostile
input is counted by reason and moves nothing, and an honest actor's next group is granted and trained (the honest
learner is a real ``BatchClient``, signing with the run's secret)."""

from __future__ import annotations

import pytest
from buffer_process import live_buffer
from test_buffer import make_traj
from test_buffer_service import stats, wait_stats

from async_vla.buffer.client import BatchClient
from async_vla.learner_secret import sign
from async_vla.messages import ROOT, BatchRequest, GrantRequest, Lineage, PolicyTag
from async_vla.transport import ControlClient, TrajectorySender

RUN = "forged"
OVERRIDES = ["transport.use_ipc=true", "buffer.groups_per_batch=1", "buffer.max_staleness=1",
             "env.task_ids=[0]", "learner.batch_timeout_s=5"]
HONEST = Lineage("honest", (PolicyTag(ROOT, 0),))


def honest_group_is_trained(cfg, run_dir, eps, client, actor_id: int = 5, version: int = 0) -> dict:
    """An honest actor asks for a group, sends its 2 members, and the honest learner (BatchClient) trains it at
    ``version``; returns the stats after, with the group's members asserted "trained"."""
    grant = client.call(GrantRequest(actor_id=actor_id, want=1), 10)
    assert len(grant.group_ids) == 1 and not grant.error and grant.refused == ""
    (gid,) = grant.group_ids
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
        victim = client.call(GrantRequest(actor_id=5, want=1), 10)          # an honest actor's open group
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
def test_made_up_actor_ids_cannot_churn_out_an_actor_holding_a_grant(tmp_path):
    from async_vla.buffer.service import MAX_ACTORS_TRACKED
    from async_vla.messages import Heartbeat

    with live_buffer(tmp_path, RUN, OVERRIDES) as (cfg, run_dir, eps, client, proc):
        (gid,) = client.call(GrantRequest(actor_id=5, want=1), 10).group_ids
        sender = TrajectorySender(eps["trajectory"])
        assert sender.send(make_traj(gid, 0, True, G=2, run_id=RUN, actor_id=5), timeout_s=10)   # half-finished
        wait_stats(client, lambda s: s["ledger"]["pending"] == 1)
        churn = ControlClient(eps["control"])
        fakes = MAX_ACTORS_TRACKED + 1000
        for k in range(fakes):                     # made-up ids, each newer than the honest actor's last word
            assert churn.send(Heartbeat(actor_id=10_000 + k), timeout_s=10)
        s = wait_stats(client, lambda s: s["service"].get("actors_forgotten") == fakes + 1 - MAX_ACTORS_TRACKED,
                       timeout=120)
        # every fake was tracked and the oldest idle ones forgotten; the honest actor, older than all, stays
        assert s["service"].get("actors_forgotten") == fakes + 1 - MAX_ACTORS_TRACKED, s["metrics"]
        assert proc.poll() is None and "groups_reclaimed" not in s["service"] and s["groups_in_flight"] == 1
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
        assert s["ledger"]["trained"] == 2 and s["ledger"]["expired_partial"] == 0
        assert s["received"] == sum(s["ledger"].values())
