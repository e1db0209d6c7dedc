"""Property tests of GroupBuffer over random arrival orders, success patterns, versions, eta changes and deaths.

Properties (dynamic sampling on):
  * no uniform group is ever emitted; every emitted group is complete, distinct, and within eta at emission;
  * no mixed, fresh, complete group is lost: at the end it was emitted, is still pending, or its lag exceeded
    the eta of the moment at some point after it completed (then dropping it as stale was the rule);
  * received == sum of the ledger states (and pending / held bytes match the structures) after every input;
  * hostile trajectories (a group id never granted, a granted group's id from another actor) are refused and
    counted by reason, never open a group and are never trained.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_buffer import FakeClock, make_cfg, make_traj, ready_group_ids

from async_vla.buffer import GroupBuffer
from async_vla.messages import ROOT, Lineage, PolicyTag

RUN = "run"


@st.composite
def scenarios(draw):
    G = draw(st.integers(2, 4))
    B = draw(st.integers(1, 3))
    world = draw(st.sampled_from([w for w in (1, 2, 3) if B % w == 0]))
    groups, events = [], []
    for k in range(draw(st.integers(1, 10))):
        succ = draw(st.lists(st.booleans(), min_size=G, max_size=G))
        bvs = draw(st.lists(st.integers(0, 6), min_size=G, max_size=G))
        died = draw(st.integers(0, 3)) == 0                      # the actor died: some members never arrive
        sent = draw(st.integers(0, G - 1)) if died else G
        groups.append((succ, bvs, sent))
        events += [("traj", k, i) for i in range(sent)]
        events += [("traj", k, i) for i in draw(st.lists(st.integers(0, G - 1), max_size=2)) if i < sent]
    events += [("step",)] * draw(st.integers(0, 8))
    events += [("eta", draw(st.integers(0, 3))) for _ in range(draw(st.integers(0, 2)))]
    events += [("malformed",)] * draw(st.integers(0, 2))
    events += [("grant", draw(st.integers(1, 3))) for _ in range(draw(st.integers(0, 2)))]
    events += [("forge_unknown", draw(st.integers(0, 10**6))) for _ in range(draw(st.integers(0, 3)))]
    events += [("forge_other", draw(st.integers(0, len(groups) - 1))) for _ in range(draw(st.integers(0, 3)))]
    order = draw(st.permutations(events))
    return dict(G=G, B=B, world=world, eta=draw(st.integers(0, 3)), reuse=draw(st.integers(1, 2)),
                order=order, groups=groups, lifo=draw(st.booleans()))


def _request(buf, version, world, B, emitted, eta):
    """All ranks ask for the batch at ``version``; returns True if it was formed (the learner moves on)."""
    shares = [buf.take_batch(version, r, world) for r in range(world)]
    if shares[0] is None:
        assert all(s is None for s in shares)
        return False
    assert len({s[0] for s in shares}) == 1, "ranks at one version must get the same batch id"
    batch = [g for s in shares for g in s[1]]
    assert len(batch) == B
    assert len({g[0].group_id for g in batch}) == B, "a batch holds distinct groups"
    for g in batch:
        emitted.append((g[0].group_id, version, eta, g))
    return True


def _note_stale(buf, sc, arrived, eta, ever_stale):
    """Record every complete group whose lag exceeds the eta of this moment (dropping it is then the rule)."""
    for k, got in arrived.items():
        if len(got) == len(sc["groups"][k][0]) and buf.version - min(sc["groups"][k][1]) > eta:
            ever_stale.add(k)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_buffer_properties(sc):
    G, B, world = sc["G"], sc["B"], sc["world"]
    clock = FakeClock()
    cfg = make_cfg(groups_per_batch=B, max_staleness=sc["eta"], reuse=sc["reuse"], group_timeout_s=1e6,
                   order="lifo" if sc["lifo"] else "fifo", pacing=False, max_groups_per_actor=64)
    buf = GroupBuffer.from_config(cfg, RUN, clock=clock)
    gids = buf.grant(0, len(sc["groups"]))              # the honest actor 0's groups (pacing is tested elsewhere)
    forged = {"ungranted_group": 0, "other_actor": 0}
    issued = set(gids)                                  # every id granted so far: never issued twice
    eta, version = sc["eta"], 0
    emitted: list = []
    arrived: dict[int, set] = {}
    ever_stale: set = set()
    for ev in sc["order"]:
        clock.t += 1.0
        if ev[0] == "traj":
            _, k, i = ev
            succ, bvs, _ = sc["groups"][k]
            buf.add(make_traj(gids[k], i, succ[i], bv=bvs[i], G=G, calls=1, image=2, tokens=2))
            arrived.setdefault(k, set()).add(i)
        elif ev[0] == "forge_unknown":          # a guessed id: never granted
            in_flight = buf.groups_in_flight
            assert buf.add(make_traj(f"{RUN}-g{ev[1]}", 0, True, G=G, calls=1, image=2, tokens=2)) == "malformed"
            assert buf.groups_in_flight == in_flight
            forged["ungranted_group"] += 1
        elif ev[0] == "forge_other":            # a real id, another actor: refused whatever state the group is in
            state = buf.add(make_traj(gids[ev[1]], G + 5, True, G=G, calls=1, image=2, tokens=2, actor_id=9))
            assert state in ("malformed", "expired_partial")
            forged["other_actor"] += 1
        elif ev[0] == "step":
            if _request(buf, version, world, B, emitted, eta):
                version += 1
        elif ev[0] == "eta":
            eta = ev[1]
            buf.set_max_staleness(eta)
        elif ev[0] == "malformed":
            buf.count_malformed("test")
        else:
            got = buf.grant(actor_id=1, want=ev[1])
            assert not issued & set(got) and len(set(got)) == len(got), "a granted id was issued again"
            issued.update(got)
        buf.check_invariants()
        assert buf.malformed_by_reason["ungranted_group"] == forged["ungranted_group"]
        _note_stale(buf, sc, arrived, eta, ever_stale)
    clock.t += 3e6
    buf.expire()                             # dead actors' groups (and unused grants) expire now
    buf.check_invariants()
    while True:                              # the learner drains what it can
        formed = _request(buf, version, world, B, emitted, eta)
        buf.check_invariants()
        _note_stale(buf, sc, arrived, eta, ever_stale)
        if not formed:
            break
        version += 1

    emitted_ids = {}
    for gid, v, eta_then, members in emitted:
        assert all(t.actor_id == 0 for t in members), "a forged trajectory was trained"
        succ = [t.success for t in members]
        assert 0 < sum(succ) < G, "a uniform group was emitted"
        assert len(members) == G and len({t.traj_id for t in members}) == G
        assert v - min(t.behaviour_version for t in members) <= eta_then, "an emitted group exceeded eta"
        emitted_ids[gid] = emitted_ids.get(gid, 0) + 1
    assert all(n <= sc["reuse"] for n in emitted_ids.values())
    pending = set(ready_group_ids(buf))
    for k, (succ, bvs, sent) in enumerate(sc["groups"]):
        gid = gids[k]
        if sent == G and 0 < sum(succ) < G and k not in ever_stale:
            assert gid in emitted_ids or gid in pending, f"mixed fresh complete group {gid} was lost"
        if sent < G:
            assert gid not in emitted_ids
    assert buf.ledger["pending"] == G * len([gid for gid in pending if gid not in emitted_ids])
    assert buf.groups_in_flight == 0
    assert buf.received == sum(buf.ledger.values())



@st.composite
def restart_scenarios(draw):
    """A learner that trains, dies and resumes from older checkpoints while actors keep sending. Events:
    ("sample", granted, behind, now) a group sampled now by the live policy ``behind`` versions back (granted by
    this buffer, or not: granted before a buffer restart, refused as ungranted_group), sent at once or not; ("arrive", k) group k's unsent
    members reach the buffer;
    ("step",) a batch request at the learner's version; ("resume", back) the learner killed and resumed from its
    checkpoint ``back`` versions earlier (each learner life has a lineage of its own, descending from the life
    that wrote that checkpoint)."""
    events = draw(st.lists(st.one_of(
        st.tuples(st.just("sample"), st.booleans(), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("arrive"), st.integers(0, 40)),
        st.tuples(st.just("step")),
        st.tuples(st.just("resume"), st.integers(1, 4))), min_size=5, max_size=100))
    return dict(events=events, eta=draw(st.integers(0, 3)), B=draw(st.integers(1, 2)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(restart_scenarios())
@example(dict(eta=1, B=1, events=[   # v1 published and sampled, the learner dies before asking for batch 1
    ("sample", True, 0, True), ("step",), ("sample", True, 0, True), ("resume", 1), ("step",), ("step",)]))
def test_a_dead_learners_data_is_never_trained(sc):
    """After a resume to version c, data sampled by the dead learner's versions above c is never trained again,
    every batch has 0 <= lag <= eta, the ledger balances after every input, and a replay of the journal
    reproduces the books."""
    G, B, eta = 2, sc["B"], sc["eta"]
    clock, journal = FakeClock(), []
    cfg = make_cfg(groups_per_batch=B, max_staleness=eta, group_timeout_s=1e6, pacing=False,
                   max_groups_per_actor=1000)
    buf = GroupBuffer.from_config(cfg, RUN, clock=clock, journal=lambda t, m: journal.append((t, m)))
    version, life = 0, 0
    lineages = {0: Lineage(ROOT).descend("l0", 0)}   # life -> its lineage
    chain = [(0, 0)]                  # the live history: (life, version it started at), oldest first
    ceiling = {0: 10**9}              # life -> newest version of that learner life that still exists
    groups: list[dict] = []
    sampled_by: dict[str, tuple[int, int]] = {}

    def live_tag(bv):
        """The tag of the live history's policy at version ``bv``."""
        owner = next(lf for lf, start in reversed(chain) if start <= bv)
        return PolicyTag(lineages[owner].id, bv)

    def send(g):
        while g["sent"] < G:
            buf.add(make_traj(g["gid"], g["sent"], g["sent"] == 0, bv=g["tag"].version, G=G, calls=1, image=2,
                              tokens=2, lineage=g["tag"].lineage, actor_id=1))
            g["sent"] += 1

    def request():
        nonlocal version
        got = buf.take_batch(version, lineage=lineages[life])
        if got is None:
            return
        for members in got[1]:
            lags = [version - t.behaviour_version for t in members]
            assert all(0 <= lag <= eta for lag in lags), (version, lags)
            s_life, bv = sampled_by[members[0].group_id]
            assert bv <= ceiling[s_life], f"trained data of a dead policy: life {s_life} v{bv}"
        version += 1

    for ev in sc["events"]:
        clock.t += 1.0
        if ev[0] == "sample":
            tag = live_tag(max(0, version - ev[2]))
            gid = f"u{len(groups)}"
            if ev[1]:
                got = buf.grant(1, 1, tag=tag)
                if not got:
                    continue
                gid = got[0]
            groups.append(dict(gid=gid, tag=tag, sent=0))
            sampled_by[gid] = (life, tag.version)
            if ev[3]:
                send(groups[-1])
        elif ev[0] == "arrive" and groups:
            send(groups[ev[1] % len(groups)])
        elif ev[0] == "step":
            request()
        elif ev[0] == "resume" and version - ev[1] >= 0:
            version -= ev[1]     # the dead learner's version reached its checkpoint's + back
            for lf in ceiling:
                ceiling[lf] = min(ceiling[lf], version)
            chain = [(lf, start) for lf, start in chain if start <= version]
            writer = chain[-1][0]                        # the life that wrote that checkpoint
            life += 1
            lineages[life] = lineages[writer].descend(f"l{life}", version)
            chain.append((life, version))
            ceiling[life] = 10**9
            request()            # the resumed learner's first request
        buf.check_invariants()
    replayed = GroupBuffer.from_config(cfg, RUN, clock=FakeClock())
    for t, m in journal:
        replayed.clock.t = t
        replayed.apply_journal(m)
    assert replayed.ledger == buf.ledger and replayed.lag_histogram == buf.lag_histogram
    assert replayed.admission.capacity() == buf.admission.capacity()       # pacing's state too
