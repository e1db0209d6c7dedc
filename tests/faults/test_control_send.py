"""Control sends never block: a DEALER whose buffer is unreachable for long fills its queue, and then a plain send
would block forever (an actor stuck in a heartbeat send looks hung and gets restarted). Heartbeats and stats are
dropped and counted; requests fail with ControlTimeout."""

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from async_vla.config import load_config
from async_vla.messages import ActorStats, ControlCommand, GrantRequest, Heartbeat
from async_vla.transport import ControlClient, ControlServer, ControlTimeout
from timing import slack


@pytest.fixture
def unreachable():
    """Makes endpoints nobody ever listens on: IPC paths that were never bound (removed after the test).

    Not a TCP port bound and then closed: ZeroMQ closes asynchronously, so a connect racing the close can reach
    the dying listener for a moment and drain the queue into its kernel buffer (seen on CI: the queue had room
    again and the request did not time out). mkdtemp, not tmp_path: an IPC path must stay under ~107 bytes.
    """
    made = []

    def make() -> str:
        made.append(tempfile.mkdtemp(prefix="avla-unreachable-"))
        return f"ipc://{made[-1]}/nobody.sock"

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def test_full_queue_drops_heartbeats_and_requests_time_out(unreachable):
    client = ControlClient(unreachable(), hwm=4)
    try:
        t0 = time.monotonic()
        results = [client.send(Heartbeat(actor_id=1, pid=2)) for _ in range(50)]
        results += [client.send(ActorStats(actor_id=1)) for _ in range(10)]
        assert time.monotonic() - t0 < slack(2.0)                # never blocked (a blocked send waits forever)
        assert results[:4] == [True] * 4                          # the queue took what fits (hwm)
        assert results.count(False) == client.dropped.total >= 50
        assert client.dropped.by_reason["heartbeat"] >= 40 and client.dropped.by_reason["actor_stats"] == 10
        t0 = time.monotonic()
        with pytest.raises(ControlTimeout, match="grant_request: the control queue .* stayed full for 0.3 s"):
            client.request(GrantRequest(actor_id=1), timeout_s=0.3)
        assert 0.25 < time.monotonic() - t0 < slack(2.0)
    finally:
        client.close()


def test_call_times_out_without_a_reply_and_succeeds_with_one(unreachable):
    client = ControlClient(unreachable())
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlTimeout, match="no reply"):
            client.call(ControlCommand("stats"), timeout_s=0.3)   # queued fine, but nobody answers
        assert time.monotonic() - t0 < slack(2.0)
    finally:
        client.close()
    server = ControlServer("tcp://127.0.0.1:0")
    client = ControlClient(server.endpoint)
    client.send(Heartbeat(actor_id=3, pid=4))
    peer, msg = server.recv(5)
    assert isinstance(msg, Heartbeat) and client.dropped.total == 0
    server.reply(peer, ControlCommand("ok", 1))
    assert client.recv(5) == ControlCommand("ok", 1)
    client.close()
    server.close()


def test_actor_tick_never_hangs_when_the_buffer_is_gone(tmp_path, unreachable):
    """The actor's own heartbeat path (tick) against a full queue: returns at once, counts the drops, and the
    status file the fleet reads shows them (so the fleet sees a live actor, not a hung one)."""
    from actors.actor import Actor
    from actors.status import read_status, status_path

    cfg = load_config(None, ["actor.heartbeat_s=0.001", "actor.stats_every_s=0.001"])
    actor = Actor(cfg, 7, tmp_path, {"trajectory": unreachable(), "control": unreachable()})
    actor._connect()
    actor.control.close()
    actor.control = ControlClient(unreachable(), hwm=2, ctx=actor._ctx)
    t0 = time.monotonic()
    for _ in range(200):
        actor.tick()
        time.sleep(0.002)
    assert time.monotonic() - t0 < slack(10)
    st = read_status(status_path(tmp_path, 7))
    assert st["pid"] and st["control_dropped"]["heartbeat"] >= 100
    actor._retry_at = 0.0
    from actors.rollout import RolloutStats

    from async_vla.messages import ROOT, PolicyTag

    actor.core = type("Core", (), {"maybe_swap": lambda self: None, "tag": PolicyTag(ROOT, 0),
                                   "totals": RolloutStats()})()
    t0 = time.monotonic()
    assert actor._next_group() is None                       # the grant request is dropped, not blocking
    assert time.monotonic() - t0 < slack(2.0) and actor._grant_sent_at is None
    assert actor.control.dropped.by_reason["grant_request"] == 1 and actor.control.dropped.by_reason["actor_stats"]
    actor.core = None
    actor.sender.close(flush_s=0)
    actor.control.close()
    actor._ctx.term()


def test_a_refusal_answers_the_weights_asked_with(tmp_path, unreachable, monkeypatch):
    """An empty grant is waited out (retry_after_s) unless the actor's weights change: new weights are a new
    question, asked at once. The refusal's reason is what the actor's weight sources see (a catch-up starts only
    on "behind" / "dead": tests/test_weight_sources.py). The actor's clock is frozen here (``actors.actor.time``),
    so the waits it picks are read exactly."""
    import types

    import actors.actor as actor_module
    from actors.actor import Actor
    from actors.rollout import RolloutStats
    from async_vla.messages import AdmissionGrant, PolicyTag

    cfg = load_config(None, [])
    actor = Actor(cfg, 3, tmp_path, {"trajectory": unreachable(), "control": unreachable()})
    actor._connect()
    now = 1000.0
    monkeypatch.setattr(actor_module, "time", types.SimpleNamespace(monotonic=lambda: now, time=time.time,
                                                                     sleep=time.sleep))
    actor.core = types.SimpleNamespace(maybe_swap=lambda: None, tag=PolicyTag("l", 5), totals=RolloutStats())
    try:
        actor._asked = PolicyTag("l", 5)
        actor._handle(AdmissionGrant(actor_id=3, refused="wait", retry_after_s=5.0))
        assert actor._retry_at - now == 5.0 and actor._refused == "wait"
        actor.core.tag = PolicyTag("l", 6)                   # new weights: asked at once
        assert actor._next_group() is None and actor._asked == PolicyTag("l", 6)
        actor._handle(AdmissionGrant(actor_id=3, refused="behind", retry_after_s=5.0))
        assert actor._refused == "behind"
        actor._handle(AdmissionGrant(actor_id=3, group_ids=["g1"]))
        assert list(actor.pending) == ["g1"] and actor._refused == ""
    finally:
        actor.core = None
        actor.control.close()
        actor.sender.close(flush_s=0)
        actor._ctx.term()


def test_a_leaked_client_in_a_reference_cycle_never_blocks_the_garbage_collector(tmp_path, unreachable):
    """A ControlClient (own context, a queued message, never closed) caught in a reference cycle, as a failed
    test's traceback holds it: collecting it must not hang in Context.term(). Run in a subprocess with a timeout,
    so that a regression fails here instead of hanging whichever test the collector happens to run in."""
    import subprocess
    import sys

    code = f"""
import gc, time
from async_vla.messages import Heartbeat
from async_vla.transport import ControlClient, TrajectorySender
gc.disable()
for cls in (ControlClient, TrajectorySender):
    c = cls({unreachable()!r})
    c.cycle = c                                  # the cycle
    if cls is ControlClient:
        c.send(Heartbeat(actor_id=1, pid=2))     # something queued for a peer that never comes
    del c
t0 = time.monotonic()
gc.collect()
print("collected in", round(time.monotonic() - t0, 3))
"""
    repo = Path(__file__).resolve().parent.parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "collected in" in out.stdout, out.stderr[-2000:]
