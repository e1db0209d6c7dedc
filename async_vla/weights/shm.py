"""Same-host shared-memory path for the bulk bytes of a weight broadcast.

Why: gloo has no shared-memory transport, so on one host every byte of a broadcast crosses loopback TCP, at a
small fraction of memcpy bandwidth (figures: docs/WEIGHTS.md), and bucketing cannot help once tensors are
large. When every receiver of a group can read the publisher's segment, the publisher packs its buckets
straight into a file in ``/dev/shm`` and the group carries only the header, the bucket offsets and the
acknowledgements. Receivers do not copy: they map the segment read-only, *pin* it and hand out views into it;
the one copy an actor makes is its own ``load_state_dict`` into its model (before, the bytes were copied twice:
out of the segment, then into the model). NCCL needs none of this (it uses NVLink / shared memory itself), so
only the gloo path uses it.

Safety:
- capability is tested, not assumed: the publisher writes a probe file holding its session id; a subscriber
  that can read it (same host, same ``/dev/shm`` namespace, same user) registers with ``shm`` set, and a
  group uses the segment only when every member did. A member that later fails to read a segment re-registers
  without it (``ShmUnreadable``), which re-forms the group on the wire;
- two segments alternate, because the asynchronous export of version v-1 may still read the previous one;
- pinning is an ``flock`` (the reader's side: ``async_vla.weights.shm_reader``): a receiver holds a shared lock on a segment while any view it handed out is alive
  (the views' storage use count says so; checked at every receive), and the publisher takes the exclusive lock,
  without waiting, before it rewrites one. A segment still pinned (an actor that has not loaded an older version
  yet) is left to its readers - unlinked, it lives until they let go - and the slot gets a fresh segment;
- each segment also starts with a control word (a seqlock): -1 while it is being rewritten, the version once
  sealed. A receiver checks it after pinning and again after verifying, so it never acknowledges bytes of
  another version, even with checksum verification off;
- space is checked (``statvfs``) and reserved (``posix_fallocate``): a sparse tmpfs file on a small
  ``/dev/shm`` (Docker's 64 MB default) would SIGBUS on write. Without room the version goes over the wire,
  and the same size is not tried again for ``RETRY_S``;
- a publisher holds an ``flock`` on its probe for its lifetime: a new publisher deletes every segment whose
  probe is not locked (a kill -9'd learner's), whatever pid namespace it ran in; segments are never
  ``munmap``ped under a live view (``torch.frombuffer`` keeps a reference to the ``mmap``; dropping references
  unmaps with the last view, while ``mm.close()`` would unmap under the tensors: a segfault);
- the views are read-only memory: writing into a received tensor faults (copy it first). A private
  copy-on-write mapping would not fault, but a page once written would never show a later version again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import time
import weakref
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from async_vla.weights.pool import BufferPool

log = logging.getLogger(__name__)

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)   # Linux; elsewhere pages fault in on first write

ALIGN = 64
CTL = ALIGN          # bytes at the start of each segment: int64 control word (version sealed, -1 = rewriting)
NAME = "async_vla_w_"
GROWTH = 1.25        # headroom when a segment is (re)made, so a slightly larger layout does not re-make it
RETRY_S = 60.0       # after "no room", the same or a larger size is not tried again for this long


class ShmUnreadable(ValueError):
    """This receiver cannot use the publisher's segment (missing, unmappable, offsets outside it)."""


class ShmTorn(ValueError):
    """The segment holds another version (being rewritten, or already rewritten): nothing is handed out."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _prefix_of(name: str) -> str:
    """``async_vla_w_<pid>_<session>`` of a probe, probe temp file or segment name."""
    return NAME + "_".join(name[len(NAME):].split(".")[0].split("_")[:2])


def locked(path: Union[str, Path]) -> bool:
    """True when a live process holds the flock on ``path`` (its publisher, or a doorbell member, is running).
    A missing file: no; a file we cannot open for another reason: cannot tell, so yes (never delete, keep
    waiting until the deadline)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:      # out of descriptors, no permission: cannot tell, so never delete
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_stale_segments(shm_dir: Union[str, Path]) -> int:
    """Delete segments, probes and temp files whose publisher no longer holds its probe lock; returns how many."""
    d = Path(shm_dir)
    removed = 0
    for p in d.glob(NAME + "*"):
        own = p if p.name.endswith(".tmp") else d / (_prefix_of(p.name) + ".probe")
        if not locked(own):
            with contextlib.suppress(OSError):
                p.unlink()
                removed += 1
    return removed


def _remove_own(shm_dir: Path, prefix: str, lock_fd: int) -> None:
    for p in shm_dir.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            p.unlink()
    with contextlib.suppress(OSError):
        os.close(lock_fd)


def valid_path(path: str, shm_dir: Union[str, Path]) -> bool:
    """A probe or segment prefix received from the store must name one of ours in our shm_dir."""
    p = Path(path)
    return p.parent == Path(shm_dir) and p.name.startswith(NAME)


def probe_ok(probe_path: str, session: str, shm_dir: Union[str, Path]) -> bool:
    """True when this process can read the publisher's probe file and it names the publisher's session."""
    if not probe_path or not valid_path(probe_path, shm_dir):
        return False
    try:
        return Path(probe_path).read_text() == session
    except (OSError, UnicodeDecodeError):
        return False


class ShmArena:
    """A writable segment handed out as bucket buffers (``BufferPool.get``'s signature), bump-allocated after
    the control word from each ``reset()``; a request that does not fit (or is not on the CPU) comes from
    ``fallback`` and is copied in by ``place``. Holds the exclusive ``flock`` from ``reset()`` to ``seal()``."""

    def __init__(self, path: str, nbytes: int, fallback: BufferPool):
        nbytes = _aligned(CTL + max(ALIGN, int(nbytes)))
        st = os.statvfs(os.path.dirname(path) or ".")
        if st.f_bavail * st.f_frsize < nbytes:     # do not even briefly fill a shared /dev/shm
            raise OSError(errno.ENOSPC, f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)      # reserve the pages now: ENOSPC here, not SIGBUS later
            # Pre-fault the pages at map time: packing 400 MB into a fresh mapping took 260-510 ms page fault by
            # page fault, against 130 ms to map populated + 44 ms to pack (a re-made segment's cost).
            self._mm: Optional[mmap.mmap] = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
            self._base: Optional[torch.Tensor] = torch.frombuffer(self._mm, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._fd: Optional[int] = fd      # kept open: the exclusive lock that keeps pinning readers out
        self.path, self.nbytes = path, nbytes
        self._ctl = self._base.narrow(0, 0, 8).view(torch.int64)
        self._fallback = fallback
        if not self.reset():     # nobody can hold a lock on a file we just created: never expected
            self.close()
            raise OSError(errno.EBUSY, f"new shared-memory segment {path} is locked by another process")

    def reset(self) -> bool:
        """Start rewriting: take the exclusive lock and mark the segment -1. False (nothing changed) when a
        reader still pins it."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._ctl[0] = -1
        self._used = CTL
        return True

    def seal(self, version: int) -> None:
        """Mark the segment as holding ``version`` and let readers pin it."""
        if version < 0:
            raise ValueError("a sealed segment holds a version >= 0 (-1 marks a rewrite)")
        self._ctl[0] = version
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def get(self, numel: int, dtype: torch.dtype, device: Union[str, torch.device]) -> torch.Tensor:
        n = numel * dtype.itemsize
        if self._base is None or torch.device(device).type != "cpu" or self._used + n > self.nbytes:
            return self._fallback.get(numel, dtype, device)
        off, self._used = self._used, _aligned(self._used + n)
        return self._base.narrow(0, off, n).view(dtype)

    def offset_of(self, t: torch.Tensor) -> Optional[int]:
        """Byte offset of ``t`` in this arena, or None when it lives elsewhere."""
        if self._base is None or t.device.type != "cpu":
            return None
        off = t.data_ptr() - self._base.data_ptr()
        return off if CTL <= off and off + _nbytes(t) <= self.nbytes else None

    def place(self, buckets: Sequence[torch.Tensor]) -> Optional[list[int]]:
        """Offsets of every bucket in the arena, copying in those packed elsewhere; None if they do not fit."""
        offsets: list[Optional[int]] = [self.offset_of(b) for b in buckets]
        for i, b in enumerate(buckets):
            if offsets[i] is None:
                n = _nbytes(b)
                if self._used + n > self.nbytes:
                    return None
                offsets[i], self._used = self._used, _aligned(self._used + n)
                self._base.narrow(0, offsets[i], n).copy_(b.contiguous().view(-1).view(torch.uint8))
        return [int(o) for o in offsets]

    def close(self) -> None:
        # Never mm.close() (see the module docstring): drop our references, unlink the name. Readers that pin it
        # keep their mapping (and the memory) until they let go.
        self._base = self._mm = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class ShmPublisher:
    """The publisher's side: the locked probe file and two alternating arenas ``<prefix>_<generation>``."""

    def __init__(self, shm_dir: Union[str, Path], session: str, fallback: BufferPool):
        self.dir = Path(shm_dir)
        if remove_stale_segments(self.dir):
            log.info("weights: removed shared-memory segments of dead publishers from %s", self.dir)
        name = f"{NAME}{os.getpid()}_{session[:16]}"
        self.prefix = str(self.dir / name)
        self.probe = self.prefix + ".probe"
        fd = self._locked_probe(session)
        # Normal exit and garbage collection remove our files too; kill -9 leaves them to the next publisher.
        self._finalizer = weakref.finalize(self, _remove_own, self.dir, name, fd)
        self._fallback = fallback
        self._arenas: list[Optional[ShmArena]] = [None, None]
        self._gens = [-1, -1]
        self._turn = 0
        self._next_gen = 0
        self._requested = 0       # bytes the packer asked for this version (open buckets come at the cap)
        self._placed: Optional[tuple[int, int, list[int]]] = None    # (version, generation, offsets)
        self._no_room: tuple[int, float] = (0, 0.0)                   # (bytes that did not fit, until when)
        self.failed = ""          # why the last placement went over the wire instead ("" = it did not)
        self.packed_in_place = False   # the last placement found every bucket already in its segment
        self.remade_pinned = 0    # slots given a fresh segment because a reader still pinned the old one

    def _locked_probe(self, session: str) -> int:
        """Write the probe locked before it appears under its name, so no other publisher sees it unlocked.
        The lock is blocking (a cleaner's shared probe is brief); a cleaner that removed the still-unlocked
        temp file in between makes us try again."""
        tmp = self.probe + ".tmp"
        for attempt in range(3):
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, session.encode())
                os.replace(tmp, self.probe)
                return fd
            except FileNotFoundError:
                os.close(fd)
                if attempt == 2:
                    raise
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        raise AssertionError("unreachable")

    def arena(self, settle: Optional[Callable[[], None]] = None) -> "ShmPublisher":
        """Flip to the other slot and reset its arena; pack into the returned allocator (``get``). When a reader
        still pins the slot's segment, ``settle()`` may wait for readers that are about to let go; if it is still
        pinned then, the slot gets a fresh one of the same size (or none: pack into the pool, ``place`` tries
        again) and the old one is left to its readers."""
        self._turn ^= 1
        self._requested = 0
        self._placed = None
        a = self._arenas[self._turn]
        if a is None or a.reset():
            return self
        if settle is not None:
            settle()
            if a.reset():
                return self
        self.remade_pinned += 1
        log.info("weights: a receiver still holds shared-memory generation %d; packing into a new one",
                 self._gens[self._turn])
        self._arenas[self._turn] = None
        try:
            self._arenas[self._turn] = ShmArena(f"{self.prefix}_{self._next_gen}", a.nbytes, self._fallback)
            self._gens[self._turn] = self._next_gen
            self._next_gen += 1
        except OSError as exc:
            log.warning("weights: no fresh shared-memory segment (%s); packing into memory", exc)
        a.close()
        return self

    def undo(self) -> None:
        """Packing into the current slot failed: flip back, so the next ``arena()`` takes this slot again and
        never the other one, whose version an asynchronous export may still be reading."""
        self._turn ^= 1
        self._placed = None

    def get(self, numel: int, dtype: torch.dtype, device: Union[str, torch.device]) -> torch.Tensor:
        """The current slot's ``ShmArena.get`` (the pool until the slot has a segment), counting requests."""
        self._requested += _aligned(numel * dtype.itemsize)
        a = self._arenas[self._turn]
        return (a or self._fallback).get(numel, dtype, device)

    @property
    def generation(self) -> int:
        """The current slot's segment generation (-1: none yet)."""
        return self._gens[self._turn] if self._arenas[self._turn] is not None else -1

    @property
    def in_place(self) -> bool:
        """Both slots have a segment (packing no longer touches the fallback pool)."""
        return all(a is not None for a in self._arenas)

    def place(self, buckets: Sequence[torch.Tensor], version: int) -> Optional[tuple[int, list[int]]]:
        """(generation, offsets) of this version's buckets in the current slot's segment, sealed with
        ``version``; re-makes the segment when they do not fit (sized by what the packer requested, so packing
        straight into it next time fits). None when shared memory cannot hold them (go over the wire).
        Idempotent per version (a retried broadcast re-sends the same placement)."""
        if self._placed is not None and self._placed[0] == version:
            return self._placed[1], self._placed[2]
        slot = self._turn
        a = self._arenas[slot]
        self.packed_in_place = a is not None and all(a.offset_of(b) is not None for b in buckets)
        offsets = a.place(buckets) if a is not None else None
        if offsets is None:
            need = max(sum(_aligned(_nbytes(b)) for b in buckets), self._requested)
            if need >= self._no_room[0] > 0 and time.monotonic() < self._no_room[1]:
                self.failed = f"no room for {need / 2**20:.0f} MiB in {self.dir} (retrying after {RETRY_S:.0f} s)"
                return None
            try:
                new = ShmArena(f"{self.prefix}_{self._next_gen}", int(need * GROWTH), self._fallback)
            except OSError as exc:
                self._no_room = (need, time.monotonic() + RETRY_S)
                self.failed = f"cannot reserve {need / 2**20:.0f} MiB in {self.dir}: {exc.strerror or exc}"
                return None
            offsets = new.place(buckets)  # copies from the old arena (or the pool) before that is closed
            if a is not None:
                a.close()
            self._arenas[slot], self._gens[slot] = new, self._next_gen
            self._next_gen += 1
            if offsets is None:
                return None
        self._arenas[slot].seal(version)
        self.failed = ""
        self._placed = (version, self._gens[slot], offsets)
        return self._gens[slot], offsets

    def close(self) -> None:
        for a in self._arenas:
            if a is not None:
                a.close()
        self._arenas = [None, None]
        self._finalizer()
