"""Flood: producers far faster than the learner.

In-process BufferService, unpaced producers (raw back-pressure): memory stays within buffer.max_bytes, producers
block on the high-water marks >= 90% of the time (>= 10x faster than the rate they achieve), and every trajectory
send() accepted is received and in the ledger. Paced and unpaced synthetic actors against the live system during
training: test_live_faults.py::test_flood.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from test_buffer import make_traj
from test_buffer_service import RUN, as_run_actor, learner_request, running, service_cfg, stats

from async_vla.messages import GrantRequest
from async_vla.transport import ControlClient, TrajectorySender


@pytest.mark.slow
@pytest.mark.timeout(180)   # ~45 s normally; a hang fails here, not after the suite-wide 300 s
def test_flood_back_pressure(tmp_path):
    """Producers far faster than the learner: memory stays bounded, producers block, nothing is lost."""
    template = make_traj("t", 0, True, run_id=RUN, calls=4, image=32, tokens=56)
    size = template.nbytes
    cfg = service_cfg(hwm=4, groups_per_batch=2, max_groups=8, max_bytes=40 * size, pacing=False,
                      max_staleness=10**6, max_staleness_limit=10**6, group_timeout_s=10**6,
                      max_groups_per_actor=10**6, reclaim_after_s=10**6)
    flood_s, consumer_pause_s, G = 12.0, 0.2, 4
    stop_producers = threading.Event()
    sent = [0, 0]
    blocked = [0.0, 0.0]
    elapsed = [0.0, 0.0]
    max_held = [0]

    senders = []

    def producer(p: int, endpoint: str, gids: list[str]) -> None:
        sender = TrajectorySender(endpoint, hwm=4)
        senders.append(sender)  # closed only after the drain: ZeroMQ drops a closed socket's queue after linger
        k, t_begin = 0, time.monotonic()
        while not stop_producers.is_set():
            for i in range(G):
                traj = dataclasses.replace(template, group_id=gids[k], traj_id=f"{gids[k]}-t{i}",
                                           success=i % 2 == 0, actor_id=p)
                while not stop_producers.is_set():
                    t0 = time.monotonic()
                    ok = sender.send(traj, timeout_s=0.05)
                    if time.monotonic() - t0 > 0.001:   # waited on the high-water mark: blocked
                        blocked[p] += time.monotonic() - t0
                    if ok:
                        sent[p] += 1
                        break
            k += 1
        elapsed[p] = time.monotonic() - t_begin

    with running(tmp_path, cfg) as svc:
        def sampler() -> None:
            while not stop_producers.is_set() or sampling.is_set():
                max_held[0] = max(max_held[0], svc.buffer.held_bytes)
                time.sleep(0.002)

        sampling = threading.Event()
        sampling.set()
        grants = ControlClient(svc.control_endpoint)   # ids for far more groups than the run takes (unpaced)
        pools = [[gid for _ in range(3) for gid in grants.call(
            as_run_actor(tmp_path, GrantRequest(actor_id=p, want=1024)), 10).group_ids] for p in range(2)]
        grants.close()
        assert all(len(pool) == 3 * 1024 for pool in pools)
        threads = [threading.Thread(target=producer, args=(p, svc.trajectory_endpoint, pools[p]))
                   for p in range(2)]
        threads.append(threading.Thread(target=sampler))
        for th in threads:
            th.start()
        learner, control = ControlClient(svc.batch_endpoint), ControlClient(svc.control_endpoint)
        try:
            version, t_start = 0, time.monotonic()
            while time.monotonic() - t_start < flood_s:
                learner.send(learner_request(tmp_path, rank=0, world=1, version=version, timeout_s=2))
                header, members = learner.recv_bundle(10)
                if header.ready:
                    version += 1
                time.sleep(consumer_pause_s)
        finally:
            stop_producers.set()
            for th in threads[:2]:
                th.join(10)
        try:
            total_sent = sum(sent)
            drain_deadline = time.monotonic() + 30
            while stats(control)["received"] < total_sent and time.monotonic() < drain_deadline:
                learner.send(learner_request(tmp_path, rank=0, world=1, version=version, timeout_s=0.5))  # drain the queues
                if learner.recv_bundle(10)[0].ready:
                    version += 1
            s = stats(control)
        finally:
            for sender in senders:
                sender.close()
            sampling.clear()
            threads[2].join(10)
            learner.close()
    assert max_held[0] <= cfg.buffer.max_bytes
    # A producer blocked for a fraction f of its time could have sent 1 / (1 - f) times faster: f >= 0.75 means
    # producers were >= 4x faster than the rate they achieved (the learner's, plus what queues absorbed), so the
    # test really floods (typically f > 0.95; the margin is for time a loaded host deschedules a producer).
    frac = [b / e for b, e in zip(blocked, elapsed)]
    assert min(frac) >= 0.75, frac
    assert s["received"] == total_sent                           # nothing lost
    assert s["received"] == sum(s["ledger"].values())
    assert s["ledger"]["malformed"] == 0 and s["ledger"]["expired_partial"] == 0
    assert s["ledger"]["trained"] == version * 2 * G
