"""Same-host doorbell: one weight version exchanged through a shared page instead of gloo round trips.

Why: when every receiver of a group reads the publisher's shared-memory segments (``async_vla.weights.shm``) the
bytes no longer cross a socket, but each version still took a mailbox push per member, a gloo header broadcast,
the receivers' acknowledgements and a verdict broadcast: at small models those TCP hops and process wake-ups
cost more than the copy itself (figures: docs/BENCHMARKS.md, docs/WEIGHTS.md). Here the publisher and the members of an epoch
share a small file in ``weights.shm_dir`` (the *bell*) and exchange a version through words of it: atomics with
release/acquire ordering and futexes on the shared mapping (``async_vla/weights/native/bell.c``), so waiting costs no CPU
and a wake-up is a system call, not a TCP round trip.

One version (post number p):
1. the publisher writes the record (version, segment generation, bucket offsets, verification shares) and moves
   the post word to p. When the layout is the last version's and the segment slot the one it went to then, it
   posts *before* packing (offsets are a function of both), and moves ``progress`` (bytes of the stream, in
   manifest order) after each tensor it packs, so each receiver sums its share of the tensors while the rest is
   still being packed; otherwise it posts once the segment is sealed;
2. the publisher seals the segment (``ShmArena.seal``: the version in its control word, exclusive lock released)
   and marks the post sealed;
3. each member pins the segment (shared lock, control word = version), writes (status, share sum) into its slot
   and moves its ack word to p; the publisher compares every share with its own packing sums and writes one
   verdict (all or none take the version, as with ``weights.verify_split``); members hand the version over on a
   good verdict and mark p released in their slot.
A post whose packing went another way than announced is *aborted* (a record with version -1) and posted again.

Liveness: each member holds an exclusive ``flock`` on its own file ``<bell>.m<rank>`` from joining to leaving,
so the publisher, waiting in slices, learns at once that a member died (the lock goes with the process, in any
pid namespace); a stopped member costs the publisher its ``timeout_s``, then the epoch is dropped as on gloo.
Members check between slices that the publisher still holds its probe lock. Dropping the epoch sets the state
word and wakes every waiter; members go back to their mailbox (invites come there). Everything read from the
page is bounds-checked before use: a member trusts it no more than a message.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import time
from typing import Callable, Optional, Sequence

import torch

from async_vla.weights import native
from async_vla.weights.shm import locked

BELL_BYTES = 64 * 1024
MAGIC = 0x4C4C4542         # "BELL"
PAGE_VERSION = 1
# Byte offsets in the page. Futex words are int32, each on a cache line of its own with the values it guards.
_MAGIC, _PAGE, _EPOCH, _MEMBERS = 0, 8, 16, 24
_POST = 64                  # int32 futex: moves at every post, abort and drop
_STATE = 72                 # int64: 0 open, 1 dropped
_REC = 128                  # the posted version: int64 fields in REC_FIELDS order
REC_FIELDS = ("post", "version", "generation", "buckets", "split", "digest", "stream_bytes")
_PROGRESS, _SEALED = 256, 264        # int64: stream bytes packed for the current post; post number sealed
_VERDICT, _VERDICT_OK = 384, 392     # int32 futex: post number judged; int64 1 / 0
_SLOTS, SLOT = 1024, 64              # member r (1..MAX_MEMBERS) at _SLOTS + (r - 1) * SLOT
# In a slot: int32 futex ack (post acknowledged), share sum, status, post released, joined, then the member's
# own int32 futex tick and the stream position it waits for (bell.c: BELL_TICK, BELL_WANT).
_ACK, _SUM, _STATUS, _RELEASED, _JOINED, _TICK, _WANT = 0, 8, 16, 24, 32, 40, 48
MAX_MEMBERS = (8192 - _SLOTS) // SLOT
_OFFSETS = 8192
MAX_BUCKETS = (BELL_BYTES - _OFFSETS) // 8
CHUNK_BYTES = 1 << 20      # progress is reported, and waited for, in steps of at least this (bell.c CHUNK_BYTES)
SPIN_S = 0.0002           # acknowledgements and the verdict come within microseconds: poll (yielding) before sleeping
SLICE_S = 0.005             # publisher: how often a wait looks at its members' locks and its deadline
MEMBER_SLICE_S = 0.25       # member: how often a wait looks at the publisher's lock and at stop requests
_NS = 1_000_000_000


class BellDropped(RuntimeError):
    """The publisher dropped this epoch (a member failed, the live set changed, or it is closing)."""


class PostReplaced(RuntimeError):
    """The post being followed was aborted or replaced by a later one (which the member handles next)."""


def available() -> bool:
    """The doorbell works in this process (native library built, Linux futexes)."""
    return native.bell_available()


def bell_path(prefix: str, epoch: int) -> str:
    return f"{prefix}_bell{int(epoch)}"


def member_lock_path(path: str, rank: int) -> str:
    return f"{path}.m{int(rank)}"


class _Page:
    """A mapped bell page: typed reads and writes at byte offsets, through the native atomics."""

    def __init__(self, path: str, fd: int):
        self.path = path
        # Never mm.close(): dropping the tensor unmaps with the last reference (as shm.py does).
        self._mm = mmap.mmap(fd, BELL_BYTES, flags=mmap.MAP_SHARED)
        self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.addr = self._base.data_ptr()
        self._lib = native.lib()

    def i64(self, off: int) -> int:
        return int(self._lib.avla_load_i64(self.addr + off))

    def set_i64(self, off: int, value: int) -> None:
        self._lib.avla_store_i64(self.addr + off, int(value))

    def i32(self, off: int) -> int:
        return int(self._lib.avla_load_i32(self.addr + off))

    def set_wake(self, off: int, value: int) -> None:
        self._lib.avla_set_wake(self.addr + off, _i32(value))

    def wake(self, off: int) -> None:
        self._lib.avla_futex_wake(self.addr + off)

    def wait_eq(self, off: int, want: int, timeout_s: float, spin_s: float = 0.0) -> bool:
        """True once the int32 at ``off`` equals ``want``; False after ``timeout_s`` (polling, yielding the core,
        for the first ``spin_s``)."""
        return self._lib.avla_wait_eq(self.addr + off, _i32(want), int(max(0.0, timeout_s) * _NS),
                                      int(spin_s * _NS)) == 0

    def wait_change(self, off: int, seen: int, timeout_s: float) -> int:
        """The int32 at ``off`` once it differs from ``seen`` (or ``seen`` after ``timeout_s``)."""
        self._lib.avla_futex_wait(self.addr + off, _i32(seen), int(max(0.0, timeout_s) * _NS))
        return self.i32(off)


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class BellPublisher:
    """The publisher's side of one epoch's bell: made before the rosters go out, dropped with the epoch."""

    def __init__(self, prefix: str, epoch: int, members: int):
        if not 1 <= members <= MAX_MEMBERS:
            raise ValueError(f"a bell has room for 1..{MAX_MEMBERS} members, not {members}")
        self.path, self.members = bell_path(prefix, epoch), members
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserved, not sparse: on a full tmpfs a first write to a page of a sparse file is a SIGBUS (as for
            # the segments: ENOSPC here instead, and the group goes on gloo).
            os.posix_fallocate(fd, 0, BELL_BYTES)
            self._page = _Page(self.path, fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)     # the mapping keeps the file; nothing locks it
        p = self._page
        for off, value in ((_PAGE, PAGE_VERSION), (_EPOCH, epoch), (_MEMBERS, members), (_SEALED, -1),
                           (_MAGIC, MAGIC)):
            p.set_i64(off, value)
        self.spin_s = SPIN_S
        self._post = 0
        self.judged = 0           # the last post with a verdict (members mark it released once they let go)
        self.dropped = False

    def _slot(self, rank: int) -> int:
        return _SLOTS + (rank - 1) * SLOT

    def wait_joined(self, deadline: float) -> None:
        """Every member opened the bell and holds its lock (formation); TimeoutError naming the missing ones."""
        while True:
            missing = [r for r in range(1, self.members + 1) if self._page.i64(self._slot(r) + _JOINED) != 1]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"members {missing} did not open the bell of this epoch")
            time.sleep(0.0005)

    def post(self, version: int, generation: int, offsets: Sequence[int], split: int, digest: int,
             stream_bytes: int, sealed: bool) -> int:
        """Announce a version (before packing when ``sealed`` is False); returns its post number. (Post numbers
        count within one epoch; the futex words hold them as int32, far beyond any epoch's length.)"""
        if len(offsets) > MAX_BUCKETS:
            raise ValueError(f"{len(offsets)} buckets: the bell carries at most {MAX_BUCKETS} offsets")
        p, page = self._post + 1, self._page
        self._post = p
        for i, off in enumerate(offsets):
            page.set_i64(_OFFSETS + 8 * i, off)
        page.set_i64(_PROGRESS, stream_bytes if sealed else 0)
        page.set_i64(_SEALED, p if sealed else -1)
        for name, value in zip(REC_FIELDS, (p, version, generation, len(offsets), split, digest, stream_bytes)):
            page.set_i64(_REC + 8 * REC_FIELDS.index(name), value)
        page.set_wake(_POST, p)
        return p

    def abort(self) -> None:
        """What was posted will not be sealed as announced: members following it give up (a record of version -1)."""
        p = self._post + 1
        self._post = p
        self._page.set_i64(_REC + 8 * REC_FIELDS.index("version"), -1)
        self._page.set_i64(_REC, p)
        self._page.set_wake(_POST, p)
        self._wake_members()

    def progress(self, nbytes: int) -> None:
        """``nbytes`` of the stream (tensors in manifest order) are in the segment: wakes the members waiting for
        no more than that."""
        self._page._lib.avla_progress(self._page.addr + _PROGRESS, int(nbytes), self._page.addr + _SLOTS, SLOT,
                                      self.members)

    def _wake_members(self) -> None:
        self._page._lib.avla_wake_members(self._page.addr + _SLOTS, SLOT, self.members)

    def seal(self, p: int, stream_bytes: int) -> None:
        """The segment of post ``p`` is sealed (members may pin it) and complete."""
        self._page.set_i64(_SEALED, p)
        self.progress(stream_bytes)
        self._wake_members()

    def collect(self, p: int, deadline: float) -> list[tuple[int, int]]:
        """Every member's (status, share sum) for post ``p``, by rank. A member whose lock is gone (it died)
        raises RuntimeError at once; one that does not answer by ``deadline`` raises TimeoutError."""
        out = []
        for r in range(1, self.members + 1):
            slot = self._slot(r)
            while not self._page.wait_eq(slot + _ACK, p, min(SLICE_S, deadline - time.monotonic()), self.spin_s):
                if not locked(member_lock_path(self.path, r)):
                    raise RuntimeError(f"bell member {r} is gone (its lock was released)")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"bell member {r} did not acknowledge post {p} in time")
            out.append((self._page.i64(slot + _STATUS), self._page.i64(slot + _SUM) & ((1 << 64) - 1)))
        return out

    def verdict(self, p: int, ok: bool) -> None:
        self._page.set_i64(_VERDICT_OK, int(ok))
        self._page.set_wake(_VERDICT, p)
        self.judged = p

    def released(self, p: int) -> int:
        """How many members marked post ``p`` (or a later one) released."""
        return sum(self._page.i64(self._slot(r) + _RELEASED) >= p for r in range(1, self.members + 1))

    def drop(self) -> None:
        """End the epoch: every member waiting anywhere in the page wakes and leaves; the files go."""
        if self.dropped:
            return
        self.dropped = True
        page = self._page
        page.set_i64(_STATE, 1)
        page.set_wake(_POST, self._post + 1)
        self._wake_members()
        page.wake(_VERDICT)
        for r in range(1, self.members + 1):
            page.wake(self._slot(r) + _ACK)
        for path in [self.path] + [member_lock_path(self.path, r) for r in range(1, self.members + 1)]:
            with contextlib.suppress(OSError):
                os.unlink(path)


class BellMember:
    """A receiver's side of one epoch's bell (rank 1..members)."""

    def __init__(self, path: str, rank: int, epoch: int, probe: str):
        self.path, self.rank, self.probe = path, int(rank), probe
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != BELL_BYTES:
                raise ValueError(f"bell {path} has the wrong size")
            self._page = _Page(path, fd)
        finally:
            os.close(fd)
        page = self._page
        if (page.i64(_MAGIC) != MAGIC or page.i64(_PAGE) != PAGE_VERSION or page.i64(_EPOCH) != epoch
                or not 1 <= self.rank <= page.i64(_MEMBERS) <= MAX_MEMBERS):
            raise ValueError(f"bell {path} does not match epoch {epoch} / rank {rank}")
        self.members = page.i64(_MEMBERS)
        self.spin_s = SPIN_S
        self._slot = _SLOTS + (self.rank - 1) * SLOT
        # Our liveness for the publisher: an exclusive lock that the kernel drops with us.
        lock_path = member_lock_path(path, rank)
        self._lock_fd: Optional[int] = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        if self.dropped:      # dropped while we joined: the publisher removed its files already, so remove ours
            self.close()
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            raise BellDropped(f"the epoch of {path} was dropped before we joined it")
        self.seen = page.i32(_POST)
        page.set_i64(self._slot + _JOINED, 1)

    @property
    def dropped(self) -> bool:
        return self._page.i64(_STATE) != 0

    def post_moved(self, p: int) -> bool:
        """Has the post word moved on from ``p`` (an abort, a new post, a drop)?"""
        return self._page.i32(_POST) != _i32(p)

    def publisher_alive(self) -> bool:
        return locked(self.probe)

    def next_post(self, timeout_s: float) -> Optional[int]:
        """Wait (at most ``timeout_s``) for the post word to move; the new post number, or None."""
        p = self._page.wait_change(_POST, self.seen, timeout_s)
        if p == self.seen:
            return None
        self.seen = p
        return p

    def record(self, p: int) -> Optional[dict[str, int]]:
        """The version posted as ``p`` (None: aborted, or already replaced by a later post)."""
        rec = {name: self._page.i64(_REC + 8 * i) for i, name in enumerate(REC_FIELDS)}
        if rec["post"] != p or rec["version"] < 0:
            return None
        if not (0 <= rec["buckets"] <= MAX_BUCKETS and 0 <= rec["split"] <= self.members
                and rec["generation"] >= 0 and rec["stream_bytes"] >= 0):
            raise ValueError(f"bell record out of range: {rec}")
        rec["offsets"] = [self._page.i64(_OFFSETS + 8 * i) for i in range(rec["buckets"])]
        if self._page.i32(_POST) != p:     # rewritten while we read (an abort and a new post): not ours
            return None
        return rec

    def follow_sum(self, p: int, plan, base_addr: int, deadline: float,
                   stop: Callable[[], bool]) -> list[int]:
        """Sum the tensors of ``plan`` (a ``bell_versions.SharePlan``) as the publisher's progress passes them
        (at ``base_addr``: the mapped segment); raises BellDropped / TimeoutError / RuntimeError (publisher gone, or the post moved on)."""
        page, lib = self._page, self._page._lib
        nxt = ctypes.c_int64(0)
        sums = (ctypes.c_uint64 * max(1, plan.n))()
        while True:
            slice_s = min(MEMBER_SLICE_S, deadline - time.monotonic())
            r = lib.avla_follow_sum(base_addr, plan.offs, plan.sizes, plan.ends, plan.n, ctypes.byref(nxt), sums,
                                    page.addr + _PROGRESS, page.addr + self._slot, page.addr + _POST, _i32(p),
                                    int(max(0.0, slice_s) * _NS))
            if r == 0:
                return [int(s) for s in sums[:plan.n]]
            self._check(p, deadline, stop)

    def wait_sealed(self, p: int, stream_bytes: int, deadline: float, stop: Callable[[], bool]) -> None:
        """Until post ``p`` is complete and its segment sealed (pinnable)."""
        page, lib, tick = self._page, self._page._lib, self._slot + _TICK
        while True:
            seen = page.i32(tick)             # before the seal word: a seal after this read moves our tick
            if page.i64(_SEALED) == p:
                return
            slice_ns = int(max(0.0, min(MEMBER_SLICE_S, deadline - time.monotonic())) * _NS)
            if page.i64(_PROGRESS) < stream_bytes:
                late = lib.avla_wait_progress(page.addr + _PROGRESS, int(stream_bytes), page.addr + self._slot,
                                              page.addr + _POST, _i32(p), slice_ns) != 0
            else:                               # all packed; the seal wakes every member
                late = lib.avla_futex_wait(page.addr + tick, seen, slice_ns) == 1
            if late or page.i32(_POST) != _i32(p):
                self._check(p, deadline, stop)

    def ack(self, p: int, ok: bool, share_sum: int) -> None:
        page = self._page
        s = share_sum & ((1 << 64) - 1)
        page.set_i64(self._slot + _SUM, s - (1 << 64) if s >= 1 << 63 else s)
        page.set_i64(self._slot + _STATUS, int(ok))
        page.set_wake(self._slot + _ACK, p)

    def wait_verdict(self, p: int, deadline: float, stop: Callable[[], bool]) -> bool:
        while not self._page.wait_eq(_VERDICT, p, min(MEMBER_SLICE_S, deadline - time.monotonic()), self.spin_s):
            self._check(p, deadline, stop)
        return self._page.i64(_VERDICT_OK) == 1

    def released(self, p: int) -> None:
        self._page.set_i64(self._slot + _RELEASED, p)

    def _check(self, p: int, deadline: float, stop: Callable[[], bool]) -> None:
        """Between wait slices: raise if the epoch is over, the post moved on, we stop, the publisher died or time
        is up; return to go on waiting."""
        if self.dropped:
            raise BellDropped(f"the publisher dropped this epoch's bell ({self.path})")
        if self._page.i32(_POST) != _i32(p):
            raise PostReplaced(f"post {p} was replaced before it completed")
        if stop():
            raise BellDropped("stopping")
        if not self.publisher_alive():
            raise RuntimeError("the weight publisher is gone (its probe lock was released)")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"post {p} did not complete in time")

    def wake(self) -> None:
        """Wake our own thread's wait (close() from another thread)."""
        self._page.wake(_POST)
        self._page.wake(self._slot + _TICK)
        self._page.wake(_VERDICT)

    def close(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)     # releases our lock: the publisher sees us gone
            self._lock_fd = None

