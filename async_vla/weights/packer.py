"""Packing one version into buckets as its tensors stream in (layout rule and checksums: ``buckets``), so a ZeRO-3
learner can gather layer by layer; the checksum is taken on the way."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Optional, Union

import torch

from async_vla.weights import native
from async_vla.weights.buckets import (
    ALIGN, DTYPES, Layout, NamedTensors, _Planner, fold, named_items, spec_of, tensor_sum,
)
from async_vla.weights.pool import BufferPool

SPLIT_BYTES = 4 * 2**20   # native packing copies tensors from this size in two halves at once (helper thread)
_U64 = (1 << 64) - 1


class _Summer:
    """Per-tensor sums of ``checksum``, taken on a helper thread in batches of ~``BATCH`` bytes while the packer goes on
    copying (without an executor: in ``result()``); sums the native kernel took while copying arrive via ``add_sum``."""

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

    Each tensor is copied when added, so the caller may free it right after. ``summer`` (a one-thread executor, CPU):
    the checksum is computed alongside, or - with the native kernel, which sums while it copies - that thread copies
    half of each large tensor."""

    def __init__(self, cap_bytes: int, device: Union[str, torch.device] = "cpu", pool: Optional[BufferPool] = None,
                 summer: Optional[Executor] = None, sums: bool = True, previous: Optional["Layout"] = None):
        self.cap = int(cap_bytes)
        self._previous = previous    # the last version's layout: reused (manifest, digest) when equal
        self.device = torch.device(device)
        self._alloc = pool.get if pool is not None else (
            lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device))
        self._planner = _Planner(self.cap)
        self._store: dict[str, list[torch.Tensor]] = {}
        self._names: set[str] = set()
        self._summer = _Summer(summer if self.device.type == "cpu" else None) if sums else None
        # One pass that copies with non-temporal stores and sums on the way (docs/WEIGHTS.md "Buckets").
        self._native = self.device.type == "cpu" and native.available()
        self._helper = summer if self._native else None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        self._names.add(name)
        t = tensor.detach()
        spec = spec_of(name, t)
        local, off, own = self._planner.add(spec)
        bufs = self._store.setdefault(spec.dtype, [])
        dtype = DTYPES[spec.dtype]
        total: Optional[int] = None
        if own:
            bufs.append(self._alloc(spec.numel, dtype, self.device))
            dst = bufs[-1]
        else:
            if local == len(bufs):   # a new open bucket: allocate at the cap, trimmed in finish()
                bufs.append(self._alloc(-(-self.cap // dtype.itemsize), dtype, self.device))
            dst = bufs[local].narrow(0, off // dtype.itemsize, spec.numel)
        if self._native:
            total = self._copy_sum(dst, t.reshape(-1) if t.is_contiguous() else t)
        if total is None:
            dst.view(spec.shape).copy_(t)
        if self._summer is not None:     # the sum from the native copy, or summed from ``dst`` on the helper
            if total is None:
                self._summer.add(name, dst)
            else:
                self._summer.add_sum(name, total, spec.numel)

    def _copy_sum(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[int]:
        """The native copy (None: it cannot take ``src``); a large tensor is copied in two halves at once, the second
        on the helper thread. Both are done before this returns: the caller may free ``src`` right after ``add``."""
        if src.device.type != "cpu" or not src.is_contiguous() or src.is_neg() or src.dtype != dst.dtype:
            return None
        d, s, nbytes = dst.data_ptr(), src.data_ptr(), src.nbytes
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
        prev = self._previous
        # A layout is a function of (specs, cap): the same tensors as last time give the same layout object.
        specs = tuple(s for s, _, _ in self._planner.placed)
        if prev is not None and prev.cap_bytes == self.cap and prev.specs == specs:
            layout = prev
        else:
            layout = self._planner.finish(self.cap)
        flat = [b for d in self._planner.order for b in self._store[d]]
        buckets = [b if b.numel() == spec.numel else b.narrow(0, 0, spec.numel)
                   for b, spec in zip(flat, layout.buckets)]
        return layout, buckets


def pack(named: NamedTensors, cap_bytes: int, device: Union[str, torch.device] = "cpu",
         pool: Optional[BufferPool] = None) -> tuple[Layout, list[torch.Tensor]]:
    packer = BucketPacker(cap_bytes, device, pool)
    for name, t in named_items(named):
        packer.add(name, t)
    return packer.finish()
