"""Data plane of the weight broadcast: bucket layout, packing and checksums (the rule and its reasons:
docs/WEIGHTS.md "Buckets"). Both sides derive the same layout from the manifest - the ordered (name, dtype, shape)
list - and a size cap, so only the manifest crosses the wire, never offsets:

- tensors are grouped by dtype into flat typed buckets, in manifest order, at 64-byte aligned offsets, until the
  next one would exceed the cap, which closes the bucket; a tensor larger than the cap gets a bucket of its own;
- bucket order is dtype by first appearance, then creation order.

Checksum: per tensor the wrap-around int64 sum of its 8-byte words (plus trailing bytes), folded in name order into
a value below 2**52 (exact as a float): order-independent, so identical across processes and devices. It does not
catch a permutation of words inside one tensor."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from async_vla.weights import native
from async_vla.weights.pool import BufferPool

ALIGN = 64
MANIFEST_SCHEMA = 1
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_RANK = 8
_MOD = 1 << 52
_U64 = (1 << 64) - 1

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise TypeError(f"weights of dtype {dtype} cannot be broadcast (allowed: {sorted(DTYPES)})")
    return _NAMES[dtype]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: bucket index and element offset inside that (typed) bucket."""

    spec: TensorSpec
    bucket: int
    offset: int


@dataclass(frozen=True)
class BucketSpec:
    dtype: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


class _Planner:
    """The one greedy rule (module docstring). ``add`` places a tensor; ``finish`` orders the buckets."""

    def __init__(self, cap_bytes: int):
        self.cap = int(cap_bytes)
        self.order: list[str] = []                      # dtypes by first appearance
        self.used: dict[str, list[int]] = {}            # per dtype: bytes used by each bucket
        self.open: dict[str, int] = {}                  # per dtype: index of the open bucket
        self.placed: list[tuple[TensorSpec, int, int]] = []   # (spec, local bucket, byte offset)

    def add(self, spec: TensorSpec) -> tuple[int, int, bool]:
        """Returns (local bucket index within the dtype, byte offset, bucket is the tensor's own)."""
        if spec.dtype not in self.used:
            self.order.append(spec.dtype)
            self.used[spec.dtype] = []
        used, nbytes = self.used[spec.dtype], spec.nbytes
        if nbytes > self.cap:
            used.append(nbytes)
            place = (len(used) - 1, 0, True)
        else:
            idx = self.open.get(spec.dtype)
            off = -(-used[idx] // ALIGN) * ALIGN if idx is not None else 0
            if idx is None or off + nbytes > self.cap:
                used.append(0)
                idx, off = len(used) - 1, 0
                self.open[spec.dtype] = idx
            used[idx] = off + nbytes
            place = (idx, off, False)
        self.placed.append((spec, place[0], place[1]))
        return place

    def finish(self, cap_bytes: int) -> "Layout":
        base, n = {}, 0                  # global index of each dtype's first bucket
        for d in self.order:
            base[d], n = n, n + len(self.used[d])
        entries = tuple(Entry(s, base[s.dtype] + b, off // DTYPES[s.dtype].itemsize) for s, b, off in self.placed)
        buckets = tuple(BucketSpec(d, u // DTYPES[d].itemsize) for d in self.order for u in self.used[d])
        return Layout(tuple(s for s, _, _ in self.placed), cap_bytes, entries, buckets)


@dataclass(frozen=True)
class Layout:
    specs: tuple[TensorSpec, ...]
    cap_bytes: int
    entries: tuple[Entry, ...]
    buckets: tuple[BucketSpec, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(s.nbytes for s in self.specs)

    @property
    def wire_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def manifest_bytes(self) -> bytes:
        return self._manifest

    @functools.cached_property      # (a frozen dataclass still has a __dict__: computed once per layout)
    def _manifest(self) -> bytes:
        doc = {"schema": MANIFEST_SCHEMA, "cap": self.cap_bytes, "align": ALIGN,
               "tensors": [[s.name, s.dtype, list(s.shape)] for s in self.specs]}
        return json.dumps(doc, separators=(",", ":")).encode()

    @functools.cached_property
    def digest(self) -> int:
        """63-bit id of the manifest (fits an int64 header slot)."""
        return int.from_bytes(hashlib.sha256(self.manifest_bytes()).digest()[:8], "little") & ((1 << 63) - 1)

    @classmethod
    def from_manifest_bytes(cls, raw: bytes) -> "Layout":
        """Parse and validate a received manifest (trusts nothing), then plan the same layout."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError("manifest too large")
        doc = json.loads(raw.decode())
        if not isinstance(doc, dict) or doc.get("schema") != MANIFEST_SCHEMA or doc.get("align") != ALIGN:
            raise ValueError("manifest schema/alignment mismatch")
        cap, items = doc.get("cap"), doc.get("tensors")
        if not isinstance(cap, int) or cap < 1 or not isinstance(items, list):
            raise ValueError("manifest cap/tensors malformed")
        specs, seen = [], set()
        for item in items:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and item[1] in DTYPES
                    and isinstance(item[2], list) and len(item[2]) <= MAX_RANK
                    and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in item[2])):
                raise ValueError(f"manifest entry malformed: {str(item)[:80]}")
            if item[0] in seen:
                raise ValueError(f"duplicate tensor name {item[0]!r}")
            seen.add(item[0])
            specs.append(TensorSpec(item[0], item[1], tuple(item[2])))
        return plan(specs, cap)


def plan(specs: Sequence[TensorSpec], cap_bytes: int) -> Layout:
    planner = _Planner(cap_bytes)
    for s in specs:
        planner.add(s)
    return planner.finish(cap_bytes)


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(t.dtype), tuple(t.shape))     # (torch.Size holds ints already)


def empty_buckets(layout: Layout, device: Union[str, torch.device] = "cpu",
                  pool: Optional[BufferPool] = None) -> list[torch.Tensor]:
    if pool is None:
        return [torch.empty(b.numel, dtype=DTYPES[b.dtype], device=device) for b in layout.buckets]
    return [pool.get(b.numel, DTYPES[b.dtype], device) for b in layout.buckets]


def _check_buckets(layout: Layout, buckets: Sequence[torch.Tensor]) -> None:
    if len(buckets) != len(layout.buckets):
        raise ValueError(f"{len(buckets)} buckets, layout has {len(layout.buckets)}")
    for b, spec in zip(buckets, layout.buckets):
        if b.dtype != DTYPES[spec.dtype] or b.numel() != spec.numel:
            raise ValueError("bucket does not match layout")


def unpack(layout: Layout, buckets: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into the buckets, by name, in manifest order (copy them into the model)."""
    _check_buckets(layout, buckets)
    return {e.spec.name: buckets[e.bucket].narrow(0, e.offset, e.spec.numel).view(e.spec.shape)
            for e in layout.entries}


def named_items(named: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    return named.items() if isinstance(named, Mapping) else named


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_sum(t: torch.Tensor) -> int:
    """Wrap-around int64 sum of the tensor's bytes as 8-byte words (+ trailing bytes), as unsigned."""
    t = t.detach()
    fast = native.byte_sum(t)
    return tensor_sum_torch(t) if fast is None else fast


def tensor_sum_torch(t: torch.Tensor) -> int:
    """``tensor_sum`` with torch ops only (any device, any layout; the reference the native kernel is tested
    against)."""
    t = t.detach()
    size = t.element_size()
    if t.is_contiguous() and t.numel() * size % 8 == 0 and t.storage_offset() * size % 8 == 0 and t.numel():
        return int(t.reshape(-1).view(torch.int64).sum()) & _U64     # the common case, with fewer Python steps
    b = bytes_of(t)
    n8 = b.numel() // 8 * 8
    total = 0
    if n8:
        head = b.narrow(0, 0, n8)
        if (head.storage_offset() % 8) != 0:   # unaligned slice of a larger tensor: realign by copying
            head = head.clone()
        total = int(head.view(torch.int64).sum())
    if b.numel() > n8:
        total += int(b.narrow(0, n8, b.numel() - n8).to(torch.int64).sum())
    return total & _U64


def checksum(named: NamedTensors) -> float:
    """Order-independent, exact checksum of a set of named tensors (module docstring); < 2**52."""
    return float(fold((name, tensor_sum(t), t.numel()) for name, t in named_items(named)))


def fold(sums: Iterable[tuple[str, int, int]]) -> int:
    """(name, tensor_sum, numel) triples, folded in name order into the checksum value (< 2**52)."""
    h = 0
    for _, total, numel in sorted(sums):
        h = (h * 1_000_003 + total + numel) % _MOD
    return h
