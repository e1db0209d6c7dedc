"""Monitor writes TensorBoard events under <run>/tb; read_tags / read_scalars read them back."""

import numpy as np

from async_vla.metrics import Monitor, read_scalars, read_tags
from tests.tb_helpers import REQUIRED_TAG_PREFIXES, REQUIRED_TAGS, missing_required


def test_monitor_writes_and_read_tags_reads_back(tmp_path):
    with Monitor(tmp_path) as mon:
        mon.scalar("loss/policy", 0.5, 1)
        mon.scalar("loss/policy", 0.25, 2)
        mon.scalars({tag: 1.0 for tag in REQUIRED_TAGS if tag != "loss/policy"}, 1)
        mon.scalars({"rollout/success_rate_by_task/3": np.float32(0.5), "not/a/number": "x",
                     "flag/bool": True}, 1)
        mon.scalars({f"time/{kind}/other_frac": 0.01 for kind in ("actor", "learner", "buffer")}, 1)
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


def test_event_records_carry_the_tfrecord_checksums():
    from async_vla.tb_events import crc32c, masked_crc32c, record

    assert crc32c(b"123456789") == 0xE3069283          # the CRC-32C check value
    assert crc32c(b"") == 0
    data = b"an event"
    rec = record(data)
    assert len(rec) == 8 + 4 + len(data) + 4 and rec[12:-4] == data
    assert int.from_bytes(rec[:8], "little") == len(data)
    assert int.from_bytes(rec[8:12], "little") == masked_crc32c(rec[:8])
    assert int.from_bytes(rec[-4:], "little") == masked_crc32c(data) != crc32c(data)


def test_events_read_back_with_tensorboard_as_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Monitor(tmp_path, flush_secs=1) as mon:
        for step in range(3):
            mon.scalars({"buffer/received": 10.0 * step, "buffer/lag_mean": step / 4}, step)
        mon.histogram("buffer/trained_lag", [0, 1, 1, 2, 5], 2)
    (path,) = (tmp_path / "tb").iterdir()
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("buffer/received")] == [(0, 0.0), (1, 10.0), (2, 20.0)]
    assert [(e.step, e.value) for e in acc.Scalars("buffer/lag_mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    (h,) = acc.Histograms("buffer/trained_lag")
    v = h.histogram_value
    assert h.step == 2 and (v.min, v.max, v.num, v.sum, v.sum_squares) == (0, 5, 5, 9, 31)
    assert sum(v.bucket) == 5 and v.bucket_limit[-1] == 5
