"""Optional native kernels (``copysum.c``, loaded with ctypes, built by the set-up or ``bin/build-native``): a copy
with non-temporal stores that sums what it copies, and a byte-word sum (both equal ``buckets.tensor_sum``). Without
it callers fall back to torch (same results, slower packing); ``status()`` says which, and why."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

LIBRARY = Path(__file__).with_name("libavla_copysum.so")
SOURCES = (Path(__file__).with_name("copysum.c"),)
ABI_VERSION = 2      # copysum.c's AVLA_ABI_VERSION: a stale build from older source is not used
_U64 = (1 << 64) - 1


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[ctypes.CDLL], str]:
    """(library, "") or (None, why not). Cached: loading is attempted once per process."""
    if not LIBRARY.exists():
        return None, f"{LIBRARY.name} not built (run bin/build-native; needs a C compiler)"
    for source in SOURCES:
        if source.exists() and source.stat().st_mtime > LIBRARY.stat().st_mtime:
            return None, f"{LIBRARY.name} is older than {source.name} (run bin/build-native)"
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        lib.avla_abi_version.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        return None, f"{LIBRARY.name} failed to load: {exc}"
    if lib.avla_abi_version() != ABI_VERSION:
        return None, f"{LIBRARY.name} is from an older copysum.c (run bin/build-native)"
    lib.avla_copy_sum.restype = ctypes.c_uint64
    lib.avla_copy_sum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.avla_sum.restype = ctypes.c_uint64
    lib.avla_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib, ""


def available() -> bool:
    return _load()[0] is not None


def status() -> str:
    """"native" or "torch (<why>)": for logs and benchmark reports."""
    lib, why = _load()
    return "native" if lib is not None else f"torch ({why})"


def copy_sum_raw(dst_ptr: int, src_ptr: int, nbytes: int) -> int:
    """Copy n bytes (not overlapping, contiguous CPU memory the caller checked) and return their ``tensor_sum``.
    ctypes releases the GIL for the call; little Python, so a helper thread holds the GIL only for a moment."""
    lib = _load()[0]
    return int(lib.avla_copy_sum(dst_ptr, src_ptr, nbytes)) & _U64 if nbytes else 0


def byte_sum(t: torch.Tensor) -> Optional[int]:
    """``tensor_sum`` of a contiguous CPU tensor, or None when the kernel cannot take it."""
    lib = _load()[0]
    if lib is None or t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    n = t.numel() * t.element_size()
    return int(lib.avla_sum(t.data_ptr(), n)) & _U64 if n else 0
