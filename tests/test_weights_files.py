"""Weights without a shared filesystem: the buffer's weights file server hands out the learner's newest export in
chunks; an actor's mirror copies it into its own run directory, where the usual reader loads it."""

from __future__ import annotations

import torch

from async_vla.weights import files as weights_files
from async_vla.weights.files import WeightsFileServer, mirror_latest
from async_vla.messages import PolicyTag
from async_vla.weights.export import export_weights, read_latest


def test_an_actor_elsewhere_mirrors_the_newest_export_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(weights_files, "CHUNK_BYTES", 100)   # many chunks, so the reassembly is exercised
    learner, actor = tmp_path / "learner" / "weights", tmp_path / "actor" / "weights"
    learner.mkdir(parents=True)
    server = WeightsFileServer(learner, "tcp://127.0.0.1:0")
    try:
        assert mirror_latest(server.endpoint, actor) is None                # nothing exported yet
        named = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float32)}
        export_weights(learner, 3, named, 1.0, lineage="l")
        assert mirror_latest(server.endpoint, actor) == PolicyTag("l", 3)
        tag, tensors, _ = read_latest(actor)
        assert tag.version == 3 and all(torch.equal(tensors[k], v) for k, v in named.items())
        assert mirror_latest(server.endpoint, actor, PolicyTag("l", 3)) is None   # not newer than what we hold
        named["w"] = named["w"] * 2
        export_weights(learner, 5, named, 2.0, lineage="l")
        assert mirror_latest(server.endpoint, actor, PolicyTag("l", 3)) == PolicyTag("l", 5)
        tag, tensors, _ = read_latest(actor)
        assert tag.version == 5 and torch.equal(tensors["w"], named["w"])
        assert sorted(p.name for p in actor.glob("v*.safetensors")) == ["v5.safetensors"]   # the mirror keeps one
        assert server.served_bytes >= 2 * (learner / "v5.safetensors").stat().st_size
        export_weights(learner, 2, named, 3.0, lineage="m")              # a resumed learner: another lineage,
        assert mirror_latest(server.endpoint, actor, PolicyTag("l", 5)) == PolicyTag("m", 2)   # lower, but newer
    finally:
        server.close()
