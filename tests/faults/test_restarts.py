"""Restarts, without the live system: a learner resumed from an older checkpoint is a new lineage the buffer follows
(the dead learner's later policies are refused as tags outside its history, the batch it was training goes back
untrained, its parked request is answered and never followed again), and a buffer restart (the old ledger is kept
aside; a clean stop takes in what is queued on the socket instead of dropping it)."""

from __future__ import annotations

import json
import time

from test_buffer import RUN, Granted, add_group, make_cfg, make_traj, ready_group_ids
from test_buffer_service import RUN as SVC_RUN
from test_buffer_service import learner_request, running, service_cfg, stats, wait_stats

from async_vla.buffer import GroupBuffer
from async_vla.buffer.service import BufferService
from async_vla.config import write_resolved
from async_vla.messages import ROOT, Lineage, PolicyTag
from async_vla.transport import ControlClient, TrajectorySender

MIXED = (1, 0, 1, 0)
DEAD = Lineage(ROOT).descend("a", 0)    # the learner that dies


def unpaced(**buffer):
    """These tests hold groups beyond what pacing would grant (their actors were granted before): pacing off."""
    return make_cfg(pacing=False, **buffer)


def trained_up_to(buf: GroupBuffer, g: Granted, last: int) -> None:
    """Versions 0..last of learner DEAD, each consuming one batch of B=1 fresh group."""
    for v in range(last + 1):
        add_group(buf, g[f"g{v}"], MIXED, bv=max(0, v - 1), lineage="a")
        assert buf.take_batch(v, lineage=DEAD) is not None


def test_buffer_follows_a_learner_resumed_from_an_older_checkpoint():
    journal: list = []
    buf = GroupBuffer.from_config(unpaced(groups_per_batch=1, max_staleness=1), RUN,
                                  journal=lambda t, m: journal.append(m))
    g = Granted(buf)
    trained_up_to(buf, g, 5)                     # batches 0..5 formed; the one of version 5 (g5, a:v4) still held
    buf.add(make_traj(g["p"], 0, True, bv=4, lineage="a"))    # assembling, sampled with the dead learner's v4
    buf.add(make_traj(g["q"], 0, True, bv=3, lineage="a"))    # assembling, v3: the checkpoint's own policy so far
    late = g["late"]                             # granted to an actor holding a:v5, which sends after the resume
    assert buf.ledger["trained"] == 24
    capacity = buf.admission.capacity()
    # Killed while training batch 5, resumed from its checkpoint at version 3: a new lineage descending from a:v3.
    resumed = DEAD.descend("b", 3)
    assert buf.take_batch(3, lineage=resumed) is None
    assert buf.version == 3 and buf.rollbacks[-1]["from"] == 5 and buf.rollbacks[-1]["to"] == 3
    # Following it keeps the credit of the batches consumed; the two groups refused below free their slots.
    assert buf.admission.capacity() == capacity + 2
    # a:v4 and a:v5 are outside b's history: batch 5 (g5, a:v4) is not trained again and "p" is refused, both as
    # "ahead" - trained by the resumed learner at version 3 they would have had a lag of -1.
    assert buf.ledger["ahead"] == 5 and buf.ledger["trained"] == 20 and buf.group_counts["ahead"] == 2
    assert buf.add(make_traj(g["p"], 1, False, bv=4, lineage="a")) == "ahead"   # a straggler of a refused group
    assert buf.add(make_traj(g["q"], 1, False, bv=4, lineage="a")) == "ahead"   # a dead member: its whole group goes
    assert buf.add(make_traj(late, 0, True, bv=5, lineage="a")) == "ahead"      # sampled by the dead v5, after
    assert buf.ledger["ahead"] == 9 and buf.ledger["pending"] == 0
    # Actors holding the dead learner's later weights get nothing until they load b's; a:v3 is b's history.
    assert buf.grant(7, 1, tag=PolicyTag("a", 5)) == [] and buf.grants_refused["dead"] == 1
    (gid,) = buf.grant(8, 1, tag=PolicyTag("a", 3))
    add_group(buf, gid, MIXED, bv=3, lineage="a", actor_id=8)
    assert buf.take_batch(3, lineage=resumed)[1][0][0].group_id == gid
    assert buf.take_batch(4, lineage=resumed) is None     # the resumed learner reaches v4 ...
    (gid4,) = buf.grant(8, 1, tag=PolicyTag("b", 4))       # ... and publishes it
    add_group(buf, gid4, MIXED, bv=4, lineage="b", actor_id=8)
    assert buf.take_batch(4, lineage=resumed)[1][0][0].group_id == gid4
    assert buf.take_batch(4, lineage=resumed)[1][0][0].group_id == gid4   # a repeated request: the same batch
    assert buf.ledger["stale"] == 0 and buf.ledger["trained"] == 28 and buf.ledger["pending"] == 0
    assert min(buf.lag_histogram) >= 0 and max(buf.lag_histogram) <= 1 and sum(buf.lag_histogram.values()) == 28
    buf.check_invariants()
    replayed = GroupBuffer.from_config(unpaced(groups_per_batch=1, max_staleness=1), RUN)
    for m in journal:
        replayed.apply_journal(m)                # "j.learner" and per-actor "j.grant" are journaled
    assert replayed.ledger == buf.ledger and replayed.version == buf.version == 4
    assert replayed.lag_histogram == buf.lag_histogram


def test_resumed_at_the_same_version_gets_the_same_batch():
    buf = GroupBuffer.from_config(unpaced(groups_per_batch=1, max_staleness=1), RUN)
    trained_up_to(buf, Granted(buf), 2)
    first = buf.take_batch(2, lineage=DEAD)               # the learner took batch 2, then died before its step
    assert buf.take_batch(2, lineage=DEAD) == first       # a retry of the same learner: the same answer
    again = buf.take_batch(2, lineage=DEAD.descend("b", 2))   # resumed from the checkpoint at version 2
    assert again[0] == first[0] and buf.ledger["trained"] == 12   # the same batch, counted once
    assert [(r["from"], r["to"]) for r in buf.rollbacks] == [(2, 2)]


def test_two_ranks_of_a_resumed_learner_are_followed_once():
    # Two ranks (B=2, one group each) of learner "a" trained up to version 3 and published v4; they die before
    # asking for batch 4. Resumed from the checkpoint at version 3, both ranks ask for version 3 as lineage "b".
    buf = GroupBuffer.from_config(unpaced(groups_per_batch=2, max_staleness=1), RUN)
    g = Granted(buf)
    for v in range(4):
        for k in range(2):
            add_group(buf, g[f"g{v}{k}"], MIXED, bv=max(0, v - 1), lineage="a")
        assert all(buf.take_batch(v, r, 2, lineage=DEAD) is not None for r in range(2))
    add_group(buf, g["dead"], MIXED, bv=4, lineage="a")   # sampled with the dead learner's v4: complete, held
    add_group(buf, g["live"], MIXED, bv=3, lineage="a")
    resumed = DEAD.descend("b", 3)
    first = [buf.take_batch(3, r, 2, lineage=resumed) for r in range(2)]
    assert len(buf.rollbacks) == 1 and buf.rollbacks[-1]["to"] == 3   # once, not per rank
    assert [f[0] for f in first] == [3, 3]            # batch 3 (formed at that very version) served again
    assert buf.ledger["ahead"] == 4 and ready_group_ids(buf) == [g["live"]]
    assert buf.grant(9, 1, tag=PolicyTag("a", 4)) == [] and buf.grants_refused["dead"] == 1
    assert all(buf.take_batch(3, r, 2, lineage=resumed)[0] == 3 for r in range(2))      # retries: nothing new
    assert len(buf.rollbacks) == 1
    buf.check_invariants()


def test_the_dead_learners_parked_request_is_answered_and_never_followed_again(tmp_path):
    with running(tmp_path, service_cfg(groups_per_batch=2)) as svc:
        dead, resumed = ControlClient(svc.batch_endpoint), ControlClient(svc.batch_endpoint)
        control = ControlClient(svc.control_endpoint)
        dead.send(learner_request(tmp_path, rank=0, world=1, version=5, timeout_s=60, lineage=DEAD.encode()))   # parked
        wait_stats(control, lambda s: s["metrics"]["buffer/parked_requests"] == 1)
        resumed.send(learner_request(tmp_path, rank=0, world=1, version=3, timeout_s=0.5,
                                  lineage=DEAD.descend("b", 3).encode()))
        assert not resumed.recv_bundle(10)[0].ready          # b's own, after its 0.5 s
        sender = TrajectorySender(svc.trajectory_endpoint)
        assert sender.send(make_traj("x", 0, True, G=2, run_id=SVC_RUN, lineage="b"), timeout_s=5)
        header, _ = dead.recv_bundle(10)                     # retried on new data: a's request is refused
        assert header is not None and not header.ready and header.version == 5
        s = wait_stats(control, lambda s: s["metrics"]["buffer/parked_requests"] == 0)
        assert s["metrics"]["buffer/parked_requests"] == 0   # answered once, and gone
        assert s["learner_version"] == 3 and s["service"]["bad_batch_requests"] == 1
        assert [r["to"] for r in s["rollbacks"]] == [3]      # a is never followed again
        dead.send(learner_request(tmp_path, rank=0, world=1, version=6, timeout_s=60, lineage=DEAD.encode()))
        assert not dead.recv_bundle(10)[0].ready and stats(control)["learner_version"] == 3
        sender.close(flush_s=0)
        for c in (dead, resumed, control):
            c.close()


def test_buffer_restart_keeps_the_old_ledger_and_drains_its_socket(tmp_path):
    cfg = service_cfg()
    write_resolved(cfg, tmp_path)
    svc = BufferService(cfg, tmp_path, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                        valid_task_ids=[0])
    sender = TrajectorySender(svc.trajectory_endpoint)
    (q,) = svc.buffer.grant(0, 1)
    for i in range(3):                               # queued on the socket; the service never served
        assert sender.send(make_traj(q, i, i % 2 == 0, G=4, run_id=SVC_RUN), timeout_s=5)
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
