"""Following a resumed learner: every version is tagged with its learner's lineage (the store names it, exports
carry it), so a resumed learner's versions - restarting below the dead learner's - are told apart from the dead
one's, and a policy that refuses old versions (the vLLM backend's ``VersionGuard``) takes them. The dead learner's
``latest`` export outlives it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from actors.actor import SerialActor
from actors.vllm_weights import VersionGuard
from async_vla.config import Config
from async_vla.messages import PolicyTag
from async_vla.phases import PhaseClock
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


def test_read_latest_judges_an_export_by_its_tag_from_its_header(tmp_path):
    export_weights(tmp_path, 5, _model(5), checksum(_model(5)), lineage="dead")
    assert read_latest(tmp_path, lineage="dead")[0] == PolicyTag("dead", 5)
    assert read_latest(tmp_path, lineage="resumed") is None
    assert read_latest(tmp_path)[0] == PolicyTag("dead", 5)                # no lineage asked: any
    assert read_latest(tmp_path, newer_than=PolicyTag("dead", 5)) is None
    assert read_latest(tmp_path, newer_than=PolicyTag("resumed", 9))[0] == PolicyTag("dead", 5)   # another line


def test_an_actor_started_on_a_dead_learners_export_follows_the_resumed_learner(tmp_path):
    cfg = _cfg()
    pub = WeightPublisher(cfg, tmp_path, lineage="dead")   # the learner that died: published and exported v5
    pub.publish(5, _model(5).items())
    pub.close()
    sub = WeightSubscriber(cfg, 1, tmp_path)               # the actor (re)starts on `latest`, as Actor._build
    guard = VersionGuard()
    guard.commit(-1)
    try:
        tag, _ = sub.fetch_latest()
        assert tag == PolicyTag("dead", 5)
        guard.commit(tag.version, tag.lineage)
        pub = WeightPublisher(cfg, tmp_path, lineage="resumed")   # resumed from the v2 checkpoint: v3, v4
        assert pub.wait_for_actors(1, 20) == 1
        for v in (3, 4):
            assert pub.publish(v, _model(v).items())["confirmed"] == 1
            got = sub.poll(timeout=10)
            assert got is not None and got[0] == PolicyTag("resumed", v) and checksum(got[1]) == checksum(_model(v))
            guard.commit(got[0].version, got[0].lineage)    # the vLLM side takes it: another lineage
    finally:
        sub.close()
        pub.close()


def test_an_actor_that_reaches_the_learner_while_reading_its_export_starts_on_that_export(tmp_path, monkeypatch):
    """A restarted actor reads ``latest`` while its weight thread registers with the running learner (a loaded
    machine): the export it read is that learner's, so it is kept, not dropped for the initial checkpoint."""
    import threading

    from async_vla.weights import subscriber as subscriber_mod

    cfg = _cfg(export_async=False)
    pub = WeightPublisher(cfg, tmp_path, lineage="running")
    pub.publish(7, _model(7).items())
    reading = threading.Event()
    real_read, real_port_open = subscriber_mod.read_latest, subscriber_mod.port_open

    def read_then_registered(*args, **kwargs):    # the read starts before the learner is reached, ends after
        reading.set()
        got = real_read(*args, **kwargs)
        assert pub.wait_for_actors(1, 20) == 1
        return got

    def port_open_once_reading(*args, **kwargs):
        reading.wait(20)
        return real_port_open(*args, **kwargs)

    monkeypatch.setattr(subscriber_mod, "read_latest", read_then_registered)
    monkeypatch.setattr(subscriber_mod, "port_open", port_open_once_reading)
    sub = WeightSubscriber(cfg, 1, tmp_path)
    try:
        got = sub.fetch_latest()
        assert got is not None and got[0] == PolicyTag("running", 7) and checksum(got[1]) == checksum(_model(7))
        assert sub.version == 7
    finally:
        sub.close()
        pub.close()


def test_catch_up_never_reads_the_dead_learners_export_once_the_resumed_one_is_followed(tmp_path):
    cfg = _cfg()
    pub = WeightPublisher(cfg, tmp_path, lineage="dead")
    sub = WeightSubscriber(cfg, 1, tmp_path)
    try:
        assert pub.wait_for_actors(1, 20) == 1
        pub.publish(4, _model(4).items())
        assert sub.poll(timeout=10)[0] == PolicyTag("dead", 4)
        pub.publish(5, _model(5).items())                  # exported; the actor never takes the broadcast
        pub.close()
        pub = WeightPublisher(_cfg(export=False), tmp_path, lineage="resumed")   # its own export not on disk yet
        assert pub.wait_for_actors(1, 30) == 1
        pub.publish(3, _model(3).items())
        # The actor holds the dead learner's v4 and tries to catch up from `latest`, which names the dead
        # learner's v5: refused from its header (not the lineage it follows now).
        assert sub.fetch_latest(newer_than=PolicyTag("dead", 4)) is None
        pub.cfg.export = True
        pub.publish(4, _model(4).items())
        pub.wait_export()
        got = sub.fetch_latest(newer_than=PolicyTag("dead", 4))   # the resumed learner's own export counts
        assert got is not None and got[0] == PolicyTag("resumed", 4) and checksum(got[1]) == checksum(_model(4))
        assert sub.poll(timeout=1) is None                 # v3 / v4 not handed out twice
        pub.publish(5, _model(5).items())
        got = sub.poll(timeout=10)
        assert got is not None and got[0] == PolicyTag("resumed", 5)
    finally:
        sub.close()
        pub.close()


def test_a_swap_point_takes_another_lineages_version_even_with_the_same_number():
    installed = []
    offer = (PolicyTag("resumed", 42), {"w": 0})
    actor = SimpleNamespace(tag=PolicyTag("dead", 42), weights_source=lambda: offer, _in_group=False, _held=None,
                            set_weights=lambda *args: installed.append(args), phases=PhaseClock())
    SerialActor.maybe_swap(actor)                          # the resumed learner trained its own v42
    assert installed == [offer]
    actor.tag = offer[0]
    SerialActor.maybe_swap(actor)                          # the same tag: nothing
    assert len(installed) == 1
