"""Same-host shared-memory path of the weight broadcast: arenas, readers, stale segments, and publishes that
take it (or fall back to the gloo wire) with the receivers' checksums matching."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from async_vla.config import Config
from async_vla.weight_buckets import BufferPool, checksum, pack
from async_vla.weight_shm import NAME, ShmArena, ShmPublisher, ShmReader, probe_ok, remove_stale_segments
from async_vla.weights import WeightPublisher, WeightSubscriber


def _model(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(rows, 300, generator=g),                       # > 64 KiB cap: own bucket
            "bias": torch.randn(33, generator=g).to(torch.bfloat16),
            "up": torch.randn(40, 17, generator=g).to(torch.float16),
            "steps": torch.arange(5, dtype=torch.int64), "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(2.5)}


def _cfg(tmp_path: Path, **weights) -> Config:
    cfg = Config()
    cfg.transport.weights_port = 0
    settings = {"timeout_s": 5.0, "join_timeout_s": 1.0, "heartbeat_s": 0.2, "bucket_mb": 0.0625,
                "shm_dir": str(tmp_path / "shm"), **weights}
    for k, v in settings.items():
        setattr(cfg.weights, k, v)
    (tmp_path / "shm").mkdir(exist_ok=True)
    return cfg


# ----------------------------------------------------------------------------------- arena and reader
def test_arena_packs_in_place_and_a_reader_copies_the_same_bytes_out(tmp_path):
    model = _model(1)
    arena = ShmArena(str(tmp_path / f"{NAME}{os.getpid()}_t_0"), 1 << 20, BufferPool())
    layout, buckets = pack(model, 64 * 1024, pool=arena)
    offsets = arena.place(buckets)
    assert offsets is not None and all(o % 64 == 0 for o in offsets)
    assert [arena.offset_of(b) for b in buckets] == offsets          # packed straight into the segment
    received = [torch.empty_like(b) for b in buckets]
    reader = ShmReader(str(tmp_path / f"{NAME}{os.getpid()}_t"))
    reader.copy_out(0, offsets, received)
    from async_vla.weight_buckets import unpack
    assert checksum(unpack(layout, received)) == checksum(model)
    with pytest.raises(ValueError, match="outside the segment"):
        reader.copy_out(0, [arena.nbytes - 8], [torch.empty(4, dtype=torch.int64)])
    with pytest.raises(ValueError, match="bucket count"):
        reader.copy_out(0, offsets[:1], received)
    reader.close()
    arena.close()
    assert not Path(arena.path).exists()


def test_arena_copies_in_what_was_packed_elsewhere_and_refuses_what_does_not_fit(tmp_path):
    arena = ShmArena(str(tmp_path / f"{NAME}{os.getpid()}_s_0"), 4096, BufferPool())
    big = arena.get(2048, torch.float32, "cpu")                     # 8 KiB > 4 KiB: from the fallback pool
    assert arena.offset_of(big) is None
    small = torch.arange(10, dtype=torch.float32)
    offsets = arena.place([small])
    assert offsets == [0]
    assert torch.equal(arena._base.narrow(0, 0, 40).view(torch.float32), small)
    assert arena.place([big]) is None
    arena.close()


def test_publisher_alternates_two_segments_and_grows_one_when_the_layout_outgrows_it(tmp_path):
    pool = BufferPool()
    side = ShmPublisher(tmp_path, "s" * 32, pool)
    assert probe_ok(side.probe, "s" * 32) and not probe_ok(side.probe, "other") and not probe_ok("", "x")
    gens = []
    for rows in (64, 64, 64, 64, 512):
        _, buckets = pack(_model(rows, rows), 64 * 1024, pool=side.arena())
        gen, offsets = side.place(buckets)
        gens.append(gen)
        reader = ShmReader(side.prefix)
        got = [torch.empty_like(b) for b in buckets]
        reader.copy_out(gen, offsets, got)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, buckets))
        reader.close()
    assert gens[:4] == [0, 1, 0, 1] and gens[4] == 2                 # reused, then one re-made larger
    assert all(side._arenas[i].offset_of(side._arenas[i]._base[:1]) == 0 for i in (0, 1))
    assert len(list(tmp_path.glob(NAME + "*"))) == 3                 # two segments + the probe
    side.close()
    assert not list(tmp_path.glob(NAME + "*"))


def test_segments_of_dead_publishers_are_removed_and_live_ones_kept(tmp_path):
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    dead = tmp_path / f"{NAME}{proc.pid}_abc_0"
    live = tmp_path / f"{NAME}{os.getppid()}_abc_0"
    other = tmp_path / "unrelated"
    for p in (dead, live, other):
        p.write_bytes(b"x")
    assert remove_stale_segments(tmp_path) == 1
    assert not dead.exists() and live.exists() and other.exists()


# ----------------------------------------------------------------------------------- publishes
def _publish_and_check(pub, subs, versions, rows=64) -> list[dict]:
    stats = []
    for v in versions:
        model = _model(v, rows)
        st = pub.publish(v, model.items())
        assert st["confirmed"] == len(subs) and st["failures"] == 0, st
        for s in subs:
            got = s.poll(timeout=10)
            assert got is not None and got[0] == v and checksum(got[1]) == checksum(model)
        stats.append(st)
    return stats


def test_same_host_subscribers_receive_through_shared_memory_across_reuse_and_growth(tmp_path):
    cfg = _cfg(tmp_path)
    pub = WeightPublisher(cfg, tmp_path)
    subs = [WeightSubscriber(cfg, i, tmp_path) for i in (1, 2)]
    try:
        assert pub.wait_for_actors(2, 20) == 2
        stats = _publish_and_check(pub, subs, [1, 2, 3, 4])
        stats += _publish_and_check(pub, subs, [5, 6], rows=2000)    # outgrows the segments: re-made
        assert {s["transport"] for s in stats} == {"shm"}
        segments = [p for p in (tmp_path / "shm").glob(NAME + "*") if not p.name.endswith(".probe")]
        assert len(segments) == 2
    finally:
        for s in subs:
            s.close()
        pub.close()
    assert not list((tmp_path / "shm").glob(NAME + "*"))               # close() removes segments and probe


def test_a_member_that_cannot_read_the_segment_puts_the_group_on_the_wire(tmp_path):
    cfg = _cfg(tmp_path)
    pub = WeightPublisher(cfg, tmp_path)
    subs = [WeightSubscriber(cfg, 1, tmp_path), WeightSubscriber(_cfg(tmp_path, shm=False), 2, tmp_path)]
    try:
        assert pub.wait_for_actors(2, 20) == 2
        assert {s["transport"] for s in _publish_and_check(pub, subs, [1, 2])} == {"gloo"}
    finally:
        for s in subs:
            s.close()
        pub.close()


def test_no_room_in_shared_memory_falls_back_to_the_wire_without_losing_a_version(tmp_path, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    cfg = _cfg(tmp_path)
    pub = WeightPublisher(cfg, tmp_path)
    subs = [WeightSubscriber(cfg, 1, tmp_path)]
    try:
        assert pub.wait_for_actors(1, 20) == 1
        assert {s["transport"] for s in _publish_and_check(pub, subs, [1, 2])} == {"gloo"}
        assert "No space left" in caplog.text
        assert not [p for p in (tmp_path / "shm").glob(NAME + "*") if not p.name.endswith(".probe")]
    finally:
        for s in subs:
            s.close()
        pub.close()


def test_missing_shm_dir_means_the_wire_not_an_error(tmp_path):
    cfg = _cfg(tmp_path, shm_dir=str(tmp_path / "absent"))
    pub = WeightPublisher(cfg, tmp_path)
    subs = [WeightSubscriber(cfg, 1, tmp_path)]
    try:
        assert pub.wait_for_actors(1, 20) == 1
        assert _publish_and_check(pub, subs, [1])[0]["transport"] == "gloo"
    finally:
        subs[0].close()
        pub.close()


@pytest.mark.slow
def test_bench_weights_times_every_path_and_each_went_where_it_says(tmp_path):
    from benchmarks import weights as bench

    out = bench.run(quick=True)        # raises if a mode's publish went over the other transport
    r = out["results"]["sizes"]["10M"]
    assert min(r["per_tensor_naive_s"], r["per_tensor_s"], r["bucketed_gloo_s"], r["bucketed_s"]) > 0
    assert r["speedup"] == pytest.approx(r["per_tensor_s"] / r["bucketed_s"])
    assert "bucketed gloo" in out["markdown"] and "| 10M" in out["markdown"]
