"""Unit tests of GroupBuffer: assembly, duplicates, expiry, filters, staleness, pacing, batches, reuse, ledger."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from async_vla.buffer import STATES, GroupBuffer
from async_vla.config import ActorConfig, BufferConfig, Config, EnvConfig
from async_vla.messages import ROOT, Lineage, PolicyTag, Trajectory, decode, encode

RUN = "run"


def make_cfg(**buffer) -> Config:
    """A Config whose buffer section has the given fields (everything else default)."""
    return Config(buffer=BufferConfig(**buffer))


def make_traj(group_id: str, i: int, success: bool, bv: int = 0, G: int = 4, run_id: str = RUN, task_id: int = 0,
              init_state_id: int = 0, calls: int = 1, image: int = 8, tokens: int = 7, traj_id=None,
              lineage: str = ROOT, actor_id: int = 0) -> Trajectory:
    """A small valid trajectory (member ``i`` of ``group_id``) whose chunk versions all equal ``bv``, sampled by
    learner ``lineage``'s policies."""
    rng = np.random.default_rng(zlib.crc32(f"{group_id}/{i}".encode()))  # same every run (hash() is salted)
    return Trajectory(
        run_id=run_id, actor_id=actor_id, group_id=group_id, traj_id=traj_id or f"{group_id}-t{i}", task_id=task_id,
        init_state_id=init_state_id, instruction="pick", behaviour_version=bv, success=bool(success),
        reward=float(success), env_steps=10, t_start=0.0, t_end=1.0, group_size=G,
        chunk_versions=np.full(calls, bv, np.int64),
        images=rng.integers(0, 255, (calls, image, image, 3), dtype=np.uint8),
        proprio=np.zeros((calls, 8), np.float32),
        action_tokens=rng.integers(31744, 32000, (calls, tokens)).astype(np.int64),
        behav_logprobs=-rng.random((calls, tokens), dtype=np.float32),
        token_mask=np.ones((calls, tokens), bool), lineage=lineage)


class FakeClock:
    """Settable clock for expiry tests."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Granted(dict):
    """Test names -> group ids ``buf`` granted to ``actor`` (on a name's first use): only a granted group takes
    trajectories, and only from the actor it was granted to."""

    def __init__(self, buf: GroupBuffer, actor: int = 0):
        super().__init__()
        self.buf, self.actor = buf, actor

    def __missing__(self, name: str) -> str:
        ids = self.buf.grant(self.actor, 1)
        assert ids, f"group {name!r}: nothing granted (pacing, memory or max_groups_per_actor)"
        self[name] = ids[0]
        return ids[0]

    def name(self, gid: str) -> str:
        return next(n for n, g in self.items() if g == gid)


def add_group(buf: GroupBuffer, gid: str, pattern, bv: int = 0, **kw) -> list[str]:
    """Add a whole group; ``pattern`` = successes, G = len(pattern). Returns the states add() reported."""
    return [buf.add(make_traj(gid, i, s, bv=bv, G=len(pattern), **kw)) for i, s in enumerate(pattern)]


def ready_group_ids(buf: GroupBuffer) -> list[str]:
    """Untrained admitted groups waiting for a batch, in queue order (group ids from make_traj's traj ids)."""
    ready = (t for t, where in buf.in_flight().items() if where == "ready")
    return list(dict.fromkeys(t.rsplit("-t", 1)[0] for t in ready))


MIXED = (1, 0, 1, 0)


def test_assembly_streams_interleaved_groups():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=2), RUN)
    g = Granted(buf)
    a = [make_traj(g["a"], i, s) for i, s in enumerate(MIXED)]
    b = [make_traj(g["b"], i, s) for i, s in enumerate((0, 0, 1, 1))]
    for t in (a[3], b[0], a[0], b[2], a[1]):
        assert buf.add(t) == "pending"
    assert buf.ready_groups == 0 and buf.groups_in_flight == 2
    buf.add(a[2])
    assert ready_group_ids(buf) == [g["a"]] and buf.groups_in_flight == 1
    buf.add(b[1]), buf.add(b[3])
    assert ready_group_ids(buf) == [g["a"], g["b"]]
    groups = buf.next_batch(0)
    assert [len(g) for g in groups] == [4, 4]
    assert {t.traj_id for t in groups[0]} == {t.traj_id for t in a}
    assert buf.ledger["trained"] == 8 and buf.ledger["pending"] == 0
    buf.check_invariants()


def test_group_size_comes_from_trajectory():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1), RUN)
    g = Granted(buf)
    add_group(buf, g["g2"], (1, 0))
    add_group(buf, g["g3"], (1, 0, 0))
    assert ready_group_ids(buf) == [g["g2"], g["g3"]]


def test_duplicates_and_stragglers():
    buf = GroupBuffer.from_config(make_cfg(), RUN)
    (gid,) = buf.grant(0, 1)
    t0 = make_traj(gid, 0, True)
    assert buf.add(t0) == "pending"
    assert buf.add(make_traj(gid, 0, True)) == "duplicate"        # same traj id while assembling
    for i, s in enumerate(MIXED[1:], 1):
        buf.add(make_traj(gid, i, s))
    assert buf.add(make_traj(gid, 2, True)) == "duplicate"        # same traj id after completion
    assert buf.add(make_traj(gid, 9, True)) == "malformed"        # a fifth distinct member
    assert buf.malformed_by_reason["group_overfull"] == 1
    assert buf.ledger["duplicate"] == 2 and buf.ledger["pending"] == 4
    buf.check_invariants()


def test_validation_reasons():
    buf = GroupBuffer.from_config(make_cfg(), RUN, valid_task_ids=[0, 1])
    g = Granted(buf)
    assert buf.add(make_traj(g["g"], 0, True, run_id="other")) == "malformed"
    assert buf.add(make_traj(g["g"], 0, True, task_id=7)) == "malformed"
    buf.add(make_traj(g["h"], 0, True))
    assert buf.add(make_traj(g["h"], 1, True, init_state_id=3)) == "malformed"   # not the same init state
    assert buf.add(make_traj(g["h"], 2, True, G=5)) == "malformed"               # disagrees on G
    bad = make_traj(g["k"], 0, True)
    bad.action_tokens[0, 0] = 5                                                # not an action token id
    assert buf.add(bad) == "malformed"
    padded = make_traj(g["k"], 1, True)
    padded.action_tokens[0, -1], padded.token_mask[0, -1] = 5, False          # padding may hold anything
    assert buf.add(padded) == "pending"
    buf.count_malformed("msgpack")
    assert dict(buf.malformed_by_reason) == {"wrong_run": 1, "unknown_task": 1, "group_mismatch": 2, "msgpack": 1,
                                             "bad_action_token": 1}
    assert buf.received == 8 and buf.ledger["malformed"] == 6 and buf.ledger["pending"] == 2
    buf.check_invariants()


def test_expiry_of_partial_and_granted_groups():
    clock = FakeClock()
    buf = GroupBuffer.from_config(make_cfg(group_timeout_s=10.0, groups_per_batch=2, max_staleness=0), RUN, clock=clock)
    (gid,) = buf.grant(actor_id=3, want=1)
    (p,) = buf.grant(actor_id=4, want=1)
    assert buf.admission.capacity() == 0
    buf.add(make_traj(p, 0, True, actor_id=4))
    clock.t = 5.0
    buf.add(make_traj(p, 1, False, actor_id=4))      # activity resets the partial group's age
    clock.t = 12.0
    assert buf.expire() == 0               # the granted, empty group expires (no trajectories) ...
    assert buf.groups_in_flight == 1 and buf.group_counts["expired_empty"] == 1
    clock.t = 15.5
    assert buf.expire() == 2               # ... the partial one 10 s after its last member
    assert buf.ledger["expired_partial"] == 2
    assert buf.add(make_traj(p, 2, True, actor_id=4)) == "expired_partial"   # a straggler of an expired group
    assert buf.add(make_traj(p, 1, True, actor_id=4)) == "duplicate"
    assert buf.admission.capacity() == 2      # both slots freed
    buf.check_invariants()


def test_dynamic_sampling_and_difficulty_mask():
    buf = GroupBuffer.from_config(make_cfg(), RUN)
    g = Granted(buf)
    assert add_group(buf, g["u1"], (1, 1, 1, 1))[-1] == "filtered_uniform"
    assert add_group(buf, g["u0"], (0, 0, 0, 0))[-1] == "filtered_uniform"
    assert add_group(buf, g["m"], MIXED)[-1] == "pending"
    off = GroupBuffer.from_config(make_cfg(dynamic_sampling=False), RUN)
    add_group(off, Granted(off)["u1"], (1, 1, 1, 1))
    assert off.ready_groups == 1
    mask = GroupBuffer.from_config(make_cfg(dynamic_sampling=False, difficulty_mask=(0.3, 0.8)), RUN)
    m = Granted(mask)
    assert add_group(mask, m["r25"], (1, 0, 0, 0))[-1] == "filtered_difficulty"
    assert add_group(mask, m["r100"], (1, 1, 1, 1))[-1] == "filtered_difficulty"
    assert add_group(mask, m["r50"], (1, 1, 0, 0))[-1] == "pending"
    assert add_group(mask, m["r75"], (1, 1, 1, 0))[-1] == "pending"
    assert mask.ledger["filtered_difficulty"] == 8
    for b in (buf, off, mask):
        b.check_invariants()


def test_staleness_at_completion_and_at_batch_time():
    buf = GroupBuffer.from_config(make_cfg(max_staleness=2, groups_per_batch=1), RUN)
    buf.set_learner_version(5)
    g = Granted(buf)
    assert add_group(buf, g["old"], MIXED, bv=2)[-1] == "stale"        # lag 3 > 2
    assert add_group(buf, g["ok"], MIXED, bv=3)[-1] == "pending"       # lag 2
    assert buf.admission.accepted == 1
    buf.set_learner_version(6)                                      # now lag 3: dropped while waiting
    assert buf.ready_groups == 0 and buf.ledger["stale"] == 8 and buf.admission.accepted == 0
    add_group(buf, g["mixed_versions"], MIXED, bv=4)
    buf.add(make_traj(g["late"], 0, True, bv=6, G=2))
    buf.add(make_traj(g["late"], 1, False, bv=3, G=2))                 # oldest member decides: lag 3
    assert buf.ledger["stale"] == 10
    assert buf.next_batch(6) is not None
    assert buf.lag_histogram == {2: 4}
    buf.check_invariants()


def test_pacing_arithmetic():
    B, eta = 2, 1
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=B, max_staleness=eta), RUN)
    ids = buf.grant(0, want=10)
    assert len(ids) == (eta + 0 + 1) * B == 4 and len(set(ids)) == 4
    assert [gid.split("-")[2] for gid in ids] == ["g0", "g1", "g2", "g3"]    # the counter actors cycle tasks by
    assert all(len(gid.split("-")[1]) == 32 for gid in ids)                     # and 128 random bits each
    assert buf.grant(1, want=1) == []
    add_group(buf, ids[0], (1, 1, 1, 1))          # filtered: not accepted, its slot returns
    assert len(buf.grant(1, want=5)) == 1
    add_group(buf, ids[1], MIXED)
    add_group(buf, ids[2], MIXED)                 # running 2 (g3, g4), accepted 2
    assert buf.admission.capacity() == 4 - 2 - 2 == 0
    assert buf.next_batch(0) is not None          # consumed, but v is still 0: accepted stays counted
    assert buf.grant(0) == []
    buf.set_learner_version(1)                    # (1 + 1 + 1) * 2 - 2 - 2 = 2
    assert buf.admission.capacity() == 2 and len(buf.grant(0, want=3)) == 2
    buf.set_max_staleness(3)                      # live eta change: the next grant sees it
    assert buf.admission.capacity() == (3 + 1 + 1) * B - 4 - 2 == 4
    assert buf.metrics()["buffer/max_staleness"] == 3.0 and buf.admission.eta_changes[-1]["new"] == 3
    with pytest.raises(ValueError):
        buf.set_max_staleness(-1)
    with pytest.raises(ValueError, match="max_staleness_limit"):
        buf.set_max_staleness(buf.cfg.max_staleness_limit + 1)
    unpaced = GroupBuffer.from_config(make_cfg(pacing=False, max_groups_per_actor=64), RUN)
    assert len(unpaced.grant(0, want=50)) == 50
    assert len(unpaced.grant(0, want=50)) == 14 and unpaced.grants_capped == 1   # 64 open per actor at most


def test_each_live_identity_keeps_its_fair_share_of_the_pacing_budget():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=2, max_staleness=3, max_groups_per_actor=8), RUN)
    assert buf.admission.capacity() == (3 + 0 + 1) * 2 == 8
    assert len(buf.grant(1, want=8, identities=4)) == 2            # 4 live actors: 8 // 4 each
    assert buf.grant(1, want=8, identities=4) == [] and buf.grants_refused["share"] == 2
    assert [len(buf.grant(a, want=8, identities=4)) for a in (2, 3)] == [2, 2]
    assert len(buf.grant(4, want=1, identities=4)) == 1            # the last one's share is still there
    assert len(buf.grant(4, want=8, identities=4)) == 1 and buf.admission.capacity() == 0
    assert len(buf.grant(5, want=8, identities=1)) == 0            # a share, never more than the budget
    alone = GroupBuffer.from_config(make_cfg(groups_per_batch=2, max_staleness=3, max_groups_per_actor=8), RUN)
    assert len(alone.grant(1, want=8)) == 8 and alone.grants_refused["share"] == 0   # one identity: all of it
    crowd = GroupBuffer.from_config(make_cfg(groups_per_batch=2, max_staleness=3, max_groups_per_actor=8), RUN)
    assert [len(crowd.grant(a, want=8, identities=100)) for a in range(10)] == [1] * 8 + [0, 0]   # at least 1


def test_pacing_counts_from_resumed_learner_version():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=2, max_staleness=0), RUN)
    buf.set_learner_version(57)                   # resumed learner, no batch formed yet: v_rel = 0
    assert buf.admission.capacity() == 2
    ids = buf.grant(0, want=2)
    for gid in ids:
        add_group(buf, gid, MIXED, bv=57)
    assert buf.next_batch(57) is not None
    buf.set_learner_version(58)
    assert buf.admission.capacity() == (0 + 1 + 1) * 2 - 0 - 2 == 2


def test_no_grant_to_an_actor_whose_policy_is_too_old():
    # Its trajectories would be dropped as stale on arrival: refuse (counted) until it has newer weights.
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=2, max_staleness=1), RUN)
    buf.set_learner_version(5)
    assert buf.grant(0, want=1, tag=PolicyTag(ROOT, 3)) == [] and buf.grants_refused["behind"] == 1
    assert len(buf.grant(0, want=1, tag=PolicyTag(ROOT, 4))) == 1          # lag 1 <= eta: fine
    assert len(buf.grant(0, want=1)) == 1                           # version unknown (old clients): not refused
    assert buf.metrics()["buffer/grants_refused_behind"] == 1.0
    assert buf.ledger_snapshot()["grants_refused_behind"] == 1


def test_an_actor_holding_the_learners_next_version_is_judged_at_it():
    # The race: the learner trains batch v0, publishes v1, then asks for batch v1. An actor that took v1 and asks
    # for work before that request arrives is judged at v1 (where pacing has room), not refused for v0's pacing.
    learner = Lineage(ROOT).descend("l", 0)
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, max_staleness=0), RUN)
    assert buf.take_batch(0, lineage=learner) is None
    (gid,) = buf.grant(1, 1, tag=PolicyTag("l", 0))
    add_group(buf, gid, (1, 0), lineage="l", actor_id=1)
    assert buf.take_batch(0, lineage=learner) is not None
    assert buf.grant(1, 1, tag=PolicyTag("l", 0)) == []                  # v0's weights: pacing is full at v0
    (gid1,) = buf.grant(1, 1, tag=PolicyTag("l", 1))                     # v1 is published: judged at v1
    assert buf.grant(2, 1, tag=PolicyTag("l", 2)) == []                  # v2 was never published: proves nothing
    assert buf.grant(2, 1, tag=PolicyTag("x", 1)) == [] and buf.grants_refused["dead"] == 1
    add_group(buf, gid1, (1, 0), bv=1, lineage="l", actor_id=1)
    assert buf.take_batch(0, lineage=learner)[0] == 0                    # it waits for v1 (never a lag < 0) ...
    got = buf.take_batch(1, lineage=learner)
    assert got[1][0][0].group_id == gid1 and buf.lag_histogram == {0: 4}   # ... and is trained at it


def test_grant_stops_when_full():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, max_groups=2, pacing=False), RUN)
    g = Granted(buf)
    add_group(buf, g["a"], MIXED)
    assert buf.has_room()
    add_group(buf, g["b"], MIXED)
    assert not buf.has_room() and buf.grant(0, want=3) == []
    buf.next_batch(0)
    assert buf.has_room()


def test_byte_bound():
    size = make_traj("x", 0, True, image=32).nbytes
    # Groups of 4 one-call trajectories: the config says so, or its start-up check (one batch must fit) would
    # size the batch for its own default episodes and refuse a bound of 10 trajectories.
    cfg = Config(buffer=BufferConfig(groups_per_batch=1, max_bytes=10 * size, pacing=False),
                 env=EnvConfig(max_steps=8, image_size=32), actor=ActorConfig(group_size=4))
    buf = GroupBuffer.from_config(cfg, RUN)
    ids = buf.grant(0, 3)                    # room for 10 trajectories: two groups and half of a third
    n = 0
    while buf.has_room():
        buf.add(make_traj(ids[n // 4], n % 4, n % 2 == 0, image=32))
        n += 1
        assert buf.held_bytes <= buf.cfg.max_bytes
    assert n == buf.cfg.max_bytes // size
    buf.next_batch(0)
    buf.next_batch(1)          # the first batch is released once a newer one forms
    assert buf.has_room()
    buf.check_invariants()


def test_batch_split_across_ranks_is_one_batch():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=4), RUN)
    ids = buf.grant(0, 2) + buf.grant(1, 3)
    for k in range(5):
        add_group(buf, ids[k], MIXED, actor_id=0 if k < 2 else 1)
    bid0, share0 = buf.take_batch(0, rank=0, world=2)
    bid1, share1 = buf.take_batch(0, rank=1, world=2)
    assert bid0 == bid1 == 0
    assert [g[0].group_id for g in share0] == ids[:2] and [g[0].group_id for g in share1] == ids[2:4]
    assert buf.take_batch(0, rank=0, world=2) == (bid0, share0)       # a repeated request: same answer
    assert buf.take_batch(1, rank=1, world=2) is None                 # only g4 left
    with pytest.raises(ValueError):
        buf.take_batch(1, rank=0, world=3)
    assert buf.ledger["trained"] == 16 and buf.ledger["pending"] == 4
    buf.check_invariants()


def test_lifo_order():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, order="lifo"), RUN)
    ids = buf.grant(0, 3)
    for gid in ids:
        add_group(buf, gid, MIXED)
    assert buf.next_batch(0)[0][0].group_id == ids[2]


def test_reuse_trains_twice_counts_once():
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, reuse=2, max_staleness=5), RUN)
    g = Granted(buf)
    add_group(buf, g["a"], MIXED)
    add_group(buf, g["b"], MIXED)
    order = [g.name(buf.next_batch(v)[0][0].group_id) for v in range(4)]
    assert order == ["a", "b", "a", "b"]
    assert buf.next_batch(4) is None
    assert buf.ledger["trained"] == 8
    assert buf.lag_histogram == {0: 4, 1: 4, 2: 4, 3: 4}
    buf.check_invariants()


def test_ledger_metrics_snapshot_and_file(tmp_path):
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1), RUN)
    g = Granted(buf)
    add_group(buf, g["a"], MIXED)
    add_group(buf, g["u"], (1, 1, 1, 1))
    buf.add(make_traj(g["p"], 0, True))
    buf.count_malformed("frame_count")
    buf.next_batch(0)
    assert buf.ledger == {"trained": 4, "filtered_uniform": 4, "filtered_difficulty": 0, "stale": 0,
                          "expired_partial": 0, "duplicate": 0, "malformed": 1, "ahead": 0, "pending": 1}
    assert set(buf.ledger) == set(STATES)
    m = buf.metrics()
    for name in ("received", *STATES, "lag_mean", "lag_max", "groups_in_flight", "held_bytes", "max_staleness"):
        assert f"buffer/{name}" in m
    assert m["buffer/received"] == sum(buf.ledger.values()) == 10
    path = buf.write_ledger(tmp_path)
    snap = json.loads(path.read_text())
    assert snap["ledger"] == buf.ledger and snap["received"] == 10 and snap["lag_histogram"] == {"0": 4}


def test_max_groups_below_batch_is_refused():
    with pytest.raises(ValueError, match="max_groups"):
        GroupBuffer.from_config(make_cfg(groups_per_batch=8, max_groups=4), RUN)


def test_journal_replays_to_same_ledger():
    """Every state-changing input goes to the journal; applying it to a fresh buffer gives the same books."""
    clock = FakeClock()
    log = []
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, group_timeout_s=5.0), RUN, clock=clock,
                      journal=lambda t, m: log.append((t, encode(m))))
    ids = buf.grant(0, want=2)
    add_group(buf, ids[0], MIXED)
    buf.add(make_traj(ids[1], 0, True))
    buf.count_malformed("oversize")
    buf.next_batch(0)
    buf.set_max_staleness(0)
    clock.t = 10.0
    buf.expire()
    buf.add(make_traj(ids[1], 1, True))
    replay_clock = FakeClock()
    fresh = GroupBuffer.from_config(make_cfg(groups_per_batch=1, group_timeout_s=5.0), RUN, clock=replay_clock)
    for t, frames in log:
        replay_clock.t = t
        fresh.apply_journal(decode([bytes(memoryview(f)) for f in frames]))
    assert fresh.ledger_snapshot()["ledger"] == buf.ledger_snapshot()["ledger"]
    assert fresh.group_counts == buf.group_counts and fresh.lag_histogram == buf.lag_histogram


def test_recorder_rotation_bound_and_restart(tmp_path):
    from async_vla.buffer.recording import Recorder, iter_records, recording_info

    rec = Recorder(tmp_path / "recording", file_bytes=1024, max_files=3, meta={"run_id": RUN})
    frames = encode(make_traj("g", 0, True))
    for k in range(20):
        rec.write(float(k), frames)
    rec.close()
    info = recording_info(tmp_path / "recording")
    assert len(info["files"]) == 3 and info["truncated"] and rec.files_deleted > 0
    got = list(iter_records(tmp_path / "recording"))
    assert [t for t, _ in got] == [float(k) for k in range(20 - len(got), 20)]      # the tail survives
    assert decode(got[-1][1]).traj_id == "g-t0"
    Recorder(tmp_path / "recording", file_bytes=1024, max_files=3).close()          # a restart
    assert (tmp_path / "recording-1").is_dir() and not recording_info(tmp_path / "recording")["files"]


def test_a_ledger_subclass_sees_every_trajectory_fate():
    # The ledger is a collaborator told of each transition (what runner/faults/audit.py's Tracer builds on): the
    # fates it sees add up to the buffer's own counts, through filtering, staleness, training and a learner rollback.
    from runner.faults.audit import Tracer

    tracer = Tracer(RUN)
    buf = GroupBuffer.from_config(make_cfg(groups_per_batch=1, max_staleness=1), RUN, ledger=tracer)
    assert buf.books is tracer
    g = Granted(buf)
    add_group(buf, g["uniform"], (1, 1, 1, 1))
    add_group(buf, g["a"], MIXED)
    add_group(buf, g["b"], MIXED)
    assert buf.next_batch(0) is not None                     # "a" trained at version 0
    buf.set_learner_version(1)
    assert buf.next_batch(1) is not None                     # "b" trained at version 1
    resumed = Lineage("b0", (PolicyTag(ROOT, 0),))            # a learner resumed at 0: "b" is pending again
    buf.set_learner_version(0, resumed)
    add_group(buf, g["old"], MIXED, bv=0)
    buf.set_learner_version(2)                               # "old" and "b" (behaviour version 0) now lag 2 > 1
    fates = {g.name(tid.rsplit("-t", 1)[0]): state for tid, (state, _) in tracer.fate.items()}
    assert fates == {"uniform": "filtered_uniform", "a": "trained", "b": "stale", "old": "stale"}
    assert tracer.fate[f"{g['a']}-t0"] == ("trained", 0) and tracer.formed[f"{g['b']}-t0"] == 1
    assert tracer.admitted == [f"{g[n]}-t{i}" for n in ("uniform", "a", "b", "old") for i in range(4)]
    assert tracer.received_from == {0: 16} and tracer.counts() == buf.ledger
    assert buf.ledger["stale"] == 8 and buf.ledger["trained"] == 4 and buf.ledger["filtered_uniform"] == 4
    buf.check_invariants()
