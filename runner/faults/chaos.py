"""Fault-injection scenarios against a live local system (``runner/faults/live.py``): bin/chaos and tests/faults.

Each scenario (bad_input, flood, actor_kills, learner_kill, buffer_restart, hostile_peers; docs/RELIABILITY.md) runs
on an already training system, injects its fault, waits for recovery and returns what it measured (tests assert,
bin/chaos tabulates). ``final_report`` audits every buffer incarnation after a clean stop.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import threading
import time
import traceback
from typing import Any, Optional

import numpy as np

from async_vla.transport import secure_client
from learner.checkpoint_names import latest_version
from runner.faults import audit
from runner.faults.fuzz import fuzz, send_oversize
from runner.faults.live import LiveSystem, staleness_violations, unbalanced

FLOOD_ACTOR_BASE = 1000  # synthetic actors' ids start here (the audit tells them apart)
FLOOD_SENT: dict[str, list[str]] = {}   # what the flood scenario's synthetic actors sent (for the final audit)


def _led(stats: dict) -> dict:
    return dict(stats["ledger"], received=stats["received"])


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0) for k in b if isinstance(b[k], (int, float))}


def _alive_pids(sys_: LiveSystem) -> dict[str, Any]:
    return {"buffer": sys_.pid("buffer"), "learner": sys_.pid("learner"), "actors": sys_.actor_pids()}


# ---------------------------------------------------------------------------------------------- bad input
def bad_input(sys_: LiveSystem, n: int = 10_000, n_control: int = 1000, oversize: int = 3, seed: int = 0) -> dict:
    import zmq

    s0, pids0, rss0 = sys_.stats(), _alive_pids(sys_), sys_.rss_mb("buffer")
    t0 = time.monotonic()
    sent = fuzz(sys_.trajectory, n, sys_.cfg.run.name, seed=seed, curve_keys=sys_.keys,   # held until counted
                until=lambda: (s := sys_.stats()) is not None
                and s["ledger"]["malformed"] - s0["ledger"]["malformed"] >= n)
    oversize_bytes = int(16 * sys_.cfg.transport.max_message_mb * 2**20)
    send_oversize(sys_.trajectory, oversize_bytes, oversize, curve_keys=sys_.keys)
    rss_peak = sys_.rss_mb("buffer")
    ctx = zmq.Context()   # garbage on the control channel (random bytes: never a valid message)
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 10_000
    secure_client(dealer, sys_.keys)
    dealer.connect(sys_.control)
    rng = np.random.default_rng(seed + 1)
    for _ in range(n_control):
        dealer.send_multipart([rng.bytes(int(rng.integers(1, 300))) for _ in range(int(rng.integers(1, 4)))])
    dealer.close()
    ctx.term()
    m0 = s0["ledger"]["malformed"]
    c0 = s0["metrics"].get("buffer/control_malformed", 0)
    s1 = sys_.wait(lambda: (s := sys_.stats()) and s["ledger"]["malformed"] - m0 >= n
                   and s["metrics"]["buffer/control_malformed"] - c0 >= n_control and s, 120, "malformed counts")
    elapsed = time.monotonic() - t0
    time.sleep(2)
    s2 = sys_.stats()
    by_reason = collections.Counter(s2["malformed_by_reason"])
    by_reason.subtract(s0["malformed_by_reason"])
    pids1 = _alive_pids(sys_)
    return {
        "frames": n, "by_kind": sent, "control_frames": n_control, "oversize_messages": oversize,
        "oversize_mb": oversize_bytes / 2**20,
        "malformed_counted": s2["ledger"]["malformed"] - m0,
        "control_malformed_counted": int(s2["metrics"]["buffer/control_malformed"] - c0),
        "by_reason": {k: v for k, v in sorted(by_reason.items()) if v},
        "crashes": sum(int(pids1[n] != pids0[n] or not sys_.alive(n)) for n in ("buffer", "learner"))
        + sum(1 for a, p in pids0["actors"].items() if pids1["actors"].get(a) != p),
        "versions_during": s1["learner_version"] - s0["learner_version"], "seconds": elapsed,
        "trained_during": s1["ledger"]["trained"] - s0["ledger"]["trained"],
        "buffer_rss_mb": [rss0, rss_peak, sys_.rss_mb("buffer")],
    }


# ---------------------------------------------------------------------------------------------- flood
class _FloodActor(threading.Thread):
    """A synthetic actor that makes each trajectory instantly (a template). Paced: asks for grants like a real
    actor; unpaced: ignores pacing and pushes groups of its own ids as fast as the socket takes them (a buggy or
    hostile actor: the buffer refuses each trajectory of a group it did not grant, ``ungranted_group``, and its
    memory bound and ZeroMQ back-pressure stop the rest)."""

    def __init__(self, sys_: LiveSystem, idx: int, stop: threading.Event, paced: bool):
        super().__init__(daemon=True)
        self.sys, self.actor_id, self.stop, self.paced = sys_, FLOOD_ACTOR_BASE + idx, stop, paced
        self.sent = self.refused = self.grants = self.unsent = 0
        self.sent_ids: dict[str, list[str]] = {}   # buffer incarnation -> trajectory ids its socket accepted
        self.wait_s = self.make_s = 0.0
        cfg = sys_.cfg
        from runner.faults.fuzz import template

        calls = max(1, (cfg.env.max_steps or 16) // cfg.policy.chunk_size)
        self.template = dataclasses.replace(template(cfg.run.name, cfg.env.task_ids[0], calls=calls,
                                                     side=cfg.env.image_size), actor_id=self.actor_id,
                                            group_size=cfg.actor.group_size)
        self.template.proprio = np.zeros((calls, cfg.policy.proprio_dim), np.float32)
        self.calls = calls

    def _traj(self, gid: str, m: int, version: int, lineage: str):
        return dataclasses.replace(self.template, group_id=gid, traj_id=f"{gid}/m{m}", success=m % 2 == 0,
                                   reward=float(m % 2 == 0), behaviour_version=version,
                                   chunk_versions=np.full(self.calls, version, np.int64), lineage=lineage)

    def run(self) -> None:
        import zmq

        from async_vla.learner_secret import ACTOR_SECRET_FILE, actor_secret, as_actor
        from async_vla.messages import AdmissionGrant, GrantRequest, encode
        from async_vla.transport import ControlClient, ControlTimeout, TrajectorySender

        secret = actor_secret(self.sys.run_dir / ACTOR_SECRET_FILE)   # the run's actors' credential: it is one

        ctx = zmq.Context()
        ctl = ControlClient(self.sys.control, identity=f"flood-{self.actor_id}-{os.getpid()}".encode(), ctx=ctx,
                            keys=self.sys.keys)
        snd = TrajectorySender(self.sys.trajectory, hwm=self.sys.cfg.transport.hwm, ctx=ctx, keys=self.sys.keys)
        k, version, lineage = 0, 0, ""
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:  # an unpaced actor asks for nothing: the reply only tells it the learner's version
                    grant = ctl.call(as_actor(secret, GrantRequest(
                        self.actor_id, want=4 if self.paced else 0, policy_version=version, policy_lineage=lineage)),
                        timeout_s=5)
                except ControlTimeout:
                    continue
                if not isinstance(grant, AdmissionGrant):
                    continue
                version, lineage = grant.learner_version, grant.learner_lineage   # "loads" the current weights
                incarnation = grant.buffer_id or "-"
                gids = list(grant.group_ids) if self.paced else [f"flood{self.actor_id}-{k}"]
                k += 1
                if not gids:
                    self.refused += 1
                    time.sleep(grant.retry_after_s)
                    self.wait_s += time.monotonic() - t0
                    continue
                self.grants += 1
                for gid in gids:
                    for m in range(self.sys.cfg.actor.group_size):
                        t1 = time.monotonic()
                        frames = encode(self._traj(gid, m, version, lineage))
                        self.make_s += time.monotonic() - t1
                        t2 = time.monotonic()
                        while not snd.send_frames(frames, timeout_s=0.2):  # back-pressure: wait, never drop
                            if self.stop.is_set():
                                self.unsent += 1
                                break
                        else:
                            self.sent += 1
                            self.sent_ids.setdefault(incarnation, []).append(f"{gid}/m{m}")
                        self.wait_s += time.monotonic() - t2
        finally:
            ctl.close()
            snd.close(flush_s=30)   # what send() accepted still leaves (the buffer drains as the learner consumes)
            ctx.term()


def flood(sys_: LiveSystem, seconds: float = 20, paced: int = 2, unpaced: int = 2) -> dict:
    s0 = sys_.stats()
    rss0, held_max, ready_max, rss_max = sys_.rss_mb("buffer"), 0.0, 0, 0.0
    stop = threading.Event()
    fleet = [_FloodActor(sys_, i, stop, paced=i < paced) for i in range(paced + unpaced)]
    t0 = time.monotonic()
    for f in fleet:
        f.start()
    while time.monotonic() - t0 < seconds:
        s = sys_.stats()
        if s:
            held_max, ready_max = max(held_max, s["held_bytes"]), max(ready_max, s["groups_ready"])
        rss_max = max(rss_max, sys_.rss_mb("buffer"))
        time.sleep(0.5)
    stop.set()
    for f in fleet:
        f.join(60)
    elapsed = time.monotonic() - t0
    s1 = sys_.stats()
    sent = sum(f.sent for f in fleet)
    time.sleep(2 * sys_.cfg.buffer.ledger_every_s + 1)  # the recording is flushed with each ledger write
    received = audit.received_from(sys_.run_dir, FLOOD_ACTOR_BASE, sys_.cfg)
    encode_rate = sent / max(sum(f.make_s for f in fleet), 1e-9)
    trained_rate = (s1["ledger"]["trained"] - s0["ledger"]["trained"]) / elapsed
    n = len(fleet)
    for f in fleet:
        for k, ids in f.sent_ids.items():
            FLOOD_SENT.setdefault(k, []).extend(ids)
    return {
        "seconds": elapsed, "flood_actors": n, "paced": paced, "unpaced": unpaced, "sent": sent,
        "received": received, "lost": sent - received, "not_sent_at_stop": sum(f.unsent for f in fleet),
        "grants": sum(f.grants for f in fleet if f.paced), "grants_refused": sum(f.refused for f in fleet),
        "wait_frac": sum(f.wait_s for f in fleet) / (n * elapsed),
        # Achieved rates over the flood's wall time: what each synthetic actor got into the buffer per second,
        # against what the learner trained per second. (The encode-only rate is what one core could make if the
        # socket never pushed back: an upper bound, not a rate anything achieved.)
        "delivered_per_actor_per_s": received / n / elapsed, "sent_per_actor_per_s": sent / n / elapsed,
        "learner_rate_per_s": trained_rate, "flood_ratio": received / elapsed / max(trained_rate, 1e-9),
        "flood_ratio_per_actor": received / n / elapsed / max(trained_rate, 1e-9),
        "encode_only_rate_per_s": encode_rate,
        "versions_during": s1["learner_version"] - s0["learner_version"],
        "held_bytes_max": held_max, "max_bytes": sys_.cfg.buffer.max_bytes, "groups_ready_max": ready_max,
        "max_groups": sys_.cfg.buffer.max_groups, "buffer_rss_mb": [rss0, rss_max],
        "ledger_delta": _delta(_led(s0), _led(s1)),
    }


# ---------------------------------------------------------------------------------------------- hostile peers
def _forge_learner(sys_: LiveSystem, stop: threading.Event, sent: collections.Counter, rng) -> None:
    """Batch requests that claim a far newer version of a new lineage, signed with a secret not the run's."""
    from async_vla.learner_secret import sign
    from async_vla.messages import ROOT, BatchRequest, Lineage, PolicyTag
    from async_vla.transport import ControlClient, endpoints

    client = ControlClient(endpoints(sys_.cfg.transport, sys_.run_dir, side="connect")["batch"], keys=sys_.keys)
    try:
        while not stop.is_set():
            lineage = Lineage(rng.bytes(8).hex(), (PolicyTag(ROOT, 0),)).encode()
            req = BatchRequest(rank=0, world=1, version=int(rng.integers(1, 10**6)), timeout_s=0.0, lineage=lineage)
            client.send(sign(rng.bytes(32).hex().encode(), req), timeout_s=1)
            client.recv_bundle(5)            # its one reply (never a batch)
            sent["forged_batch_requests"] += 1
    finally:
        client.close()


def _forge_groups(sys_: LiveSystem, stop: threading.Event, sent: collections.Counter, rng) -> None:
    """Trajectories for guessed group ids (the old counter scheme) from made-up actors."""
    from async_vla.transport import TrajectorySender
    from runner.faults.fuzz import template

    cfg = sys_.cfg
    calls = max(1, (cfg.env.max_steps or 16) // cfg.policy.chunk_size)
    base = template(cfg.run.name, cfg.env.task_ids[0], calls=calls, side=cfg.env.image_size)
    base = dataclasses.replace(base, group_size=cfg.actor.group_size,
                               proprio=np.zeros((calls, cfg.policy.proprio_dim), np.float32))
    sender = TrajectorySender(sys_.trajectory, keys=sys_.keys)
    k = 0
    try:
        while not stop.is_set():
            gid = f"{cfg.run.name}-g{k}"
            if sender.send(dataclasses.replace(base, group_id=gid, traj_id=f"{gid}/m0",
                                               actor_id=int(rng.integers(0, 10**6))), timeout_s=0.2):
                sent["ungranted_trajectories"] += 1
            k += 1
            time.sleep(0.001)
    finally:
        sender.close(flush_s=5)


def _churn_actors(sys_: LiveSystem, stop: threading.Event, sent: collections.Counter, rng) -> None:
    """Heartbeats from ever new made-up actor ids (to churn the tracked-actor table), without the run's actor
    credential (or with a made-up token, every other one)."""
    from async_vla.messages import Heartbeat
    from async_vla.transport import ControlClient

    client = ControlClient(sys_.control, keys=sys_.keys)
    k = 0
    try:
        while not stop.is_set():
            if client.send(Heartbeat(actor_id=10**7 + k, auth=rng.bytes(32).hex() if k % 2 else ""), timeout_s=0.2):
                sent["fake_heartbeats"] += 1
            k += 1
            if k % 100 == 0:
                time.sleep(0.01)
    finally:
        client.close()


def hostile_peers(sys_: LiveSystem, seconds: float = 15.0, seed: int = 0) -> dict:
    """The honest system's trained trajectories per second over ``seconds`` before, during and after three hostile
    peers run at once (forged learner batch requests, trajectories for ungranted groups, made-up actor ids), what
    the buffer counted of each, and whether anything moved that only the learner may move."""
    rng = np.random.default_rng(seed)

    def window() -> tuple[float, dict]:
        s0, t0 = sys_.stats(), time.monotonic()
        time.sleep(seconds)
        s1 = sys_.stats()
        return (s1["ledger"]["trained"] - s0["ledger"]["trained"]) / (time.monotonic() - t0), s1

    pids0 = _alive_pids(sys_)
    before, s0 = window()
    stop, sent = threading.Event(), collections.Counter()
    peers = [threading.Thread(target=fn, args=(sys_, stop, sent, np.random.default_rng(rng.integers(2**32))),
                              daemon=True) for fn in (_forge_learner, _forge_groups, _churn_actors)]
    for p in peers:
        p.start()
    during, s1 = window()
    stop.set()
    for p in peers:
        p.join(30)
    after, s2 = window()
    svc0, svc2 = s0["service"], s2["service"]
    refused = {k: svc2.get(k, 0) - svc0.get(k, 0) for k in (
        "learner_refused_bad_credential", "learner_refused_no_credential", "actor_refused_no_credential",
        "actor_refused_bad_credential", "actors_forgotten", "groups_reclaimed")}
    refused["ungranted_group"] = (s2["malformed_by_reason"].get("ungranted_group", 0)
                                  - s0["malformed_by_reason"].get("ungranted_group", 0))
    pids2 = _alive_pids(sys_)
    return {
        "seconds": seconds, "trained_per_s": [before, during, after], "sent": dict(sent), "counted": refused,
        "learner_versions": [s0["learner_version"], s1["learner_version"], s2["learner_version"]],
        "rollbacks": len(s2["rollbacks"]) - len(s0["rollbacks"]),
        "crashes": sum(int(pids2[n] != pids0[n] or not sys_.alive(n)) for n in ("buffer", "learner")),
    }


# ---------------------------------------------------------------------------------------------- actors
def actor_kills(sys_: LiveSystem, every_s: float = 30, duration_s: float = 300, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    s0, learner_pid = sys_.stats(), sys_.pid("learner")
    kills, versions = [], [s0["learner_version"]]
    t0 = time.monotonic()
    for k in range(1, int(duration_s // every_s + 1e-9) + 1):   # a kill at every_s, 2 every_s, ... duration_s
        time.sleep(max(0.0, t0 + k * every_s - time.monotonic()))
        versions.append(sys_.version())
        picked = _mid_rollout(sys_, rng, wait_s=min(3.0, every_s / 3))
        if picked is None:
            continue
        a, pid, state = picked
        os.kill(pid, signal.SIGKILL)
        kills.append({"actor": a, "pid": pid, "state": state, "t": time.monotonic(), "learner_version": versions[-1]})
    rejoin = []
    for k in kills:   # each killed actor is back: a new pid, loaded with weights at least as new as at the kill
        def back(k=k):
            st = sys_.actor_status().get(k["actor"])
            return st if st and st["pid"] != k["pid"] and st.get("state") not in ("starting", None) else None
        st = sys_.wait(back, 120, f"actor {k['actor']} to come back")
        rejoin.append({"actor": k["actor"], "new_pid": st["pid"], "version": st["version"],
                       "learner_version_at_kill": k["learner_version"]})
    time.sleep(sys_.cfg.buffer.group_timeout_s + 2 * sys_.cfg.buffer.expire_every_s + 1)  # partial groups expire
    s1 = sys_.stats()
    steps = [b - a for a, b in zip(versions, versions[1:])]
    return {
        "kills": len(kills), "every_s": every_s, "duration_s": duration_s,
        "learner_alive": sys_.alive("learner") and sys_.pid("learner") == learner_pid,
        "versions": [versions[0], s1["learner_version"]], "min_versions_per_interval": min(steps, default=0),
        "rejoined": len(rejoin), "rejoined_with_current_weights": sum(r["version"] >= r["learner_version_at_kill"]
                                                                      for r in rejoin),
        "restarts_logged": sum(p.read_text().count("==== fleet: starting actor") - 1
                               for p in (sys_.run_dir / "logs").glob("actor_*.log")),
        "expired_partial": s1["ledger"]["expired_partial"] - s0["ledger"]["expired_partial"],
        "expired_groups": (s1["groups"].get("expired_partial", 0) + s1["groups"].get("expired_empty", 0)
                           - s0["groups"].get("expired_partial", 0) - s0["groups"].get("expired_empty", 0)),
        "balanced": s1["received"] == sum(s1["ledger"].values()), "rejoin": rejoin,
    }


def _mid_rollout(sys_: LiveSystem, rng, wait_s: float = 3.0) -> Optional[tuple[int, int, str]]:
    """(actor, pid, state) of a random actor, preferably one its status file shows mid-rollout right now."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        now = time.time()
        busy = [(a, st["pid"]) for a, st in sys_.actor_status().items()
                if st.get("state") == "rollout" and now - st["t"] < 0.1]
        if busy:
            a, pid = busy[int(rng.integers(0, len(busy)))]
            return a, pid, "rollout"
        time.sleep(0.01)
    pids = sys_.actor_pids()
    if not pids:
        return None
    a = int(rng.choice(sorted(pids)))
    return a, pids[a], "any"


# ---------------------------------------------------------------------------------------------- buffer
def buffer_restart(sys_: LiveSystem, how: str = "kill", down_s: float = 3.0) -> dict:
    s0, pids0 = sys_.stats(), _alive_pids(sys_)
    v0 = s0["learner_version"]
    t0 = time.monotonic()
    if how == "kill":
        sys_.kill("buffer")
    else:
        sys_.children["buffer"].stop(30)
    time.sleep(down_s)
    sys_.start_buffer()
    t_up = time.monotonic()
    n = sys_.cfg.actor.num_actors
    s1 = sys_.wait(lambda: (s := sys_.stats()) and s["metrics"].get("perf/actors_alive", 0) >= n
                   and s["received"] > 0 and s["learner_version"] > v0 and s, 120,
                   "actors and learner back on the new buffer")
    recovered_s = time.monotonic() - t_up
    old = sys_.ledgers(archived_only=True)[-1]   # the dead incarnation's books, moved aside by the new one
    pids1 = _alive_pids(sys_)
    time.sleep(2 * sys_.cfg.buffer.ledger_every_s + 1)
    # Sent (the actors' own logs) against received (each incarnation's recording) and how each ended: what the
    # killed buffer held, and what died in its socket, counted trajectory by trajectory.
    acct = audit.sent_vs_received(sys_.run_dir, sys_.cfg, extra_sent=FLOOD_SENT)
    dead = acct["incarnations"][-2] if len(acct["incarnations"]) >= 2 else {}
    return {
        "how": how, "down_s": down_s, "recovered_s": recovered_s, "total_s": time.monotonic() - t0,
        "learner_same_pid": pids1["learner"] == pids0["learner"],
        "actors_same_pids": pids1["actors"] == pids0["actors"],
        "versions": [v0, s1["learner_version"]],
        "old_ledger": {"received": old["received"], **old["ledger"]},
        "pending_in_old_buffer": old["ledger"]["pending"], "new_received": s1["received"],
        "new_duplicates": s1["ledger"]["duplicate"],
        # the killed incarnation replayed from its recording (flushed every busy step), not its last ledger.json:
        "killed_received": dead.get("received"), "killed_pending_at_death": dead.get("ledger", {}).get("pending"),
        "ledger_file_behind_by": (dead.get("received") or 0) - old["received"],
        "accounting": acct,
    }


# ---------------------------------------------------------------------------------------------- learner
def learner_kill(sys_: LiveSystem, outage_s: float = 10.0, min_version: int = 3) -> dict:
    ckpt_dir = sys_.run_dir / "checkpoints"
    sys_.wait(lambda: latest_version(ckpt_dir) is not None and sys_.version() >= min_version, 120, "a checkpoint")
    deadline = time.monotonic() + 20   # kill past a checkpoint if we can: the resumed learner is then behind
    while time.monotonic() < deadline and sys_.version() <= latest_version(ckpt_dir):
        time.sleep(0.02)
    actors0 = sys_.actor_status()
    refused0 = (sys_.stats() or {}).get("service", {}).get("grants_refused", 0)
    sys_.kill("learner")
    t_kill = time.monotonic()
    s_kill = sys_.stats()
    k, c = s_kill["learner_version"], latest_version(ckpt_dir)
    rss0 = {a: _rss(st["pid"]) for a, st in actors0.items()}
    held_max, versions_seen = 0, collections.defaultdict(set)
    while time.monotonic() - t_kill < outage_s:
        s = sys_.stats()
        held_max = max(held_max, s["held_bytes"])
        # After a grace period (a version published just before the kill may still be swapping in), an actor
        # keeps the weights it has: its version must not change while no learner exists.
        for a, st in sys_.actor_status().items():
            if st.get("state") != "starting" and time.monotonic() - t_kill > 2.0:
                versions_seen[a].add(st["version"])
        time.sleep(0.5)
    s_out = sys_.stats()
    actors_out = sys_.actor_status()
    rss1 = {a: _rss(st["pid"]) for a, st in actors_out.items()}
    sys_.start_learner(resume=True)
    new_pid = sys_.pid("learner")
    report_path = sys_.run_dir / "learner_resume_rank00000.json"
    import json

    report = sys_.wait(lambda: report_path.is_file() and (r := json.loads(report_path.read_text()))["pid"] == new_pid
                       and r, 120, "the resumed learner's report")
    sys_.wait_version(k + 2, 180)
    after = sys_.wait(lambda: (st := sys_.actor_status()) and all(x["version"] > c for x in st.values()) and st,
                      60, "actors on the resumed learner's weights")
    s_end = sys_.stats()
    time.sleep(2 * sys_.cfg.buffer.ledger_every_s + 1)
    fates = audit.fates_of_in_flight(sys_.run_dir, s_kill["recorded_records"], c, sys_.cfg)
    return {
        "version_at_kill": k, "checkpoint_version": c, "resumed_version": report["version"],
        "bit_equal": report["bit_equal"], "outage_s": outage_s,
        "actors_kept_weights": all(len(v) == 1 for v in versions_seen.values()),
        "actor_rss_growth_mb": max((rss1.get(a, 0) - r) for a, r in rss0.items()),
        "held_bytes_max": held_max,
        "grants_refused_during": s_out.get("service", {}).get("grants_refused", 0) - refused0,
        "actors_same_pids": {a: st["pid"] for a, st in actors0.items()} == {a: st["pid"] for a, st in after.items()},
        "actor_versions_after": {a: st["version"] for a, st in after.items()},
        "rollbacks": s_end.get("rollbacks", []), "versions": [k, s_end["learner_version"]],
        "in_flight": fates,
    }


def _rss(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


# ---------------------------------------------------------------------------------------------- audit
def final_report(sys_: LiveSystem) -> dict:
    """After ``sys_.stop()``: every incarnation's books, staleness and double admission."""
    ledgers = sys_.ledgers()
    twice = audit.admitted_twice(sys_.run_dir, sys_.cfg)
    learner_lags = audit.learner_lags(sys_.run_dir)
    acct = audit.sent_vs_received(sys_.run_dir, sys_.cfg, extra_sent=FLOOD_SENT)
    return {
        "invariant_failures": sum(int(led.get("service", {}).get("invariant_failures", 0)) for led in ledgers)
        + sum(1 for led in ledgers if led.get("invariants", "ok") != "ok"),
        "invariant_checks": sum(int(led.get("service", {}).get("invariant_checks", 0)) for led in ledgers),
        "learner_lag_min": min(learner_lags, default=0), "learner_lag_max": max(learner_lags, default=0),
        "learner_trained": sum(learner_lags.values()),
        "ledger_lag_min": min((int(k) for led in ledgers for k in led.get("lag_histogram", {})), default=0),
        "ahead": sum(led["ledger"].get("ahead", 0) for led in ledgers),
        "accounting": acct,
        "incarnations": len(ledgers), "received": sum(led["received"] for led in ledgers),
        "trained": sum(led["ledger"]["trained"] for led in ledgers),
        "malformed": sum(led["ledger"]["malformed"] for led in ledgers),
        "unbalanced": unbalanced(ledgers), "beyond_eta": staleness_violations(ledgers),
        "max_staleness": sys_.cfg.max_staleness,
        "lag_max": max((led["lag_max"] for led in ledgers), default=0),
        "admitted_twice": twice["admitted_twice"], "admitted": twice["admitted"],
    }


def run_all(sys_: LiveSystem, plan: Optional[dict] = None, log=print) -> dict:
    """Every scenario in turn on one live system (``plan``: scenario -> kwargs; a missing one is skipped)."""
    plan = plan if plan is not None else {"bad_input": {}, "flood": {}, "hostile_peers": {}, "actor_kills": {},
                                          "learner_kill": {}, "buffer_restart": {}}
    out: dict[str, Any] = {}
    for name, kwargs in plan.items():
        log(f"[chaos] {name} {kwargs or ''}")
        t0 = time.monotonic()
        try:
            out[name] = globals()[name](sys_, **kwargs)
        except Exception as exc:  # noqa: BLE001 - one failed scenario must not hide the others' figures
            log(f"[chaos] {name} FAILED:\n{traceback.format_exc()}")
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        out[name]["wall_s"] = time.monotonic() - t0
        log(f"[chaos] {name} done in {out[name]['wall_s']:.0f} s")
    return out
