"""The receiver's side of the same-host shared-memory path (the design and the publisher's side:
``async_vla.weights.shm``): read-only mappings of the publisher's segments and the pins on those it handed out views
of."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Sequence

import torch

from async_vla.weights import native
from async_vla.weights.pool import storage_free
from async_vla.weights.shm import CTL, ShmTorn, ShmUnreadable

MAX_MAPS = 2         # unpinned segments a reader keeps mapped (the two that alternate; an old one is let go)


class _Mapping:
    """One mapped segment on the reader's side: the read-only view of it and the fd that carries our lock."""

    def __init__(self, base: torch.Tensor, fd: int):
        self.base, self.fd, self.pinned = base, fd, False

    def unpin(self) -> None:
        if self.pinned:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.pinned = False

    def close(self) -> None:
        # The mmap holds a duplicate of this descriptor (CPython dups it), which shares the flock: a pin taken
        # through it stays until the last view of the mapping is gone, even after this close.
        self.pinned = False
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _close_all(maps: "OrderedDict[int, _Mapping]") -> None:
    for m in maps.values():
        m.close()
    maps.clear()


class ShmReader:
    """A receiver's read-only mappings of the publisher's segments, and the pins on those it handed views of.
    Thread-safe: the subscriber's thread pins, the actor's ``poll()`` releases what its last load let go of."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._maps: OrderedDict[int, _Mapping] = OrderedDict()
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _close_all, self._maps)

    def _mapping(self, gen: int) -> _Mapping:
        if gen in self._maps:
            self._maps.move_to_end(gen)
            return self._maps[gen]
        try:
            fd = os.open(f"{self.prefix}_{int(gen)}", os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
            except BaseException:
                os.close(fd)
                raise
        except (OSError, ValueError) as exc:
            raise ShmUnreadable(f"cannot map shared-memory segment {gen}: {exc}") from exc
        with warnings.catch_warnings():   # read-only on purpose: we never write through it
            warnings.simplefilter("ignore", UserWarning)
            base = torch.frombuffer(mm, dtype=torch.uint8)
        self._maps[gen] = _Mapping(base, fd)      # the tensor keeps the mmap alive; dropping it unmaps
        self._evict(keep=gen)
        return self._maps[gen]

    def _evict(self, keep: int = -1) -> None:
        free = [g for g, m in self._maps.items() if not m.pinned and g != keep]
        for g in free[:max(0, len(self._maps) - MAX_MAPS)]:
            self._maps.pop(g).close()

    def pin(self, gen: int, version: int, offsets: Sequence[int], nbytes: Sequence[int]) -> list[torch.Tensor]:
        """Byte views of each bucket (``nbytes[i]`` bytes at ``offsets[i]``) in segment ``gen``, which must be
        sealed with ``version``; the segment stays pinned (the publisher will not rewrite it) while any view of
        it is alive. Read-only memory: copy before modifying."""
        with self._lock:
            return self._pin(gen, version, offsets, nbytes)

    def views(self, gen: int, offsets: Sequence[int], nbytes: Sequence[int]) -> list[torch.Tensor]:
        """The same byte views as ``pin``, without pinning or checking the version: for reading while the publisher
        is still writing (the doorbell's progress says which bytes are complete, ``async_vla.weights.bell``). Pin
        before handing any out; ``pin`` says whether these views are of the mapping it pinned."""
        with self._lock:
            m = self._mapping(gen)
            self._check_bounds(m, offsets, nbytes)
            return [m.base.narrow(0, int(off), int(n)) for off, n in zip(offsets, nbytes)]

    def mapped(self, gen: int) -> torch.Tensor:
        """The whole mapping of segment ``gen`` (its ``data_ptr`` is where the bucket offsets count from)."""
        with self._lock:
            return self._mapping(gen).base

    @staticmethod
    def _check_bounds(m: "_Mapping", offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        if len(offsets) != len(nbytes) or m.base.numel() < CTL:
            raise ShmUnreadable("shared-memory offsets do not match the buckets or the segment")
        for off, n in zip(offsets, nbytes):
            if not CTL <= off <= m.base.numel() - n:
                raise ShmUnreadable(f"shared-memory offset {off} (+{n} bytes) outside the segment")

    def pin_mapping(self, gen: int, version: int) -> torch.Tensor:
        """``pin`` without making bucket views (the caller checked the bounds with ``views`` and makes its own):
        a view of the whole mapping, pinned and checked to hold ``version``. A view, made under the lock, and not
        the mapping's own tensor: pins are judged by what refers to the mapping, and a ``poll()`` between this
        and the caller's own views would otherwise find nothing holding it and unpin it."""
        with self._lock:
            m = self._mapping(gen)
            self._pin_checked(m, gen, version)
            return m.base.narrow(0, 0, m.base.numel())

    def _pin(self, gen: int, version: int, offsets: Sequence[int], nbytes: Sequence[int]) -> list[torch.Tensor]:
        m = self._mapping(gen)
        self._check_bounds(m, offsets, nbytes)
        self._pin_checked(m, gen, version)
        return [m.base.narrow(0, int(off), int(n)) for off, n in zip(offsets, nbytes)]

    def _pin_checked(self, m: "_Mapping", gen: int, version: int) -> None:
        if not m.pinned:
            try:
                fcntl.flock(m.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ShmTorn(f"segment {gen} is being rewritten (wanted v{version})") from None
            m.pinned = True
        try:
            self.check(gen, version)
        except ShmTorn:
            self.release_unused()
            raise

    def check(self, gen: int, version: int) -> None:
        """Raise ``ShmTorn`` unless segment ``gen`` is sealed with ``version``."""
        with self._lock:
            got = _control_word(self._mapping(gen).base)
        if got != version:
            raise ShmTorn(f"segment {gen} holds {got}, not v{version}")

    def release_unused(self) -> None:
        """Unpin every segment no handed-out view refers to any more (then the publisher may rewrite it)."""
        with self._lock:
            for m in self._maps.values():
                if m.pinned and storage_free(m.base):
                    m.unpin()
            self._evict()

    @property
    def pinned(self) -> list[int]:
        with self._lock:
            return [g for g, m in self._maps.items() if m.pinned]

    def close(self) -> None:
        """Drop every mapping. Views already handed out stay readable and stay pinned until they are dropped
        (the mmap they keep alive holds a duplicate of the locked descriptor)."""
        with self._lock:
            self._finalizer()


def _control_word(base: torch.Tensor) -> int:
    """The segment's int64 control word. Through the native atomic load when there is one: a view of ``base``
    would be a reference to the mapping for as long as it lives (pins are judged by those references)."""
    if native.available():
        return int(native.lib().avla_load_i64(base.data_ptr()))
    return int(base.narrow(0, 0, 8).view(torch.int64)[0])
