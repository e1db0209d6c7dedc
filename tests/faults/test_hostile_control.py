"""The control plane under hostile input. In process (BufferService, fake clock): an actor that stops heart-beating
loses its grants, parked batch requests are bounded, the control file cannot raise eta past its limit, a bad batch
request gets a reply the learner can read. Live (``bin/buffer`` as its own process): thousands of hostile frames and
forged control messages from a local process (runner/faults/fuzz.py), after which the buffer is up, its memory bounded,
eta and the groups in flight within their limits, and an honest actor and learner are served normally."""

from __future__ import annotations

import time

import psutil
import pytest
from buffer_process import live_buffer
from test_buffer import FakeClock, make_traj
from test_buffer_service import RUN, as_run_actor, learner_request, running, service_cfg, stats, wait_stats

from async_vla.buffer.service import MAX_PARKED, BufferService
from async_vla.config import write_resolved
from async_vla.learner_secret import ACTOR_SECRET_FILE, SECRET_FILE, actor_secret, learner_secret, sign
from async_vla.messages import ControlCommand, GrantRequest, Heartbeat
from async_vla.transport import ControlClient, TrajectorySender
from runner.faults.fuzz import CONTROL_KINDS, forge_control, fuzz


def test_silent_actor_loses_its_grants_and_a_late_member_is_counted(tmp_path):
    clock = FakeClock(100.0)
    cfg = service_cfg(groups_per_batch=2, max_staleness=1, reclaim_after_s=60.0, max_groups_per_actor=2)
    write_resolved(cfg, tmp_path)
    with BufferService(cfg, tmp_path, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0",
                       valid_task_ids=[0], clock=clock) as svc:
        actor, quiet = ControlClient(svc.control_endpoint), ControlClient(svc.control_endpoint)
        sender = TrajectorySender(svc.trajectory_endpoint)

        def call(client, msg):
            client.send(msg)
            for _ in range(2000):
                svc.step(0.005)
                got = client.recv(0.0)
                if got is not None:
                    return got
            raise AssertionError("no reply")

        g_quiet = call(quiet, as_run_actor(tmp_path, GrantRequest(actor_id=2, want=1))).group_ids
        g_live = call(actor, as_run_actor(tmp_path, GrantRequest(actor_id=1, want=5)))
        assert len(g_live.group_ids) == 2 and "max_groups_per_actor" in g_live.error and len(g_quiet) == 1
        assert call(actor, as_run_actor(tmp_path, GrantRequest(actor_id=1, want=0))).error.startswith(
            "want must be >= 1")
        clock.t += 40
        actor.send(as_run_actor(tmp_path, Heartbeat(actor_id=1)))   # actor 1 keeps talking, actor 2 is silent
        for _ in range(4000):                         # until the service has taken it in (order, not time)
            svc.step(0.005)
            if svc._actors.get(1, {}).get("t") == clock.t:
                break
        assert svc._actors[1]["t"] == clock.t
        clock.t += 40
        svc._due["expire"] = 0.0                      # run the chores now
        svc.step(0.005)
        s = svc.stats()
        assert s["groups"]["reclaimed"] == 1 and s["service"]["groups_reclaimed"] == 1
        assert svc.buffer.held_by(1) == 2 and svc.buffer.held_by(2) == 0
        assert sender.send(make_traj(g_quiet[0], 0, True, G=2, run_id=RUN), timeout_s=5)   # it wakes up, late
        for _ in range(400):
            svc.step(0.005)
            if svc.buffer.received:
                break
        assert svc.buffer.ledger["expired_partial"] == 1
        svc.buffer.check_invariants()
        for c in (actor, quiet):
            c.close()
        sender.close()


def test_parked_requests_are_bounded_and_bad_ones_get_a_readable_reply(tmp_path):
    with running(tmp_path, service_cfg(groups_per_batch=2)) as svc:
        learners = [ControlClient(svc.batch_endpoint) for _ in range(MAX_PARKED + 3)]
        control = ControlClient(svc.control_endpoint)
        for c in learners:
            c.send(learner_request(tmp_path, rank=0, world=1, version=0, timeout_s=600))     # nothing to serve: parked
        s = wait_stats(control, lambda s: s["service"].get("parked_refused_full") == 3)
        assert s["metrics"]["buffer/parked_requests"] == MAX_PARKED
        answered: dict[int, object] = {}                  # the ones past the bound were answered at once
        deadline = time.monotonic() + 30
        while len(answered) < 3 and time.monotonic() < deadline:
            for i, c in enumerate(learners):
                got = None if i in answered else c.recv_bundle(0.0)
                if got is not None:
                    answered[i] = got
        assert len(answered) == 3 and not any(h.ready for h, _ in answered.values())
        again = learners[next(i for i in range(len(learners)) if i not in answered)]
        again.send(learner_request(tmp_path, rank=0, world=1, version=0, timeout_s=600))      # replaces its own parked one
        assert not again.recv_bundle(10)[0].ready
        bad = next(c for c in learners if c is not again)
        bad.send(learner_request(tmp_path, rank=3, world=2, version=0))                        # a bundle, not a bare reply
        header, members = bad.recv_bundle(10)
        assert header.batch_id == -1 and not header.ready and members == []
        assert stats(control)["service"]["bad_batch_requests"] == 1
        for c in (*learners, control):
            c.close()


def test_control_file_and_socket_cannot_raise_eta_past_its_limit(tmp_path):
    with running(tmp_path, service_cfg(max_staleness=1, max_staleness_limit=4, control_poll_s=0.05)) as svc:
        client = ControlClient(svc.control_endpoint)
        secret = learner_secret(tmp_path / SECRET_FILE)
        assert client.call(sign(secret, ControlCommand("set_max_staleness", 10**9)), 10).command == "error"
        assert stats(client)["service"]["control_errors"] == 1 and "control_refused_no_credential" not in stats(
            client)["service"]                   # signed: refused for its value
        (tmp_path / "control" / "max_staleness").write_text("9" * 10_000)   # huge (and not a small int)
        wait_stats(client, lambda s: s["service"].get("control_file_refused") == 1)
        (tmp_path / "control" / "max_staleness").write_text("5\n")
        s = wait_stats(client, lambda s: s["service"].get("control_file_refused") == 2)
        assert s["max_staleness"] == 1
        (tmp_path / "control" / "max_staleness").write_text("4\n")
        assert wait_stats(client, lambda s: s["max_staleness"] == 4)["max_staleness"] == 4
        client.close()


@pytest.mark.slow
def test_live_buffer_under_hostile_input_stays_bounded_then_serves_honest_peers(tmp_path):
    overrides = ["transport.use_ipc=true", "buffer.groups_per_batch=2", "buffer.max_staleness=1",
                 "buffer.max_staleness_limit=4", "buffer.max_groups_per_actor=2", "buffer.reclaim_after_s=3",
                 "actor.hung_after_s=3",
                 "buffer.max_bytes=8000000", "env.task_ids=[0]", "transport.max_message_mb=1"]
    with live_buffer(tmp_path, "hostile", overrides) as (cfg, run_dir, eps, client, proc):
        rss0 = psutil.Process(proc.pid).memory_info().rss
        peak = [rss0]
        sent = fuzz(eps["trajectory"], 3000, "hostile", seed=5,
                    until=lambda: stats(client)["ledger"]["malformed"] >= 3000)   # then disconnect
        peak.append(psutil.Process(proc.pid).memory_info().rss)
        forged = forge_control(eps["control"], eps["batch"], 4000, "hostile", eta_limit=4, seed=6,
                               actor_secret=actor_secret(run_dir / ACTOR_SECRET_FILE))   # an insider's actor ids
        assert set(forged) == set(CONTROL_KINDS)
        refused = sum(forged[k] for k in ("eta_huge", "eta_negative", "eta_type", "eta_in_bounds", "unknown_command"))
        s1 = wait_stats(client, lambda s: s["ledger"]["malformed"] >= 3000 and s["service"].get(
            "control_errors") == refused, timeout=120)   # every forged command read
        peak.append(psutil.Process(proc.pid).memory_info().rss)
        assert proc.poll() is None, "the buffer died"
        assert s1["max_staleness"] == 1 and s1["ledger"]["malformed"] == sum(sent.values())
        # Forged batch requests (none carries the learner's credential): refused, counted, nothing moved
        forged_batches = sum(n for k, n in forged.items() if k.startswith("batch_"))
        s1 = wait_stats(client, lambda s: s["service"].get("learner_refused_no_credential", 0) + s["service"].get(
            "learner_refused_bad_credential", 0) == forged_batches, timeout=60)
        assert s1["service"]["learner_refused_bad_credential"] == forged["batch_forged_learner"]
        assert s1["learner_version"] == 0 and s1["learner_lineage"] is None and not s1["rollbacks"]
        # (eta + v + 1) * B groups in flight at most, and no actor holds more than its cap
        assert s1["groups_in_flight"] <= (1 + 0 + 1) * 2 and s1["most_groups_held_by_one_actor"] <= 2
        assert s1["service"]["grant_requests_out_of_bounds"] > 0
        # Memory: the forged actors, parked requests and stats did not accumulate (bounds in service.py).
        assert max(peak) - rss0 < 200 * 2**20, [(p - rss0) / 2**20 for p in peak]
        print(f"hostile: {sum(sent.values())} frames + {sum(forged.values())} forged control messages; buffer RSS "
              f"{rss0 / 2**20:.0f} MB -> peak {max(peak) / 2**20:.0f} MB; in flight {s1['groups_in_flight']}, "
              f"eta {s1['max_staleness']}, control errors {s1['service']['control_errors']}")
        # The forged actors fall silent: their grants come back, and an honest actor and learner are served.
        s2 = wait_stats(client, lambda s: s["groups_in_flight"] == 0, timeout=60)
        assert s2["groups"].get("reclaimed", 0) > 0
        grant = client.call(as_run_actor(run_dir, GrantRequest(actor_id=77, want=2, policy_version=0)), 10)
        assert len(grant.group_ids) == 2 and not grant.error
        sender = TrajectorySender(eps["trajectory"])
        for gid in grant.group_ids:
            for i in range(2):
                assert sender.send(make_traj(gid, i, i == 0, G=2, run_id="hostile", actor_id=77), timeout_s=10)
        learner = ControlClient(eps["batch"])
        learner.send(learner_request(run_dir, rank=0, world=1, version=0, timeout_s=30))
        header, members = learner.recv_bundle(40)
        assert header.ready and {t.group_id for t in members} == set(grant.group_ids)
        s3 = stats(client)
        assert s3["ledger"]["trained"] == 4 and s3["received"] == sum(s3["ledger"].values())
        sender.close()
        learner.close()
