"""Restarts, without the live system: a learner resumed from an older checkpoint (the buffer follows it back, the dead
learner's parked request is voided, a batch already formed at the resumed version is served again), and a buffer
restart (the old ledger is kept aside; a clean stop takes in what is queued on the socket instead of dropping it)."""

from __future__ import annotations

import json
import time

from test_buffer import RUN, add_group, make_cfg, make_traj
from test_buffer_service import RUN as SVC_RUN
from test_buffer_service import running, service_cfg, stats, wait_stats

from async_vla.buffer import GroupBuffer
from async_vla.buffer.service import BufferService
from async_vla.config import write_resolved
from async_vla.messages import BatchRequest, ControlCommand
from async_vla.transport import ControlClient, TrajectorySender
from timing import slack

MIXED = (1, 0, 1, 0)


def trained_up_to(buf: GroupBuffer, last: int) -> None:
    """Versions 0..last, each consuming one batch of B=1 fresh group."""
    for v in range(last + 1):
        add_group(buf, f"g{v}", MIXED, bv=max(0, v - 1))
        assert buf.next_batch(v) is not None


def test_buffer_follows_a_learner_resumed_from_an_older_checkpoint():
    journal: list = []
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, max_staleness=1), RUN,
                                  journal=lambda t, m: journal.append(m))
    trained_up_to(buf, 5)                        # batches 0..5 formed; the one of version 5 (g5, bv 4) still held
    buf.add(make_traj("p", 0, True, bv=4))       # assembling, sampled with the dead learner's v4
    buf.add(make_traj("q", 0, True, bv=3))       # assembling, v3: the checkpoint's own policy so far
    assert buf.ledger["trained"] == 24
    capacity = buf.pacing_capacity()
    # Killed while training batch 5, resumed from its checkpoint at version 3: the first request is for version 3.
    assert buf.next_batch(3) is None
    assert buf.version == 3 and buf.rollbacks[-1]["from"] == 5 and buf.rollbacks[-1]["to"] == 3
    # The rollback keeps the credit of the batches consumed; the two groups refused below free their slots.
    assert buf.pacing_capacity() == capacity + 2
    # Versions 4 and 5 died with the learner: batch 5 (g5, bv 4) is not trained again and "p" is refused, both
    # as "ahead" - trained by the resumed learner at version 3 they would have had a lag of -1.
    assert buf.ledger["ahead"] == 5 and buf.ledger["trained"] == 20 and buf.group_counts["ahead"] == 2
    assert buf.add(make_traj("p", 1, False, bv=4)) == "ahead"       # a straggler of a refused group
    assert buf.add(make_traj("q", 1, False, bv=4)) == "ahead"       # a dead-weights member: its whole group goes
    assert buf.add(make_traj("late", 0, True, bv=5)) == "ahead"     # sampled by the dead v5, arriving after
    assert buf.ledger["ahead"] == 9 and buf.ledger["pending"] == 0
    # Actors holding the dead learner's weights get nothing until they catch up; those at <= 3 are served.
    assert buf.grant(7, 1, actor_version=5) == [] and buf.grants_refused_ahead == 1
    (gid,) = buf.grant(8, 1, actor_version=3)
    add_group(buf, gid, MIXED, bv=3)
    assert buf.next_batch(3)[0][0].group_id == gid
    assert buf.next_batch(4) is None                     # the resumed learner reaches v4 ...
    (gid4,) = buf.grant(8, 1, actor_version=4)           # ... so its v4 is the live policy now
    add_group(buf, gid4, MIXED, bv=4)
    assert buf.next_batch(4)[0][0].group_id == gid4
    assert buf.next_batch(4)[0][0].group_id == gid4      # a repeated request: the same batch, counted once
    assert buf.ledger["stale"] == 0 and buf.ledger["trained"] == 28 and buf.ledger["pending"] == 0
    assert min(buf.lag_histogram) >= 0 and max(buf.lag_histogram) <= 1 and sum(buf.lag_histogram.values()) == 28
    buf.check_invariants()
    replayed = GroupBuffer.from_config(make_cfg(groups_per_batch=1, max_staleness=1), RUN)
    for m in journal:
        replayed.apply_journal(m)                # "j.rollback" and per-actor "j.grant" are journaled
    assert replayed.ledger == buf.ledger and replayed.version == buf.version == 4
    assert replayed.lag_histogram == buf.lag_histogram


def test_resumed_at_the_same_version_gets_the_same_batch():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, max_staleness=1), RUN)
    trained_up_to(buf, 2)
    first = buf.take_batch(2)                     # the learner took batch 2, then died before its step
    again = buf.take_batch(2)                     # resumed from the checkpoint at version 2
    assert again[0] == first[0] and buf.rollbacks == [] and buf.ledger["trained"] == 12   # counted once


def test_two_ranks_resumed_at_the_buffers_own_version_are_told_by_their_session():
    # Two ranks (B=2, one group each) of learner start "a" trained up to version 3 and published v4; they die before
    # asking for batch 4. Resumed from the checkpoint at version 3, their ranks (one new session "b", agreed
    # among themselves: Learner.session_id) ask for version 3 again: the version alone says nothing new.
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=2, max_staleness=1), RUN)
    for v in range(4):
        for k in range(2):
            add_group(buf, f"g{v}{k}", MIXED, bv=max(0, v - 1))
        assert all(buf.take_batch(v, r, 2, session="a") is not None for r in range(2))
    add_group(buf, "dead", MIXED, bv=4)                # sampled with the dead learner's v4: complete, held
    add_group(buf, "live", MIXED, bv=3)
    first = [buf.take_batch(3, r, 2, session="b") for r in range(2)]
    assert buf.rollbacks and buf.rollbacks[-1]["to"] == 3 and len(buf.rollbacks) == 1   # once, not per rank
    assert [f[0] for f in first] == [3, 3]            # batch 3 (formed at that very version) served again
    assert buf.ledger["ahead"] == 4 and "dead" not in buf.ready_group_ids()
    assert buf.grant(9, 1, actor_version=4) == [] and buf.grants_refused_ahead == 1
    assert all(buf.take_batch(3, r, 2, session="b")[0] == 3 for r in range(2))           # retries: no new rollback
    assert len(buf.rollbacks) == 1
    buf.check_invariants()


def test_the_dead_learners_parked_request_is_voided(tmp_path):
    with running(tmp_path, service_cfg(groups_per_batch=2)) as svc:
        dead, resumed = ControlClient(svc.batch_endpoint), ControlClient(svc.batch_endpoint)
        control = ControlClient(svc.control_endpoint)
        assert control.call(ControlCommand("set_learner_version", 5), 10).value == 5
        dead.send(BatchRequest(rank=0, world=1, version=5, timeout_s=60))   # parked: no data (then "killed")
        parked = wait_stats(control, lambda s: s["metrics"]["buffer/parked_requests"] == 1)  # before it arrives
        assert parked["metrics"]["buffer/parked_requests"] == 1, parked["metrics"]
        t0 = time.monotonic()
        resumed.send(BatchRequest(rank=0, world=1, version=3, timeout_s=0.5))
        header, _ = dead.recv_bundle(10)               # answered at once, not after 60 s
        assert not header.ready and header.version == 5 and time.monotonic() - t0 < min(slack(5), 50)   # not 60 s
        assert not resumed.recv_bundle(10)[0].ready
        s = stats(control)
        assert s["learner_version"] == 3 and s["service"]["parked_voided"] == 1
        assert s["service"]["learner_rollbacks"] == 1 and s["rollbacks"][-1]["to"] == 3
        for c in (dead, resumed, control):
            c.close()


def test_a_dead_sessions_request_at_the_resumed_version_is_answered_once_and_unparked(tmp_path):
    # Learner session "a" asks for batch 5 and dies; its successor "b" resumes at the same version 5. a's request
    # is void: one not-ready reply, and it must leave the parked list (served later, it would switch the buffer
    # back to the dead session and roll it back again, and its peer would get a second reply).
    with running(tmp_path, service_cfg(groups_per_batch=2)) as svc:
        dead, resumed = ControlClient(svc.batch_endpoint), ControlClient(svc.batch_endpoint)
        control = ControlClient(svc.control_endpoint)
        assert control.call(ControlCommand("set_learner_version", 5), 10).value == 5
        dead.send(BatchRequest(rank=0, world=1, version=5, timeout_s=60, session="a"))
        wait_stats(control, lambda s: s["metrics"]["buffer/parked_requests"] == 1)
        resumed.send(BatchRequest(rank=0, world=1, version=5, timeout_s=0.5, session="b"))
        header, _ = dead.recv_bundle(10)
        assert header is not None and not header.ready and header.version == 5
        assert not resumed.recv_bundle(10)[0].ready          # b's own, after its 0.5 s
        s = wait_stats(control, lambda s: s["metrics"]["buffer/parked_requests"] == 0)
        assert s["metrics"]["buffer/parked_requests"] == 0   # a's is gone too: nothing left to answer it twice
        assert s["service"]["parked_voided"] == 1 and s["service"]["learner_rollbacks"] == 1
        for c in (dead, resumed, control):
            c.close()


def test_buffer_restart_keeps_the_old_ledger_and_drains_its_socket(tmp_path):
    cfg = service_cfg()
    write_resolved(cfg, tmp_path)
    svc = BufferService(cfg, tmp_path, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                        valid_task_ids=[0])
    sender = TrajectorySender(svc.trajectory_endpoint)
    for i in range(3):                               # queued on the socket; the service never served
        assert sender.send(make_traj("q", i, i % 2 == 0, G=4, run_id=SVC_RUN), timeout_s=5)
    time.sleep(0.5)
    svc.close()                                      # clean stop: takes them in, then writes the ledger
    sender.close(flush_s=0)
    first = json.loads((tmp_path / "ledger.json").read_text())
    assert first["received"] == 3 and first["ledger"]["pending"] == 3 and first["service"]["drained_at_stop"] == 3
    with running(tmp_path, cfg) as svc2:
        client = ControlClient(svc2.control_endpoint)
        assert stats(client)["received"] == 0
        client.close()
    assert json.loads((tmp_path / "ledger-1.json").read_text()) == first
    second = json.loads((tmp_path / "ledger.json").read_text())
    assert second["previous_ledger"] == "ledger-1.json" and second["received"] == 0
