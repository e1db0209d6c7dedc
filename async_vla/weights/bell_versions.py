"""One version on a doorbell (the page and its protocol: ``async_vla.weights.bell``): the publisher's side - posting
before packing when the offsets are known (``EarlyPost``), then seal, acknowledgements and verdict (``BellSender``)
- and the member's plans for reading it while it is packed (``SharePlan``, ``ViewPlan``)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from async_vla.weights.bell import CHUNK_BYTES, BellPublisher
from async_vla.weights.buckets import ALIGN, DTYPES, Layout, fold, share_checksum, verify_shares

if TYPE_CHECKING:
    from async_vla.weights.transport_bell import BellTransport


class NoRoom(Exception):
    """A doorbell group's version did not fit in shared memory: it goes over the wire (a gloo group) instead."""


class BellSender:
    """The publisher's doorbell state across versions and epochs: the offsets each segment generation took when the
    layout was last packed straight into it (so the next version of that layout can be posted before packing), and
    which manifests are in the store (members read a new layout's there)."""

    def __init__(self, store, shm):
        self._store, self._shm = store, shm
        self._seen: dict[int, tuple[int, list[int]]] = {}   # segment generation -> (layout digest, offsets)
        self._manifests: set[int] = set()

    @staticmethod
    def split(g: "BellTransport", verify: bool, verify_split: bool) -> int:
        """Verification shares of a version: one per member, 1 (each checks all) or 0 (nobody checks)."""
        if not verify:
            return 0
        return len(g.members) if verify_split else 1

    def post_early(self, g: "BellTransport", version: int, layout: Optional[Layout], split: int) -> Optional["EarlyPost"]:
        """Post ``version`` before packing when ``layout`` (the last version's) went to the current segment last
        time it was packed straight into it: the packer allocates from it in the same order, so the offsets are
        those again. None when they are not known (post once sealed)."""
        gen = self._shm.generation
        seen = self._seen.get(gen)
        if layout is None or seen is None or seen[0] != layout.digest:
            return None
        p = g.bell.post(version, gen, seen[1], split, layout.digest, layout.total_bytes, sealed=False)
        return EarlyPost(g.bell, p, layout, gen, seen[1], split)

    def send(self, g: "BellTransport", version: int, layout: Layout, buckets: Sequence[torch.Tensor], deadline: float,
             sums: Optional[Callable[[], Mapping[str, tuple[int, int]]]], post: Optional["EarlyPost"],
             split: int, compact: bool = True) -> int:
        """Seal the packed version, post it (or complete the early post), collect every member's share and judge
        them all at once; returns how many members confirmed (all or none). ``sums()`` gives the packing's
        per-tensor sums (folded into each share's value while the members finish: after the seal). Raises NoRoom
        when shared memory cannot hold it, or what ``BellPublisher.collect`` raises for a member that died or does
        not answer."""
        placed = self._shm.place(buckets, version)      # seals the segment
        if placed is None:
            if post is not None:
                post.abort()
            raise NoRoom(self._shm.failed)
        gen, offsets = placed
        # Packing this layout into this segment again gives these offsets - if it went there in one go (``compact``:
        # a replay that ended midway leaves unused buffers between them).
        if self._shm.packed_in_place and compact:
            self._seen = {k: v for k, v in self._seen.items() if k >= gen - 2}
            self._seen[gen] = (layout.digest, list(offsets))
        if layout.digest not in self._manifests:
            self._store.set(f"w/manifest/{layout.digest}", layout.manifest_bytes())
            self._manifests.add(layout.digest)
        split = split if sums is not None else 0
        if post is not None and post.matches(layout, gen, offsets, split):
            p = post.p
            g.bell.seal(p, layout.total_bytes)
        else:
            if post is not None:
                post.abort()
            p = g.bell.post(version, gen, offsets, split, layout.digest, layout.total_bytes, sealed=True)
        if split:
            by_name = sums()
            expected = [share_checksum(names, by_name) for names in verify_shares(layout, split)]
        acks = g.bell.collect(p, deadline)
        ok = all(status == 1 for status, _ in acks)
        if split:
            ok = ok and all(got == expected[r % split] for r, (_, got) in enumerate(acks))
        g.bell.verdict(p, ok)
        g.verify_shares = split if split > 1 else 0
        return len(acks) if ok else 0


class EarlyPost:
    """A version posted before packing, driven by the packer (``BucketPacker(stream=...)``) while it replays the
    posted layout: ``advance`` moves the bell's progress as tensors land; a packing that leaves the layout aborts
    the post, and the version is posted again once sealed (``matches`` is then False)."""

    def __init__(self, bell: BellPublisher, p: int, layout: Layout, generation: int, offsets: Sequence[int],
                 split: int):
        self.bell, self.p, self.layout, self.split = bell, p, layout, split
        self.generation, self.offsets = generation, list(offsets)
        self._n = len(layout.specs)
        self._i = 0
        self._done = self._reported = 0

    def advance(self, nbytes: int) -> None:
        """The next tensor of the posted layout (``nbytes`` of it) is in the segment."""
        if self.p is None:
            return
        self._i, self._done = self._i + 1, self._done + nbytes
        # Reported in steps of at least a chunk (members wait for that much at a time) and at the last tensor
        # (before the seal, so the member with the last share finishes it while the segment is sealed).
        if self._done - self._reported >= CHUNK_BYTES or self._i == self._n:
            self._reported = self._done
            self.bell.progress(self._done)

    def matches(self, layout: Layout, generation: int, offsets: Sequence[int], split: int) -> bool:
        """Was the version packed exactly as posted (same layout, segment and offsets, every tensor streamed)?"""
        return (self.p is not None and self._i == self._n and layout.digest == self.layout.digest
                and generation == self.generation and list(offsets) == self.offsets and split == self.split)

    def abort(self) -> None:
        if self.p is not None:
            self.p = None
            self.bell.abort()



class SharePlan:
    """Where one receiver's verification share lies: per tensor its byte offset in the segment, its size and where
    it ends in the packing stream (manifest order) - the arrays ``avla_follow_sum`` walks."""

    def __init__(self, layout: Layout, split: int, rank: int, offsets: Sequence[int]):
        # Member r checks share (r - 1) % split: split = members (each its own share), 1 (everyone checks
        # everything: weights.verify_split off) or 0 (no checks: weights.verify off).
        names = verify_shares(layout, split)[(rank - 1) % split] if split else []
        ends, done = {}, 0
        for spec in layout.specs:
            done += spec.nbytes
            ends[spec.name] = done
        where = layout.entry_of
        rows = []
        for name in names:
            e = where[name]
            rows.append((offsets[e.bucket] + e.offset * DTYPES[e.spec.dtype].itemsize, e.spec.nbytes, ends[name]))
        self.names = names
        self.numels = [where[n].spec.numel for n in names]
        self.n = len(rows)
        arr = ctypes.c_int64 * max(1, self.n)
        self.offs = arr(*[r[0] for r in rows])
        self.sizes = arr(*[r[1] for r in rows])
        self.ends = arr(*[r[2] for r in rows])

    def value(self, sums: Sequence[int]) -> int:
        """The share's checksum (``buckets.share_checksum`` of what was summed)."""
        return fold(zip(self.names, sums, self.numels))



class ViewPlan:
    """Where each tensor of a version lies in its segment, as (shape, strides, element offset) per tensor, so a
    receiver makes each view with one ``as_strided`` on the mapping (a third of the steps of narrowing a bucket and
    viewing it, and it runs while the publisher packs)."""

    def __init__(self, layout: Layout, offsets: Sequence[int]):
        self.rows = []
        for e in layout.entries:
            item = DTYPES[e.spec.dtype].itemsize
            if offsets[e.bucket] % ALIGN:
                raise ValueError(f"bucket offset {offsets[e.bucket]} is not {ALIGN}-byte aligned")
            strides, n = [], 1
            for d in reversed(e.spec.shape):
                strides.append(n)
                n *= d
            self.rows.append((e.spec.name, e.spec.dtype, e.spec.shape, tuple(reversed(strides)),
                              offsets[e.bucket] // item + e.offset))
        self.dtypes = sorted({d for _, d, _, _, _ in self.rows})

    def views(self, base: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors by name, views of ``base`` (the whole mapping as uint8, bounds checked by the caller)."""
        typed = {d: base.view(DTYPES[d]) for d in self.dtypes}
        return {name: typed[d].as_strided(shape, strides, off) for name, d, shape, strides, off in self.rows}
