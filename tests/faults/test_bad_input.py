"""Bad input into a real BufferService over real sockets: 10,000 hostile frames of 21 kinds (runner/faults/fuzz.py),
each one counted as malformed by reason, never a crash; a message over transport.max_message_mb is dropped by ZeroMQ
before allocation and its sender disconnected, while everyone else carries on. The same against the live system
during training (buffer as its own process, RSS measured): test_live_faults.py."""

import time

from test_buffer_service import as_run_actor, running, service_cfg, stats

from async_vla.messages import GrantRequest
from async_vla.transport import ControlClient, TrajectorySender
from runner.faults.fuzz import KINDS, fuzz, send_oversize
from test_buffer import make_traj

RUN = "svc"


def test_fuzz_buffer_service_10000_frames(tmp_path):
    cfg = service_cfg(hwm=1000)
    cfg.transport.max_message_mb = 1.0
    with running(tmp_path, cfg) as svc:
        client = ControlClient(svc.control_endpoint)
        t0 = time.monotonic()
        sent = fuzz(svc.trajectory_endpoint, 10_000, RUN, seed=3,
                    until=lambda: stats(client)["received"] >= 10_000)   # then disconnect
        assert set(sent) == set(KINDS) and sum(sent.values()) == 10_000
        assert send_oversize(svc.trajectory_endpoint, 4 * 2**20, count=2) == 2   # 4 MiB > 1 MiB: never read
        good = TrajectorySender(svc.trajectory_endpoint)
        (ok,) = client.call(as_run_actor(tmp_path, GrantRequest(actor_id=0, want=1)), 10).group_ids
        for i in range(2):
            assert good.send(make_traj(ok, i, i == 0, G=2, run_id=RUN), timeout_s=5)
        deadline = time.monotonic() + 120
        while (s := stats(client))["received"] < 10_002 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        s = stats(client)
        elapsed = time.monotonic() - t0
        good.close()
        client.close()
    by = s["malformed_by_reason"]
    assert s["received"] == 10_002 == sum(s["ledger"].values())           # the oversize ones never became input
    assert s["ledger"]["malformed"] == 10_000                              # every hostile frame counted, once
    assert s["ledger"]["pending"] == 2                                     # valid input still flows (ready group)
    for reason in ("msgpack", "oversize", "schema_version", "unknown_kind", "dtype", "size_mismatch", "bad_logprob",
                   "negative_version", "type", "unknown_field", "missing_field", "frame_count", "unknown_task",
                   "wrong_run", "not_trajectory:heartbeat"):
        assert by.get(reason, 0) > 0, (reason, by)
    assert by["unknown_task"] == sent["unknown_task"] and by["not_trajectory:heartbeat"] == sent["not_trajectory"]
    assert by["oversize"] == sent["oversize_header"]
    print(f"10,000 hostile frames through the service in {elapsed:.1f} s: {by}")
