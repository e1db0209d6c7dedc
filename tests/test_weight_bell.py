"""The same-host doorbell (async_vla.weights.bell, bell_versions, native/bell.c): futexes and atomics across
processes, the member following the publisher's packing (sums against tensor_sum, the slow reference), liveness
and timeouts, records that are not to be trusted, and publishes through it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from async_vla.weights import native
from async_vla.weights.bell import (
    _POST, _REC, _SLOTS, BellDropped, BellMember, BellPublisher, PostReplaced, REC_FIELDS, SLOT, bell_path,
)
from async_vla.weights.bell_versions import EarlyPost, SharePlan, ViewPlan
from async_vla.weights.buckets import checksum, fold, tensor_sum, unpack, verify_shares
from async_vla.weights.packer import pack
from async_vla.weights.shm import NAME
from async_vla.weights import WeightPublisher, WeightSubscriber
from tests.test_weight_shm import _cfg, _model, _publish_and_check, _slow
from tests.weight_helpers import mixed_model
from timing import slack

pytestmark = pytest.mark.skipif(not native.bell_available(), reason="doorbell needs the native library: "
                                + native.status())


def _probe(tmp_path, locked: bool = True):
    """A stand-in for the publisher's probe lock (members check it between wait slices)."""
    import fcntl

    path = tmp_path / f"{NAME}{os.getpid()}_test.probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if locked:
        fcntl.flock(fd, fcntl.LOCK_EX)
    return str(path), fd


def _layout_and_buckets(model, cap=64 * 1024):
    return pack(model, cap)


def _segment(buckets, fill: bool = True):
    """A stand-in segment: the buckets laid end to end at 64-byte aligned offsets after the control word, as the
    arena does; (offsets, the flat uint8 buffer), the bytes copied in when ``fill``."""
    offsets, n = [], 64
    for b in buckets:
        offsets.append(n)
        n = (n + b.numel() * b.element_size() + 63) // 64 * 64
    seg = torch.zeros(n, dtype=torch.uint8)
    if fill:
        for b, off in zip(buckets, offsets):
            seg[off:off + b.numel() * b.element_size()].copy_(b.view(-1).view(torch.uint8))
    return offsets, seg


# ----------------------------------------------------------------------------- native primitives
def _waiter(path: str, want: int, timeout_s: float, out) -> None:
    import mmap

    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
    addr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    out.put("waiting")
    t0 = time.monotonic()
    ok = native.lib().avla_wait_eq(addr, want, int(timeout_s * 1e9), 0) == 0
    out.put((ok, time.monotonic() - t0))


def test_a_futex_word_wakes_a_waiter_in_another_process_and_a_wait_times_out_without_it(tmp_path):
    import mmap

    path = str(tmp_path / "word")
    with open(path, "wb") as f:
        f.write(bytes(4096))
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
    addr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_waiter, args=(path, 7, 30.0, out))
    p.start()
    assert out.get(timeout=60) == "waiting"
    time.sleep(0.2)
    native.lib().avla_set_wake(addr, 7)
    ok, waited = out.get(timeout=30)
    p.join(10)
    assert ok and waited < min(slack(20), 29)   # woken, not timed out (30 s)
    p = ctx.Process(target=_waiter, args=(path, 8, 0.3, out))   # nobody sets 8: times out
    p.start()
    assert out.get(timeout=60) == "waiting"
    ok, waited = out.get(timeout=30)
    p.join(10)
    assert not ok and waited >= 0.29


# ----------------------------------------------------------------------------- a publisher and a member in-process
def _bell(tmp_path, members=2, epoch=1):
    prefix = str(tmp_path / f"{NAME}{os.getpid()}_abcd")
    return BellPublisher(prefix, epoch, members), prefix


def test_a_member_sums_its_share_while_the_publisher_packs_and_the_sums_match_the_reference(tmp_path):
    model = mixed_model(3, scale=4)
    layout, buckets = _layout_and_buckets(model.items())
    offsets, seg = _segment(buckets, fill=False)     # written below, tensor by tensor, as the packer does
    pub, _ = _bell(tmp_path)
    probe, probe_fd = _probe(tmp_path)
    members = [BellMember(pub.path, r, 1, probe) for r in (1, 2)]
    pub.wait_joined(time.monotonic() + 5)
    p = pub.post(9, 0, offsets, 2, layout.digest, layout.total_bytes, sealed=False)
    post = EarlyPost(pub, p, layout, 0, offsets, 2)

    def packer():          # the publisher packs tensor by tensor, slowly, moving the progress
        for e in layout.entries:
            t = model[e.spec.name]
            b = buckets[e.bucket]
            off = offsets[e.bucket] + e.offset * b.element_size()
            seg[off:off + e.spec.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
            post.advance(e.spec.nbytes)
            time.sleep(0.002)
        pub.seal(p, layout.total_bytes)

    th = threading.Thread(target=packer)
    th.start()
    got = {}
    for m in members:
        rec = m.record(m.next_post(5.0))
        assert rec["version"] == 9 and rec["offsets"] == offsets and rec["split"] == 2
        plan = SharePlan(layout, rec["split"], m.rank, offsets)
        sums = m.follow_sum(p, plan, seg.data_ptr(), time.monotonic() + 10, lambda: False)
        assert sums == [tensor_sum(model[name]) for name in plan.names]
        got[m.rank] = plan.value(sums)
        m.wait_sealed(p, layout.total_bytes, time.monotonic() + 10, lambda: False)
        m.ack(p, True, got[m.rank])
    th.join()
    shares = verify_shares(layout, 2)
    assert sorted(SharePlan(layout, 2, r, offsets).names for r in (1, 2)) == sorted(shares)
    assert pub.collect(p, time.monotonic() + 5) == [(1, got[1]), (1, got[2])]
    assert fold((nm, tensor_sum(t), t.numel()) for nm, t in model.items()) == int(checksum(model))
    pub.verdict(p, True)
    assert all(m.wait_verdict(p, time.monotonic() + 5, lambda: False) for m in members)
    for m in members:
        m.close()
    pub.drop()
    os.close(probe_fd)


def test_an_aborted_post_stops_its_followers_and_a_drop_ends_the_epoch(tmp_path):
    model = mixed_model(4)
    layout, _ = _layout_and_buckets(model.items())
    offsets = [64 * (i + 1) for i in range(len(layout.buckets))]
    pub, _ = _bell(tmp_path, members=1)
    probe, probe_fd = _probe(tmp_path)
    m = BellMember(pub.path, 1, 1, probe)
    p = pub.post(1, 0, offsets, 1, layout.digest, layout.total_bytes, sealed=False)
    assert m.next_post(1.0) == p
    plan = SharePlan(layout, 1, 1, offsets)
    seg = torch.zeros(1 << 20, dtype=torch.uint8)
    threading.Timer(0.2, pub.abort).start()
    t0 = time.monotonic()
    with pytest.raises(PostReplaced):
        m.follow_sum(p, plan, seg.data_ptr(), time.monotonic() + 20, lambda: False)
    assert time.monotonic() - t0 < min(slack(10), 19)   # woken by the abort, not by its deadline (20 s)
    aborted = m.next_post(1.0)
    assert aborted == p + 1 and m.record(aborted) is None     # an abort carries no version
    threading.Timer(0.2, pub.drop).start()
    with pytest.raises(BellDropped):
        m.wait_verdict(aborted, time.monotonic() + 20, lambda: False)
    assert m.dropped and not os.path.exists(pub.path)           # the page goes with the epoch
    m.close()
    os.close(probe_fd)


def test_a_member_gives_up_when_the_publisher_is_gone_or_time_is_up(tmp_path):
    pub, _ = _bell(tmp_path, members=1)
    probe, probe_fd = _probe(tmp_path)
    m = BellMember(pub.path, 1, 1, probe)
    p = pub.post(1, 0, [64], 0, 1, 1000, sealed=False)
    with pytest.raises(TimeoutError):
        m.wait_sealed(p, 1000, time.monotonic() + 0.3, lambda: False)
    with pytest.raises(BellDropped, match="stopping"):
        m.wait_verdict(p, time.monotonic() + 5, lambda: True)
    os.close(probe_fd)             # the publisher's probe lock goes with its process
    with pytest.raises(RuntimeError, match="publisher is gone"):
        m.wait_verdict(p, time.monotonic() + 5, lambda: False)
    m.close()
    pub.drop()


def _hold_member(path: str, rank: int, probe: str, out) -> None:
    m = BellMember(path, rank, 1, probe)
    out.put((rank, os.getpid()))
    time.sleep(120)
    m.close()


def test_collect_fails_at_once_for_a_killed_member_and_at_the_deadline_for_a_silent_one(tmp_path):
    pub, _ = _bell(tmp_path, members=2)
    probe, probe_fd = _probe(tmp_path)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hold_member, args=(pub.path, r, probe, out), daemon=True) for r in (1, 2)]
    for proc in procs:
        proc.start()
    pids = dict(out.get(timeout=60) for _ in procs)
    pub.wait_joined(time.monotonic() + 30)
    p = pub.post(1, 0, [64], 0, 1, 8, sealed=True)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):            # alive (its lock held) but never answers: the deadline decides
        pub.collect(p, time.monotonic() + 0.5)
    assert time.monotonic() - t0 >= 0.45
    os.kill(pids[1], signal.SIGKILL)
    procs[0].join(10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="gone"):
        pub.collect(p, time.monotonic() + 30)    # dead: its lock went with it, no need to wait 30 s
    assert time.monotonic() - t0 < min(slack(10), 29)
    procs[1].kill()
    pub.drop()
    os.close(probe_fd)


def test_records_out_of_range_and_members_of_another_epoch_are_refused(tmp_path):
    pub, _ = _bell(tmp_path, members=2, epoch=3)
    probe, probe_fd = _probe(tmp_path)
    with pytest.raises(ValueError):
        BellMember(pub.path, 1, 4, probe)         # another epoch's roster
    with pytest.raises(ValueError):
        BellMember(pub.path, 3, 3, probe)         # a rank beyond the members
    m = BellMember(pub.path, 1, 3, probe)
    p = pub.post(1, 0, [64, 128], 2, 5, 100, sealed=True)
    assert m.record(p)["offsets"] == [64, 128]
    page = pub._page
    page.set_i64(_REC + 8 * REC_FIELDS.index("split"), 99)     # more shares than members
    with pytest.raises(ValueError, match="out of range"):
        m.record(p)
    page.set_i64(_REC + 8 * REC_FIELDS.index("split"), 2)
    page.set_i64(_REC + 8 * REC_FIELDS.index("buckets"), 10**9)
    with pytest.raises(ValueError, match="out of range"):
        m.record(p)
    assert m.record(p + 1) is None              # not the record of that post
    assert page.i32(_POST) == p and page.i64(_SLOTS + SLOT * 0 + 32) == 1   # (member 1 joined)
    m.close()
    pub.drop()
    os.close(probe_fd)


def test_view_plan_views_equal_unpacked_tensors_for_every_dtype_and_shape():
    model = mixed_model(7)
    layout, buckets = _layout_and_buckets(model.items())
    offsets, base = _segment(buckets)
    views = ViewPlan(layout, offsets).views(base)
    ref = unpack(layout, buckets)
    assert list(views) == list(ref)
    for name, t in ref.items():
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous() and torch.equal(v, t), name
        assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()   # views, no copies
    with pytest.raises(ValueError, match="aligned"):
        ViewPlan(layout, [o + 8 for o in offsets])


def test_a_mapping_pinned_for_a_members_views_stays_pinned_across_polls_until_they_are_gone(tmp_path):
    # (found in review) the subscriber pins, then makes its views; an actor's poll() in between must not unpin it -
    # even when the mapping was evicted and made again meanwhile.
    from async_vla.weights.pool import BufferPool
    from async_vla.weights.shm import ShmArena
    from async_vla.weights.shm_reader import ShmReader

    prefix = str(tmp_path / f"{NAME}{os.getpid()}_p")
    arenas = []
    for gen, version in ((0, 10), (1, 11), (2, 12)):
        arenas.append(ShmArena(f"{prefix}_{gen}", 4096, BufferPool()))
        arenas[-1].place([torch.full((16,), float(version))])
        arenas[-1].seal(version)
    r = ShmReader(prefix)
    held = [r.pin(0, 10, [64], [64]), r.pin(1, 11, [64], [64])]     # the actor still holds two older versions
    base = r.mapped(2)
    r.release_unused()                                                 # a poll(): evicts the unpinned gen 2
    pinned = r.pin_mapping(2, 12)                                      # mapped again and pinned
    assert pinned.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    r.release_unused()                                                 # a poll() before the views are made
    assert 2 in r.pinned
    views = pinned[64:128].view(torch.float32)
    del pinned
    r.release_unused()
    assert 2 in r.pinned and torch.equal(views, torch.full((16,), 12.0))
    del views
    r.release_unused()
    assert 2 not in r.pinned and sorted(r.pinned) == [0, 1]
    del held
    for a in arenas:
        a.close()


# ----------------------------------------------------------------------------- through the publisher and subscribers
def test_a_roster_naming_a_bell_outside_the_shm_dir_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    sub = WeightSubscriber(cfg, 1, tmp_path)
    try:
        msg = {"bell": str(tmp_path / f"{NAME}1_x_bell1"), "shm": str(tmp_path / "shm" / f"{NAME}1_x"), "rank": 1}
        assert sub._join(None, msg, 1, 1, "") is None     # outside cfg.weights.shm_dir: not opened, counted
        assert sub.stats["failures"] == 1
    finally:
        sub.close()


@contextlib.contextmanager
def _publisher_and_two_subscribers(tmp_path):
    cfg = _cfg(tmp_path)
    pub = WeightPublisher(cfg, tmp_path)
    subs = [WeightSubscriber(cfg, i, tmp_path) for i in (1, 2)]
    try:
        assert pub.wait_for_actors(2, 20) == 2
        yield pub, subs
    finally:
        for s in subs:
            s.close()
        pub.close()


def test_publishes_go_through_the_bell_and_a_closing_publisher_removes_it(tmp_path):
    with _publisher_and_two_subscribers(tmp_path) as (pub, subs):
        stats = _publish_and_check(pub, subs, [1, 2, 3, 4, 5, 6])
        assert all(s["doorbell"] and s["transport"] == "shm" and s["verify_shares"] == 2 for s in stats)
        assert [s["announced_early"] for s in stats] == [False] * 4 + [True] * 2
        assert os.path.exists(bell_path(pub._shm.prefix, stats[-1]["epoch"]))
    assert not [p for p in (tmp_path / "shm").iterdir() if "_bell" in p.name]


def test_a_doorbell_post_before_packing_is_followed_or_aborted_without_leaving_the_epoch(tmp_path):
    # Once the layout has gone to both segments, each version is posted before packing (members sum their shares
    # while it runs); a pack that fails aborts the post: members drop it and stay in the epoch for the next one.
    with _publisher_and_two_subscribers(tmp_path) as (pub, subs):
        stats = _publish_and_check(pub, subs, [1, 2, 3, 4])
        # Segments are made at the first placement (packed elsewhere, copied in); from the second packing straight
        # into each one the offsets are known beforehand.
        assert [s["announced_early"] for s in stats] == [False] * 4
        model = _model(5)
        st = pub.publish(5, _slow(model, 0.8))          # posted first: members wait in slices meanwhile
        assert st["doorbell"] and st["announced_early"] and st["confirmed"] == 2, st
        assert not st["formed"] and st["failures"] == 0, st
        for s in subs:
            got = s.poll(timeout=10)
            assert got[0].version == 5 and checksum(got[1]) == checksum(model)
            del got
        epoch = st["epoch"]
        with pytest.raises(RuntimeError, match="gather failed"):
            pub.publish(6, _slow(model, 0.3, fail=True))    # posted, then packing fails: the post is aborted
        stats = _publish_and_check(pub, subs, [7, 8])
        assert all(s["epoch"] == epoch and not s["formed"] and s["announced_early"] for s in stats), stats
        assert all(s.stats["failures"] == 0 and s.stats["checksum_errors"] == 0 for s in subs)
        pub._last_pack_s = 0.3 * pub.timeout_s      # packing took long last time: members would wait it out
        st = _publish_and_check(pub, subs, [9])[0]
        assert not st["announced_early"] and st["doorbell"] and st["confirmed"] == 2, st
