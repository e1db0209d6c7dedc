"""Packing one version into buckets as its tensors stream in (the layout rule and checksums are
``async_vla.weights.buckets``): each tensor is copied into its bucket as soon as it arrives, so a ZeRO-3 learner can
gather layer by layer, with the checksum taken on the way (the native kernel sums while it copies)."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Optional, Union

import torch

from async_vla.weights import native
from async_vla.weights.buckets import (
    ALIGN, DTYPES, Layout, NamedTensors, _Planner, dtype_name, fold, named_items, spec_of, tensor_sum,
)
from async_vla.weights.pool import BufferPool

SPLIT_BYTES = 4 * 2**20   # native packing copies tensors from this size in two halves at once (helper thread)
_U64 = (1 << 64) - 1


class _Summer:
    """Per-tensor sums of ``checksum`` computed on a helper thread while the packer goes on copying: both
    release the GIL, so the checksum pass overlaps the copy instead of following it (reading what was just
    written, often still in cache). Work is handed over in batches of ~``BATCH`` bytes: a hand-off per small
    tensor would cost more than its sum. Without an executor the sums are taken in ``result()``; tensors the
    native kernel copied arrive already summed (``add_sum``), which costs no second pass at all."""

    BATCH = 4 * 2**20

    def __init__(self, executor: Optional[Executor]):
        self._ex = executor
        self._futures: list[Future] = []
        self._batch: list[tuple[str, torch.Tensor]] = []
        self._bytes = 0
        self._done: list[tuple[str, int, int]] = []

    def add_sum(self, name: str, total: int, numel: int) -> None:
        """A tensor whose sum is already known (the native kernel summed it while copying)."""
        self._done.append((name, total, numel))

    def add(self, name: str, t: torch.Tensor) -> None:
        self._batch.append((name, t))
        self._bytes += t.numel() * t.element_size()
        if self._bytes >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch and self._ex is not None:
            batch, self._batch, self._bytes = self._batch, [], 0
            self._futures.append(self._ex.submit(lambda: [(n, tensor_sum(t), t.numel()) for n, t in batch]))

    def result(self) -> float:
        """Equal to ``checksum`` of every tensor added."""
        return float(fold(self.sums()))

    def sums(self) -> list[tuple[str, int, int]]:
        """(name, tensor_sum, numel) of every tensor added (waits for the helper thread)."""
        self._flush()
        rest = [(n, tensor_sum(t), t.numel()) for n, t in self._batch]    # no helper thread: summed here
        self._done += [item for f in self._futures for item in f.result()] + rest
        self._futures, self._batch, self._bytes = [], [], 0
        return list(self._done)


class BucketPacker:
    """Streams (name, tensor) into buckets following the layout rule; ``finish()`` -> (layout, buckets).

    Each tensor is copied as soon as it is added, so the caller may free or re-partition it right after
    (ZeRO-3 gathers). With ``zero_copy`` a contiguous tensor that gets its own bucket is referenced instead
    of copied: only safe if it stays unchanged until the broadcast (and any export) is done. With ``summer``
    (a one-thread executor; CPU only) the checksum of what was packed is computed alongside (``checksum()``);
    with the native kernel (which sums while it copies) that thread copies half of each large tensor instead.
    """

    def __init__(self, cap_bytes: int, device: Union[str, torch.device] = "cpu", zero_copy: bool = False,
                 pool: Optional[BufferPool] = None, summer: Optional[Executor] = None, sums: bool = True,
                 previous: Optional["Layout"] = None):
        self.cap = int(cap_bytes)
        self._previous = previous    # the last version's layout: reused (manifest, digest, shares) when equal
        self.device = torch.device(device)
        self.zero_copy = zero_copy
        self._alloc = pool.get if pool is not None else (
            lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device))
        self._planner = _Planner(self.cap)
        self._store: dict[str, list[torch.Tensor]] = {}
        self._names: set[str] = set()
        self._summer = _Summer(summer if self.device.type == "cpu" else None) if sums else None
        # One pass that copies with non-temporal stores and sums on the way (async_vla.weights.native): about twice
        # the bandwidth of copy_ into memory other processes read next, and no checksum pass after it.
        self._native = self.device.type == "cpu" and native.available()
        self._helper = summer if self._native else None
        self._allocs: list[tuple[str, int]] = []    # (dtype, numel) of each buffer asked for, in order
        self._replay: Optional[Layout] = None
        allocs = previous.__dict__.get("_allocs") if previous is not None else None
        if allocs is not None and not zero_copy and previous.cap_bytes == self.cap:
            self._start_replay(previous, allocs)

    # Replay: the same tensors as last time (a learner publishes the same parameters every version) go to the same
    # places, so the buffers are asked for up front in the order the last packing asked for them (a pool hands the
    # same ones back) and each tensor's destination is known: ``add`` checks that the tensor is
    # the expected one and copies, ~3 us of Python a tensor instead of ~10 (placing it, slicing its bucket). The
    # first tensor that differs ends the replay: what was packed so far is placed the usual way, nothing is lost.
    def _start_replay(self, previous: Layout, allocs: tuple[tuple[str, int], ...]) -> None:
        store: dict[str, list[torch.Tensor]] = {}
        for dname, numel in allocs:
            store.setdefault(dname, []).append(self._new(numel, DTYPES[dname]))
        order = list(dict.fromkeys(b.dtype for b in previous.buckets))
        flat = [b for d in order for b in store.get(d, [])]
        if len(flat) != len(previous.buckets):      # (a record that does not fit its layout: never expected)
            self._allocs = []
            return
        self._replay, self._rstore, self._rflat, self._ri = previous, store, flat, 0
        self._rdst = [flat[e.bucket].data_ptr() + e.offset * DTYPES[e.spec.dtype].itemsize for e in previous.entries]
        self._rrecord = allocs

    def _replay_add(self, name: str, t: torch.Tensor) -> bool:
        prev, i = self._replay, self._ri
        if i >= len(prev.specs):
            return False
        spec = prev.specs[i]
        if name != spec.name or t.dtype != DTYPES[spec.dtype] or tuple(t.shape) != spec.shape:
            return False
        total: Optional[int] = None
        dst: Optional[torch.Tensor] = None
        if self._native and t.device.type == "cpu" and t.is_contiguous() and not t.is_neg():
            total = self._copy_sum_ptr(self._rdst[i], t.data_ptr(), spec.nbytes)
        else:
            e = prev.entries[i]
            dst = self._rflat[e.bucket].narrow(0, e.offset, spec.numel)
            dst.view(spec.shape).copy_(t)
        self._record_sum(name, total, dst, spec.numel)
        self._ri = i + 1
        return True

    def _end_replay(self) -> None:
        """Go on the usual way from here: place the tensors replayed so far (the same places), keep their buckets."""
        prev, n = self._replay, self._ri
        self._replay = None
        for spec in prev.specs[:n]:
            self._planner.add(spec)
            self._names.add(spec.name)
        for d, used in self._planner.used.items():
            self._store[d] = self._rstore[d][:len(used)]
        # The usual packing of these tensors would have asked for exactly the first of those buffers (a buffer is
        # asked for by the first tensor that needs it); the ones asked for beyond stay unused this time.
        self._allocs = list(self._rrecord[:sum(len(u) for u in self._planner.used.values())])

    def _new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._allocs.append((dtype_name(dtype), numel))
        return self._alloc(numel, dtype, self.device)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._replay is not None:
            if self._replay_add(name, tensor.detach()):
                return
            self._end_replay()
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        self._names.add(name)
        t = tensor.detach()
        spec = spec_of(name, t)
        local, off, own = self._planner.add(spec)
        bufs = self._store.setdefault(spec.dtype, [])
        dtype = DTYPES[spec.dtype]
        total: Optional[int] = None
        if own and self.zero_copy and t.is_contiguous() and t.device == self.device:
            bufs.append(t.reshape(-1))
            dst = bufs[-1]
        else:
            if own:
                bufs.append(self._new(spec.numel, dtype))
                dst = bufs[-1]
            else:
                if local == len(bufs):   # a new open bucket: allocate at the cap, trimmed in finish()
                    bufs.append(self._new(-(-self.cap // dtype.itemsize), dtype))
                dst = bufs[local].narrow(0, off // dtype.itemsize, spec.numel)
            if self._native:
                total = self._copy_sum(dst, t.reshape(-1) if t.is_contiguous() else t)
            if total is None:
                dst.view(spec.shape).copy_(t)
        self._record_sum(name, total, dst, spec.numel)

    def _record_sum(self, name: str, total: Optional[int], dst: Optional[torch.Tensor], numel: int) -> None:
        """The checksum's part of a packed tensor: its sum from the native copy, or summed from ``dst`` later."""
        if self._summer is not None:
            if total is None:
                self._summer.add(name, dst)
            else:
                self._summer.add_sum(name, total, numel)

    def _copy_sum(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[int]:
        """The native copy; a large tensor is copied in two halves at once, the second on the helper thread (one
        thread is memory-latency bound; two move a large tensor about a third faster). Both halves are done
        before this returns: the caller may free ``src`` (a ZeRO-3 gather) right after ``add``."""
        # (``native.can_copy`` with fewer steps: ``dst`` is ours - a contiguous CPU slice of src's dtype and size)
        if src.device.type != "cpu" or not src.is_contiguous() or src.is_neg() or src.dtype != dst.dtype:
            return None
        return self._copy_sum_ptr(dst.data_ptr(), src.data_ptr(), src.nbytes)

    def _copy_sum_ptr(self, d: int, s: int, nbytes: int) -> int:
        if self._helper is None or nbytes < SPLIT_BYTES:
            return native.copy_sum_raw(d, s, nbytes)
        half = nbytes // 2 // ALIGN * ALIGN      # a multiple of 8: both halves' word sums add up to the whole
        far = self._helper.submit(native.copy_sum_raw, d + half, s + half, nbytes - half)
        try:
            near = native.copy_sum_raw(d, s, half)
        finally:   # never return (or raise) while the helper still reads src / writes dst
            rest = far.result()
        return (near + rest) & _U64

    def checksum(self) -> float:
        """``checksum`` of everything packed (by name), from the helper thread's sums when there is one."""
        if self._summer is None:
            raise RuntimeError("this packer was made with sums=False")
        return self._summer.result()

    def finish(self) -> tuple[Layout, list[torch.Tensor]]:
        if self._replay is not None:
            if self._ri == len(self._replay.specs):
                return self._replay, [b if b.numel() == spec.numel else b.narrow(0, 0, spec.numel)
                                      for b, spec in zip(self._rflat, self._replay.buckets)]
            self._end_replay()      # fewer tensors than last time
        prev = self._previous
        # A layout is a function of (specs, cap): the same tensors as last time give the same layout object, whose
        # manifest, digest and shares are already computed (~0.3 ms a version at 100 tensors).
        specs = tuple(s for s, _, _ in self._planner.placed)
        if prev is not None and prev.cap_bytes == self.cap and prev.specs == specs:
            layout = prev
        else:
            layout = self._planner.finish(self.cap)
        flat = [b for d in self._planner.order for b in self._store[d]]
        buckets = [b if b.numel() == spec.numel else b.narrow(0, 0, spec.numel)
                   for b, spec in zip(flat, layout.buckets)]
        if not self.zero_copy:   # what the next packing of this layout replays (zero-copy buckets are not asked for)
            layout.__dict__.setdefault("_allocs", tuple(self._allocs))
        return layout, buckets


def pack(named: NamedTensors, cap_bytes: int, device: Union[str, torch.device] = "cpu",
         zero_copy: bool = False, pool: Optional[BufferPool] = None) -> tuple[Layout, list[torch.Tensor]]:
    packer = BucketPacker(cap_bytes, device, zero_copy, pool)
    for name, t in named_items(named):
        packer.add(name, t)
    return packer.finish()
