"""Reuse of weight buffers between versions, and the check that says when a buffer is free to reuse (nobody
still views it). Used by the packer (``async_vla.weights.packer``) and the subscriber's receive buffers."""

from __future__ import annotations

from typing import Union

import torch


def storage_free(t: torch.Tensor) -> bool:
    """True when nothing but ``t`` itself references its storage (no view handed out is still alive)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:   # private API gone: never reuse, always allocate (correct, just slower)
        return False
    return use_count(t.untyped_storage()._cdata) <= 2   # t + the temporary storage object


class BufferPool:
    """Reuses bucket buffers between versions (fresh large allocations page-fault on first touch). A buffer is reused
    only once every view handed out of it is gone (storage use count); ``get`` returns an alias, so a buffer counts as
    busy while its caller holds it."""

    def __init__(self):
        self._bufs: list[torch.Tensor] = []

    def get(self, numel: int, dtype: torch.dtype, device: Union[str, torch.device]) -> torch.Tensor:
        device = torch.device(device)
        for b in self._bufs:
            if b.numel() == numel and b.dtype == dtype and b.device == device and storage_free(b):
                return b[:]
        b = torch.empty(numel, dtype=dtype, device=device)
        self._bufs.append(b)
        return b[:]

    def trim(self, max_bytes: int) -> None:
        """Drop free buffers, oldest first, until the pool holds at most ``max_bytes``."""
        total = sum(b.numel() * b.element_size() for b in self._bufs)
        keep = []
        for b in self._bufs:
            if total > max_bytes and storage_free(b):
                total -= b.numel() * b.element_size()
            else:
                keep.append(b)
        self._bufs = keep
