"""Monitor writes TensorBoard events under <run>/tb; read_tags / read_scalars read them back."""

import numpy as np

from async_vla.metrics import (REQUIRED_TAG_PREFIXES, REQUIRED_TAGS, Monitor, missing_required, read_scalars,
                               read_tags)


def test_monitor_writes_and_read_tags_reads_back(tmp_path):
    with Monitor(tmp_path) as mon:
        mon.scalar("loss/policy", 0.5, 1)
        mon.scalar("loss/policy", 0.25, 2)
        mon.scalars({tag: 1.0 for tag in REQUIRED_TAGS if tag != "loss/policy"}, 1)
        mon.scalars({"rollout/success_rate_by_task/3": np.float32(0.5), "not/a/number": "x",
                     "flag/bool": True}, 1)
        mon.histogram("learner/lag", [0, 1, 1, 2], 1)
        mon.histogram("learner/empty", [], 1)  # skipped, no crash
        mon.flush()
    tags = read_tags(tmp_path / "tb")
    assert set(REQUIRED_TAGS) <= tags
    assert "learner/lag" in tags and "rollout/success_rate_by_task/3" in tags and "flag/bool" in tags
    assert "not/a/number" not in tags and "learner/empty" not in tags
    assert missing_required(tags) == []
    assert read_scalars(tmp_path / "tb", "loss/policy") == [(1, 0.5), (2, 0.25)]


def test_several_writers_merge_and_missing_tags_reported(tmp_path):
    a, b = Monitor(tmp_path), Monitor(tmp_path)  # e.g. learner rank 0 and the buffer service
    a.scalar("loss/policy", 1.0, 0)
    b.scalar("buffer/received", 3.0, 0)
    a.close()
    b.close()
    tags = read_tags(tmp_path / "tb")
    assert {"loss/policy", "buffer/received"} <= tags
    missing = missing_required(tags)
    assert "eval/success_rate" in missing and REQUIRED_TAG_PREFIXES[0] + "*" in missing
    assert "loss/policy" not in missing


def test_disabled_monitor_writes_nothing(tmp_path):
    mon = Monitor(tmp_path, enabled=False)
    mon.scalar("loss/policy", 1.0, 0)
    mon.scalars({"a": 1.0}, 0)
    mon.histogram("h", [1.0], 0)
    mon.close()
    assert not (tmp_path / "tb").exists()
    assert read_tags(tmp_path / "tb") == set()
