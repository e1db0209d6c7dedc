"""Milestone exports: the learner keeps the export of every ``run.eval_every``-th version for bin/train's evaluator,
so evaluation lands on exactly those versions however far the latest export has moved on."""

import torch

from async_vla.weights.buckets import checksum
from async_vla.weights.packer import pack
from async_vla.weights.export import (
    MAX_MILESTONES, MILESTONES, Exporter, discard_milestones, milestones, newest_milestone, read_latest,
)
from actors.weight_loading import load_weights_path


def _model(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), float(version)), "b": torch.arange(3, dtype=torch.float32) + version}


def _export_all(exporter: Exporter, versions) -> None:
    for v in versions:
        model = _model(v)
        layout, buckets = pack(model.items(), 1024)
        assert exporter.start(v, layout, buckets, checksum(model), sync=True) is None


def test_every_multiple_is_kept_beyond_pruning_and_loads_as_its_version(tmp_path):
    (tmp_path / MILESTONES).mkdir()
    _export_all(Exporter(tmp_path, keep=2, milestone_every=5), range(13))
    assert [v for v, _ in milestones(tmp_path)] == [5, 10]
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v11.safetensors", "v12.safetensors"]
    for v, path in milestones(tmp_path):
        version, state = load_weights_path(str(path), -1)
        assert version == v and torch.equal(state["w"], _model(v)["w"])
    assert read_latest(tmp_path)[0].version == 12          # the pointer still names the newest export


def test_a_skipped_multiple_is_stood_in_for_by_the_next_export_and_the_first_is_never_one(tmp_path):
    (tmp_path / MILESTONES).mkdir()
    _export_all(Exporter(tmp_path, keep=2, milestone_every=5), [10, 13, 16, 19, 22])   # a resumed part, publish_every=3
    assert [v for v, _ in milestones(tmp_path)] == [16, 22]


def test_no_milestones_unless_an_evaluator_asked_and_never_more_than_the_cap(tmp_path):
    _export_all(Exporter(tmp_path, keep=2, milestone_every=1), range(6))
    assert milestones(tmp_path) == [] and not (tmp_path / MILESTONES).exists()
    (tmp_path / MILESTONES).mkdir()
    _export_all(Exporter(tmp_path, keep=2, milestone_every=1), range(6, 20))   # nobody reads them
    assert [v for v, _ in milestones(tmp_path)] == list(range(20 - MAX_MILESTONES, 20))


def test_newest_milestone_skips_older_ones_and_discard(tmp_path):
    (tmp_path / MILESTONES).mkdir()
    _export_all(Exporter(tmp_path, keep=1, milestone_every=2), range(7))   # milestones 2, 4, 6
    assert newest_milestone(tmp_path, after=6) is None
    assert [v for v, _ in milestones(tmp_path)] == [2, 4, 6]
    got = newest_milestone(tmp_path, after=1)
    assert got is not None and got.name == "v6.safetensors"
    assert [v for v, _ in milestones(tmp_path)] == [6]             # 2 and 4 were skipped
    assert discard_milestones(tmp_path) == 1 and milestones(tmp_path) == []
