"""Following a resumed learner: its versions restart below the dead learner's, so the subscriber numbers learner
sessions (``lineage``), exports carry their session, and a policy that refuses old versions (the vLLM backend's
``VersionGuard``) takes a lower version of a newer session. The dead learner's ``latest`` export outlives it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from actors.actor import SerialActor
from actors.vllm_weights import VersionGuard
from async_vla.config import Config
from tests.weight_helpers import weights_cfg
from async_vla.weights.buckets import checksum
from async_vla.weights.export import export_weights, read_latest
from async_vla.weights import WeightPublisher, WeightSubscriber

FAST = {"timeout_s": 5.0, "join_timeout_s": 1.0, "heartbeat_s": 0.2, "bucket_mb": 0.25, "export_async": False}


def _cfg(**weights) -> Config:
    return weights_cfg(FAST, **weights)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g)}


def test_read_latest_skips_another_sessions_export_from_its_header(tmp_path):
    export_weights(tmp_path, 5, _model(5), checksum(_model(5)), session="dead")
    meta: dict = {}
    assert read_latest(tmp_path, session="dead", meta_out=meta)[0] == 5 and meta["session"] == "dead"
    assert read_latest(tmp_path, session="resumed") is None
    assert read_latest(tmp_path)[0] == 5                                   # no session asked: any
    export_weights(tmp_path, 6, _model(6), checksum(_model(6)))            # an export without one counts as any
    assert read_latest(tmp_path, session="resumed")[0] == 6


def test_an_actor_started_on_a_dead_learners_export_follows_the_resumed_learner(tmp_path):
    cfg = _cfg()
    pub = WeightPublisher(cfg, tmp_path)                   # the learner that died: published and exported v5
    pub.publish(5, _model(5).items())
    pub.close()
    sub = WeightSubscriber(cfg, 1, tmp_path)               # the actor (re)starts on `latest`, as Actor._build
    guard = VersionGuard()
    guard.commit(-1)
    try:
        version, _ = sub.fetch_latest()
        guard.commit(version, sub.lineage)
        assert (version, sub.lineage) == (5, 0)
        pub = WeightPublisher(cfg, tmp_path)               # resumed from the v2 checkpoint: it publishes v3, v4
        assert pub.wait_for_actors(1, 20) == 1
        for v in (3, 4):
            assert pub.publish(v, _model(v).items())["confirmed"] == 1
            got = sub.poll(timeout=10)
            assert got is not None and got[0] == v and checksum(got[1]) == checksum(_model(v)), got
            assert sub.lineage == 1
            guard.commit(got[0], sub.lineage)              # the vLLM side takes it: a newer session
    finally:
        sub.close()
        pub.close()


def test_catch_up_never_reads_the_dead_learners_export_once_the_resumed_one_is_followed(tmp_path):
    cfg = _cfg()
    pub = WeightPublisher(cfg, tmp_path)
    sub = WeightSubscriber(cfg, 1, tmp_path)
    try:
        assert pub.wait_for_actors(1, 20) == 1
        pub.publish(4, _model(4).items())
        assert sub.poll(timeout=10)[0] == 4 and sub.lineage == 0
        pub.publish(5, _model(5).items())                  # exported; the actor never takes the broadcast
        pub.close()
        pub = WeightPublisher(_cfg(export=False), tmp_path)   # resumed; its own export not on disk yet
        assert pub.wait_for_actors(1, 30) == 1
        pub.publish(3, _model(3).items())
        # The actor still believes the learner is at v5 (the buffer has not heard of the resume) and tries to
        # catch up from `latest`, which names the dead learner's v5: refused from its header.
        assert sub.fetch_latest(newer_than=5) is None
        pub.cfg.export = True
        pub.publish(4, _model(4).items())
        pub.wait_export()
        # The resumed learner's own export counts, although the actor's v5 (of the older session) is higher.
        got = sub.fetch_latest(newer_than=5)
        assert got is not None and got[0] == 4 and checksum(got[1]) == checksum(_model(4)) and sub.lineage == 1
        assert sub.poll(timeout=1) is None                 # v3 / v4 not handed out twice
        pub.publish(5, _model(5).items())
        got = sub.poll(timeout=10)
        assert got is not None and got[0] == 5 and sub.lineage == 1
    finally:
        sub.close()
        pub.close()


def test_a_swap_point_takes_a_newer_sessions_version_even_with_the_same_number():
    installed = []
    actor = SimpleNamespace(version=42, lineage=0, weights_source=lambda: (42, {"w": 0}, 1),
                            set_weights=lambda *args: installed.append(args))
    SerialActor.maybe_swap(actor)                          # the resumed learner trained its own v42
    assert installed == [(42, {"w": 0}, 1)]
    actor.lineage = 1
    SerialActor.maybe_swap(actor)                          # the same version of the same session: nothing
    assert len(installed) == 1
