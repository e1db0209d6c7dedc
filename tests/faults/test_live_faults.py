"""Faults against one live local system (buffer, learner and actor fleet as separate processes, training for real;
runner/faults/live.py + runner/faults/chaos.py, the code bin/chaos runs with longer settings). The tests share the
system and run in file order; each one leaves it healthy for the next (run alone, each starts its own). The last test
stops it cleanly and audits every buffer incarnation: ledgers balance, nothing trained beyond eta, nothing admitted
twice.
"""

from __future__ import annotations

import pytest

from runner.faults import audit, chaos
from runner.faults.live import LiveSystem

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    system = LiveSystem(tmp_path_factory.mktemp("live") / "run")
    system.start(min_version=2)
    yield system
    system.stop()


def test_every_listening_socket_is_on_loopback(live):
    socks = live.listening()
    names = {name for name, _, _ in socks}
    assert {"buffer", "learner"} <= names, socks                     # ZeroMQ; weight store, dist store, gloo
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for _, ip, _ in socks), socks


def test_bad_input_10000_frames_during_training(live):
    r = chaos.bad_input(live, n=10_000, n_control=1000, oversize=3)
    assert r["crashes"] == 0
    assert r["malformed_counted"] == 10_000 and r["control_malformed_counted"] == 1000
    assert len(r["by_reason"]) >= 15 and r["by_reason"]["unknown_task"] == r["by_kind"]["unknown_task"]
    assert r["versions_during"] > 0                                   # training went on
    rss_before, rss_after_oversize, _ = r["buffer_rss_mb"]
    assert rss_after_oversize - rss_before < r["oversize_mb"] / 2     # 64 MiB messages never allocated


def test_flood_memory_bounded_actors_paced_nothing_lost(live):
    r = chaos.flood(live, seconds=10, paced=2, unpaced=2)
    assert r["sent"] > 1000 and r["lost"] == 0 and r["received"] == r["sent"]
    # Achieved rates, not encode-only ones: what got in per actor per second beside what the learner trained.
    assert r["delivered_per_actor_per_s"] > 0 and r["learner_rate_per_s"] > 0
    print(f"flood: {r['delivered_per_actor_per_s']:.0f} delivered/s per actor = {r['flood_ratio_per_actor']:.1f}x "
          f"the learner's {r['learner_rate_per_s']:.1f} trained/s; {r['encode_only_rate_per_s']:.0f}/s encode-only")
    assert r["groups_ready_max"] <= r["max_groups"] and r["held_bytes_max"] <= r["max_bytes"]
    assert r["buffer_rss_mb"][1] - r["buffer_rss_mb"][0] < 100
    assert r["grants_refused"] > 0 and r["wait_frac"] > 0.3           # paced / pushed back, not dropping
    assert r["versions_during"] > 0


def test_hostile_peers_are_counted_and_the_honest_system_keeps_training(live):
    r = chaos.hostile_peers(live, seconds=8)
    before, during, after = r["trained_per_s"]
    print(f"hostile peers: honest trained/s before {before:.1f}, during {during:.1f}, after {after:.1f}; "
          f"sent {r['sent']}; counted {r['counted']}")
    assert r["crashes"] == 0 and r["rollbacks"] == 0 and r["counted"]["groups_reclaimed"] == 0
    assert r["sent"]["forged_batch_requests"] > 0
    assert r["counted"]["learner_refused_bad_credential"] == r["sent"]["forged_batch_requests"]
    assert r["counted"]["ungranted_group"] >= r["sent"]["ungranted_trajectories"] > 0
    refused_ids = r["counted"]["actor_refused_no_credential"] + r["counted"]["actor_refused_bad_credential"]
    assert refused_ids == r["sent"]["fake_heartbeats"] > 0 and r["counted"]["actors_forgotten"] == 0
    assert r["learner_versions"][2] > r["learner_versions"][0] and after > 0   # the learner moved by itself


def test_actor_kill9_every_8s(live):
    r = chaos.actor_kills(live, every_s=8, duration_s=40)
    assert r["kills"] == 5 and r["learner_alive"]
    assert r["versions"][1] > r["versions"][0]
    assert r["rejoined"] == r["kills"] == r["rejoined_with_current_weights"], r["rejoin"]
    assert r["restarts_logged"] >= r["kills"]
    assert r["expired_groups"] >= 1                                   # the killed actors' groups, counted
    assert r["balanced"]


def test_learner_kill9_resume(live):
    r = chaos.learner_kill(live, outage_s=8)
    assert r["bit_equal"] and r["resumed_version"] == r["checkpoint_version"]
    assert r["version_at_kill"] - r["checkpoint_version"] <= live.cfg.run.checkpoint_every
    assert r["actors_same_pids"] and r["actors_kept_weights"]         # actors waited on their last weights
    assert all(v > r["checkpoint_version"] for v in r["actor_versions_after"].values())  # and took the new ones
    assert r["held_bytes_max"] <= live.cfg.buffer.max_bytes and r["actor_rss_growth_mb"] < 50
    assert r["grants_refused_during"] > 0                             # paced while nobody trains
    assert r["versions"][1] >= r["version_at_kill"] + 2
    if r["version_at_kill"] > r["checkpoint_version"]:
        assert r["rollbacks"][-1]["to"] == r["checkpoint_version"]
    f = r["in_flight"]
    assert sum(f["outcome"].values()) == f["in_flight"]               # every in-flight trajectory accounted for
    assert f["outcome"].get("taken_by_dead_learner", 0) == 0          # the batch it was training: trained again
    # Nothing was trained at a lag < 0 or > eta across the kill and the resume, by both witnesses: the buffer's
    # ledger and the learner ranks' own logs (written as each batch trained, by the dead and the resumed learner).
    eta = live.cfg.max_staleness
    lags = audit.learner_lags(live.run_dir)
    assert sum(lags.values()) > 0 and min(lags) >= 0 and max(lags) <= eta, lags
    ledger_lags = {int(k) for led in live.ledgers() for k in led["lag_histogram"]}
    assert ledger_lags and min(ledger_lags) >= 0 and max(ledger_lags) <= eta, ledger_lags


def test_buffer_kill9_and_restart(live):
    r = chaos.buffer_restart(live, how="kill", down_s=3)
    assert r["actors_same_pids"] and r["learner_same_pid"]            # nobody restarted: all reconnected
    assert r["versions"][1] > r["versions"][0] and r["new_received"] > 0
    assert r["new_duplicates"] == 0
    assert len(live.ledgers(archived_only=True)) == 1                 # the killed buffer's books kept aside


def test_zz_clean_stop_and_audit(live):
    codes = live.stop()
    assert codes == {"actors": 0, "learner": 0, "buffer": 0}
    final = chaos.final_report(live)
    assert final["unbalanced"] == 0 and final["beyond_eta"] == 0 and final["admitted_twice"] == 0
    assert final["invariant_failures"] == 0 and final["invariant_checks"] > 0       # the live structural check ran
    assert final["learner_lag_min"] >= 0 and final["learner_lag_max"] <= final["max_staleness"]
    a = final["accounting"]                                                          # every sent trajectory: one fate
    assert a["sent"] > 0 and sum(a["outcome"].values()) == a["sent"] and a["received_by_two_incarnations"] == 0
    assert final["trained"] > 0 and final["malformed"] >= 10_000
