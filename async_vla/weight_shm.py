"""Same-host shared-memory path for the bulk bytes of a weight broadcast.

Why: gloo has no shared-memory transport, so on one host every byte of a broadcast crosses loopback TCP:
~1 GB/s per receiver at 100M fp32 parameters (15% of memcpy), and bucketing cannot help once tensors are
large. When every receiver of a group can read the publisher's segment, the publisher packs its buckets
straight into a file in ``/dev/shm`` and the group carries only the header, the bucket offsets and the
acknowledgements; each receiver copies its buckets out (one memcpy each, in parallel). NCCL needs none of
this (it uses NVLink / shared memory itself), so only the gloo path uses it.

Safety:
- capability is tested, not assumed: the publisher writes a probe file holding its session id; a subscriber
  that can read it (same host, same ``/dev/shm`` namespace, same user) registers with ``shm`` set, and a
  group uses the segment only when every member did;
- two arenas alternate, because the asynchronous export of version v-1 may still read the previous one;
- an arena is rewritten only by a later publish, which starts after every receiver acknowledged or after the
  group was dropped; a receiver still copying then fails its acknowledgement (the group is gone), so a torn
  copy is never handed out (and the checksum would catch it too);
- space is reserved with ``posix_fallocate`` (a sparse tmpfs file on a small ``/dev/shm`` - Docker's 64 MB
  default - would SIGBUS on write); when it cannot be reserved, that version goes over the wire;
- names carry the publisher's pid: a new publisher removes segments whose process is gone (kill -9).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from async_vla.weight_buckets import BufferPool

log = logging.getLogger(__name__)

ALIGN = 64
NAME = "async_vla_w_"
GROWTH = 1.25       # headroom when an arena is (re)made, so a slightly larger layout does not re-make it


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(shm_dir: Union[str, Path]) -> int:
    """Delete segments and probes left by publishers that no longer run (kill -9); returns how many."""
    removed = 0
    for p in Path(shm_dir).glob(NAME + "*"):
        try:
            pid = int(p.name[len(NAME):].split("_")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            with contextlib.suppress(OSError):
                p.unlink()
                removed += 1
    return removed


def probe_ok(probe_path: str, session: str) -> bool:
    """True when this process can read the publisher's probe file and it names the publisher's session."""
    if not probe_path:
        return False
    try:
        return Path(probe_path).read_text() == session
    except (OSError, UnicodeDecodeError):
        return False


class ShmArena:
    """A writable segment handed out as bucket buffers (``BufferPool.get``'s signature), bump-allocated from
    the start after each ``reset()``; a request that does not fit (or is not on the CPU) comes from
    ``fallback`` and is copied in by ``place``."""

    def __init__(self, path: str, nbytes: int, fallback: BufferPool):
        nbytes = _aligned(max(ALIGN, int(nbytes)))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)   # reserve the pages now: ENOSPC here, not SIGBUS later
            except OSError:
                os.close(fd)
                fd = -1
                os.unlink(path)
                raise
            self._mm = mmap.mmap(fd, nbytes)
        finally:
            if fd >= 0:
                os.close(fd)
        self.path, self.nbytes = path, nbytes
        self._base: Optional[torch.Tensor] = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._fallback = fallback
        self._used = 0

    def reset(self) -> None:
        self._used = 0

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
        return off if 0 <= off and off + _nbytes(t) <= self.nbytes else None

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
        # Never mm.close(): it unmaps even while tensors view the memory (torch.frombuffer keeps a reference
        # to the mmap, not a buffer export), and a bucket still being exported would then segfault. Dropping
        # our references unmaps when the last view is gone; the unlinked file's pages are freed with it.
        self._base = self._mm = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class ShmPublisher:
    """The publisher's side: the probe file and two alternating arenas named ``<prefix>_<generation>``."""

    def __init__(self, shm_dir: Union[str, Path], session: str, fallback: BufferPool):
        self.dir = Path(shm_dir)
        if remove_stale_segments(self.dir):
            log.info("weights: removed shared-memory segments of dead publishers from %s", self.dir)
        self.prefix = str(self.dir / f"{NAME}{os.getpid()}_{session[:16]}")
        self.probe = self.prefix + ".probe"
        tmp = self.probe + ".tmp"
        with open(tmp, "w") as f:
            f.write(session)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.probe)
        self._fallback = fallback
        self._arenas: list[Optional[ShmArena]] = [None, None]
        self._gens = [-1, -1]
        self._turn = 0
        self._next_gen = 0
        self._requested = 0       # bytes the packer asked for this version (open buckets come at the cap)
        self.failed = ""          # why the last placement went over the wire instead ("" = it did not)

    def arena(self) -> "ShmPublisher":
        """Flip to the other slot and reset its arena; pack into the returned allocator (``get``)."""
        self._turn ^= 1
        self._requested = 0
        a = self._arenas[self._turn]
        if a is not None:
            a.reset()
        return self

    def get(self, numel: int, dtype: torch.dtype, device: Union[str, torch.device]) -> torch.Tensor:
        """The current slot's ``ShmArena.get`` (the pool until the slot has a segment), counting requests."""
        self._requested += _aligned(numel * dtype.itemsize)
        a = self._arenas[self._turn]
        return (a or self._fallback).get(numel, dtype, device)

    def place(self, buckets: Sequence[torch.Tensor]) -> Optional[tuple[int, list[int]]]:
        """(generation, offsets) of this version's buckets in the current slot's segment, re-making the
        segment when they do not fit (sized by what the packer requested: open buckets come at the cap, so
        packing straight into it next time fits); None when shared memory cannot hold them (the wire)."""
        slot = self._turn
        a = self._arenas[slot]
        offsets = a.place(buckets) if a is not None else None
        if offsets is not None:
            return self._gens[slot], offsets
        need = max(sum(_aligned(_nbytes(b)) for b in buckets), self._requested)
        gen = self._next_gen
        self._next_gen += 1
        try:
            new = ShmArena(f"{self.prefix}_{gen}", int(need * GROWTH), self._fallback)
        except OSError as exc:
            self.failed = f"cannot reserve {need / 2**20:.0f} MiB in {self.dir}: {exc.strerror or exc}"
            return None
        offsets = new.place(buckets)      # copies from the old arena (or the pool) before it is closed
        if a is not None:
            a.close()
        self._arenas[slot], self._gens[slot] = new, gen
        self.failed = ""
        return (gen, offsets) if offsets is not None else None

    def close(self) -> None:
        for a in self._arenas:
            if a is not None:
                a.close()
        self._arenas = [None, None]
        with contextlib.suppress(OSError):
            os.unlink(self.probe)


class ShmReader:
    """A receiver's read-only mappings of the publisher's segments (the two newest generations)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}

    def _view(self, gen: int) -> torch.Tensor:
        if gen not in self._maps:
            fd = os.open(f"{self.prefix}_{int(gen)}", os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with warnings.catch_warnings():   # read-only on purpose: we never write through it
                warnings.simplefilter("ignore", UserWarning)
                base = torch.frombuffer(mm, dtype=torch.uint8)
            self._maps[gen] = (mm, base)
            for old in sorted(self._maps)[:-2]:
                self._unmap(old)
        return self._maps[gen][1]

    def copy_out(self, gen: int, offsets: Sequence[int], buckets: Sequence[torch.Tensor]) -> None:
        """Copy each bucket from its offset in segment ``gen`` into ``buckets`` (CPU tensors)."""
        base = self._view(gen)
        if len(offsets) != len(buckets):
            raise ValueError("shared-memory offsets do not match the bucket count")
        for off, b in zip(offsets, buckets):
            n = _nbytes(b)
            if not 0 <= off <= base.numel() - n:
                raise ValueError(f"shared-memory offset {off} (+{n} bytes) outside the segment")
            b.view(-1).view(torch.uint8).copy_(base.narrow(0, int(off), n))

    def _unmap(self, gen: int) -> None:
        self._maps.pop(gen)     # unmapped when the last reference goes (see ShmArena.close)

    def close(self) -> None:
        for gen in list(self._maps):
            self._unmap(gen)
