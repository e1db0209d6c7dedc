"""The actor fleet: supervision logic with stand-in child processes (fast), and the real thing (slow):
`bin/actors` with 2 actors against the real BufferService, a version bump through the buffer's grants and a
real weight broadcast, kill -9 of one actor mid-group (restarted with the current weights, partial group
expired and counted, the other actor never stops) and SIGTERM (bounded, no zombies).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from actors.fleet import Fleet
from actors.status import log_path, read_status, status_path, write_status
from async_vla.config import load_config, write_resolved
from timing import slack

REPO = Path(__file__).resolve().parent.parent


def wait_for(pred, timeout_s, what, every=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class ScriptFleet(Fleet):
    """A fleet whose "actors" are tiny python scripts (test stand-ins for `python -m actors`)."""

    def __init__(self, *a, script: str, **kw):
        super().__init__(*a, **kw)
        self.script = script

    def _command(self, slot):
        return [sys.executable, "-c", self.script, str(self.run_dir), str(slot.actor_id)]


def fleet_cfg(tmp_path, *overrides):
    cfg = load_config(None, ["actor.restart_backoff_s=0.05", "actor.fast_crash_s=5", "logging.status_every_s=0.5",
                             *overrides])
    return cfg, write_resolved(cfg, tmp_path)


def test_fleet_gives_up_after_fast_crashes(tmp_path):
    cfg, cfile = fleet_cfg(tmp_path, "actor.max_fast_crashes=3")
    out = io.StringIO()
    script = "import sys; print('boom: broken install'); sys.exit(3)"
    fleet = ScriptFleet(cfg, cfile, 2, tmp_path, out=out, script=script)
    t0 = time.monotonic()
    assert fleet.run(install_signals=False) == 1
    assert time.monotonic() - t0 < slack(20)
    text = out.getvalue()
    assert text.count("GIVING UP") == 2 and "3 times in a row" in text and "boom: broken install" in text
    assert all(s.starts == 3 and s.gave_up for s in fleet.slots)
    assert "start #3" in log_path(tmp_path, 0).read_text()


def test_fleet_restarts_hung_actor_and_stops_cleanly(tmp_path):
    cfg, cfile = fleet_cfg(tmp_path, "actor.hung_after_s=1.0", "actor.stop_timeout_s=2")
    # Actor 0 heartbeats once and hangs (ignoring SIGTERM); actor 1 heartbeats forever and exits on SIGTERM.
    script = """
import json, os, signal, sys, time
sys.path.insert(0, %r)
from actors.status import status_path, write_status
run, i = sys.argv[1], int(sys.argv[2])
if i == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    write_status(status_path(run, i), {"pid": os.getpid(), "t": time.time(), "state": "idle", "version": 0,
                                       "groups": 1, "env_steps": 10, "trajectories": 2})
    time.sleep(0.1 if i else 1000)
""" % str(REPO)
    out = io.StringIO()
    fleet = ScriptFleet(cfg, cfile, 2, tmp_path, out=out, script=script)
    fleet.start()
    pid1 = fleet.slots[1].proc.pid
    pids0 = {fleet.slots[0].proc.pid}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(pids0) < 3:
        fleet.poll()
        if fleet.slots[0].proc is not None:
            pids0.add(fleet.slots[0].proc.pid)
        time.sleep(0.05)
    assert len(pids0) >= 3, out.getvalue()  # hung twice, restarted twice
    assert "hung (last heartbeat" in out.getvalue()
    assert fleet.slots[1].proc.pid == pid1 and fleet.slots[1].starts == 1  # the healthy actor never stopped
    assert "[fleet] actors" in out.getvalue()
    wait_for(lambda: fleet.slots[0].proc is not None and (read_status(status_path(tmp_path, 0)) or {}).get("pid")
             == fleet.slots[0].proc.pid, 5, "the current actor 0 to ignore SIGTERM")
    procs = [s.proc for s in fleet.slots]
    t0 = time.monotonic()
    fleet.stop()  # actor 0 ignores SIGTERM: killed after stop_timeout_s
    assert time.monotonic() - t0 < slack(5)
    assert all(p.returncode is not None for p in procs)  # reaped: no zombies
    assert procs[1].returncode == 0 or procs[1].returncode == -signal.SIGTERM
    assert procs[0].returncode == -signal.SIGKILL


def test_fleet_does_not_restart_clean_exit(tmp_path):
    cfg, cfile = fleet_cfg(tmp_path)
    out = io.StringIO()
    fleet = ScriptFleet(cfg, cfile, 1, tmp_path, out=out, script="import sys; sys.exit(0)")
    assert fleet.run(install_signals=False) == 0
    assert fleet.slots[0].starts == 1 and fleet.slots[0].done and "not restarting" in out.getvalue()


def test_fleet_actor_ids_start_at_first_id(tmp_path):
    # Fleets on several hosts (Slurm nodes, Ray fleets) each take their own range of actor ids.
    cfg, cfile = fleet_cfg(tmp_path)
    script = "import sys, pathlib; pathlib.Path(sys.argv[1], f'ran_{sys.argv[2]}').touch()"
    fleet = ScriptFleet(cfg, cfile, 2, tmp_path, out=io.StringIO(), script=script, first_id=6)
    assert fleet.run(install_signals=False) == 0
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_6", "ran_7"]


def test_status_line_sums_counters_across_restarts(tmp_path):
    cfg, cfile = fleet_cfg(tmp_path)
    fleet = Fleet(cfg, cfile, 2, tmp_path, out=io.StringIO())
    write_status(status_path(tmp_path, 0), {"pid": 1, "groups": 5, "env_steps": 100, "trajectories": 10,
                                            "version": 2, "learner_version": 4})
    write_status(status_path(tmp_path, 1), {"pid": 2, "groups": 1, "env_steps": 10, "trajectories": 2,
                                            "version": 3, "learner_version": 4})
    line = fleet.status_line(now=0.0)
    assert "version 2..3" in line and "lag 2" in line and "trajectories 12" in line
    write_status(status_path(tmp_path, 0), {"pid": 9, "groups": 1, "env_steps": 40, "trajectories": 2,
                                            "version": 4, "learner_version": 4})  # restarted: counts from 0
    line = fleet.status_line(now=2.0)
    assert "trajectories 14" in line and "env steps/s 20" in line and "groups/s 0.50" in line
    # the buffer's view of the learner trails the version it broadcast last (no batch request since): no lag -1
    write_status(status_path(tmp_path, 1), {"pid": 2, "groups": 1, "env_steps": 10, "trajectories": 2,
                                            "version": 6, "learner_version": 5})
    write_status(status_path(tmp_path, 0), {"pid": 9, "groups": 1, "env_steps": 40, "trajectories": 2,
                                            "version": 6, "learner_version": 5})
    line = fleet.status_line(now=3.0)
    assert "learner 6 | lag 0" in line, line


# ---------------------------------------------------------------------------------------------- real fleet
OVERRIDES = ["actor.group_size=4", "env.envs_per_actor=2", "env.max_steps=160", "env.task_ids=[0,3]",
             "policy.hidden_size=32", "policy.intermediate_size=64", "policy.num_layers=1", "run.name=fleet",
             "buffer.dynamic_sampling=false", "buffer.pacing=false", "buffer.max_groups=100000",
             "buffer.max_staleness=100", "buffer.max_staleness_limit=100", "buffer.group_timeout_s=3", "actor.heartbeat_s=0.2",
             "actor.stats_every_s=1", "actor.restart_backoff_s=0.2", "actor.hung_after_s=30",
             "actor.stop_timeout_s=10", "logging.status_every_s=1", "actor.temperature=1.0",
             "transport.weights_port=0", "weights.export_async=false"]


@pytest.mark.slow
def test_fleet_end_to_end(tmp_path):
    from async_vla.buffer.service import BufferService
    from async_vla.messages import ControlCommand
    from async_vla.policy import build_policy
    from async_vla.transport import ControlClient

    cfg = load_config(None, OVERRIDES)
    run_dir = tmp_path / "run"
    svc = BufferService(cfg, run_dir, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    received, lock = [], threading.Lock()
    add = svc.buffer.add

    def spy(traj):
        with lock:
            received.append(traj)
        return add(traj)

    svc.buffer.add = spy
    stop = threading.Event()
    server = threading.Thread(target=svc.serve, args=(stop,), daemon=True)
    server.start()
    client = ControlClient(svc.control_endpoint)

    def command(cmd, value=None):
        client.send(ControlCommand(cmd, value))
        reply = client.recv(10.0)
        assert reply is not None and reply.command in ("ok", "stats"), reply
        return json.loads(reply.value) if cmd == "stats" else reply.value

    def by_actor(actor_id, pid=None):
        with lock:
            return [t for t in received if t.actor_id == actor_id]

    fleet_out = open(tmp_path / "fleet.out", "wb")
    fleet = subprocess.Popen(
        [sys.executable, str(REPO / "bin" / "actors"), *OVERRIDES, "--num", "2", "--run-dir", str(run_dir),
         "--connect", f"{svc.trajectory_endpoint},{svc.control_endpoint}"],
        stdout=fleet_out, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        wait_for(lambda: by_actor(0) and by_actor(1), 120, "trajectories from both actors")

        # A real broadcast from learner rank 0's publisher (gloo) reaches both actors; it is also exported,
        # which is where a restarted actor starts from.
        from async_vla.weights import WeightPublisher

        publisher = WeightPublisher(cfg, run_dir)
        assert publisher.wait_for_actors(2, 60) == 2
        v5 = {n: p.detach() + 0.01 for n, p in build_policy(cfg).named_parameters()}
        assert publisher.publish(5, v5.items())["confirmed"] == 2
        for a in (0, 1):
            wait_for(lambda a=a: any(5 in t.chunk_versions for t in by_actor(a)), 60, f"actor {a} at version 5")

        # kill -9 actor 0 while one of its groups is half-delivered (first wave sent, second running).
        st0 = read_status(status_path(run_dir, 0))
        pid0, pid1 = st0["pid"], read_status(status_path(run_dir, 1))["pid"]

        def partial_group_of_0():
            groups = {}
            for t in by_actor(0):
                groups.setdefault(t.group_id, []).append(t)
            return [g for g, ts in groups.items() if len(ts) < 4]

        def starts_of_0():
            return log_path(run_dir, 0).read_text().count("==== fleet: starting actor 0 ")

        killed_partial = []
        for _attempt in range(3):
            seen = wait_for(partial_group_of_0, 60, "a half-delivered group of actor 0", every=0.005)
            starts = starts_of_0()
            os.kill(pid0, signal.SIGKILL)
            t_kill = time.monotonic()
            time.sleep(0.5)
            killed_partial = [g for g in seen if g in partial_group_of_0()]
            if killed_partial:
                break  # else the race was lost (group completed just before the kill): try with the restart
            pid0 = wait_for(lambda: (s := read_status(status_path(run_dir, 0))) and s["pid"] != pid0 and s["pid"],
                            30, "restart")
        assert killed_partial, "could not kill actor 0 mid-group in 3 attempts"
        n1_at_kill = len(by_actor(1))
        # The fleet respawns it within a few seconds (back-off 0.2 s; 10 s allowed on a loaded host); the new
        # process reports in soon after.
        wait_for(lambda: starts_of_0() > starts, 10, "the fleet to respawn actor 0")
        assert time.monotonic() - t_kill < slack(10)
        new_pid = wait_for(lambda: (s := read_status(status_path(run_dir, 0))) and s["pid"] != pid0 and s["pid"],
                           30, "the respawned actor 0 to report")
        n0_before = len(by_actor(0))
        wait_for(lambda: len(by_actor(0)) > n0_before, 90, "trajectories from the restarted actor 0")
        assert all((t.chunk_versions == 5).all() for t in by_actor(0)[n0_before:])  # current weights at once
        # The partial group expires in the buffer (group_timeout_s=3) and is counted.
        wait_for(lambda: command("stats")["ledger"]["expired_partial"] >= 1, 30, "expired partial group")
        # The other actor never stopped: same process, and it kept delivering while actor 0 was down.
        assert read_status(status_path(run_dir, 1))["pid"] == pid1
        assert len(by_actor(1)) > n1_at_kill
        assert psutil.Process(new_pid).is_running()

        # SIGTERM to the fleet: every actor exits within a bounded time, all reaped.
        children = psutil.Process(fleet.pid).children()
        assert sorted(c.pid for c in children) == sorted([new_pid, pid1])
        t0 = time.monotonic()
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=30) == 0
        assert time.monotonic() - t0 < slack(20)
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
        for c in children:
            assert not Path(f"/proc/{c.pid}").exists() or psutil.Process(c.pid).status() != psutil.STATUS_ZOMBIE
        for a in (0, 1):
            assert read_status(status_path(run_dir, a))["state"] == "stopped"  # clean exit path, sockets closed
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait()
        fleet_out.close()
        client.close()
        if "publisher" in locals():
            publisher.close()
        stop.set()
        server.join(10)
        stats = svc.stats()
        svc.close()
    out = (tmp_path / "fleet.out").read_text()
    assert "[fleet] actors 2/2 alive" in out and "restarting in" in out

    # Everything that arrived decodes, carries consistent versions, and groups assemble (4 members, one state).
    groups = {}
    for t in received:
        assert t.behaviour_version == int(t.chunk_versions.min()) and set(t.chunk_versions.tolist()) <= {0, 5}
        assert t.group_size == 4 and t.run_id == "fleet" and t.task_id in (0, 3)
        groups.setdefault(t.group_id, []).append(t)
    complete = [ts for ts in groups.values() if len(ts) == 4]
    assert len(complete) >= 2
    assert all(len({(t.task_id, t.init_state_id) for t in ts}) == 1 for ts in complete)
    assert stats["ledger"]["duplicate"] == 0 and stats["ledger"]["malformed"] == 0
    assert stats["ledger"]["expired_partial"] >= 1
    assert stats["received"] == sum(stats["ledger"].values())
