"""How one membership epoch's versions travel: one class per path behind one small interface.

The control plane (store, invites, rosters, membership, retries: ``publisher`` / ``subscriber``) is the same for
every path; what differs is how a version crosses, and each path is one file with both sides:

- ``transport_wire``: a gloo or NCCL process group; header, manifest and buckets are broadcast over it
  (``wire.send_version``). Members learn of each version in their mailbox.
- ``transport_shm``: the same gloo group, but the buckets stay in the learner's shared-memory segment
  (``shm``) and only their offsets cross the group; a version that finds no room goes over the wire.
- ``transport_bell``: no process group: the version is posted on the epoch's doorbell page (``bell``,
  ``bell_versions``) and the members, who serve the page until the epoch is dropped, read it from the segment.

Publisher side (``SendTransport``): the publisher picks the path for the members that acknowledged an invite,
makes it (what the rosters must name), pushes each member its roster with ``roster()``'s fields, ``join``s it,
and then, per version: when the group stands, ``start_early`` (before packing) and ``stream_early`` (once the
segment slot is taken: what the packer reports progress to), then ``deliver``, and ``settle`` before a segment
slot is rewritten; ``close`` drops the epoch. Subscriber side (``ReceiveTransport``):
made from the roster, it ``serve``s the epoch (the doorbell: every version until it is dropped; a group: nothing,
versions are announced in the mailbox) and ``take``s each announced version; ``close`` leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from async_vla.weights.bell_versions import EarlyPost
from async_vla.weights.buckets import Layout
from async_vla.weights.packer import BucketPacker

SETTLE_S = 1.0          # longest a publish waits for receivers to let go of what the last one replaced
SETTLE_POLL_S = 0.0005
POP_TIMEOUT_S = 60.0    # a subscriber's mailbox wait wakes this often with nothing to do (close() wakes it at once)
DROP_CHECK_S = 1.0      # how long a check for "the publisher dropped this epoch" may wait for the store


class Stopped(Exception):
    """The subscriber was closed: leave the session for good."""


@dataclass(eq=False)
class Packed:
    """One version packed by the publisher, whichever path it goes by."""

    packer: BucketPacker
    layout: Layout
    buckets: list
    csum: Optional[float]              # the checksum, once computed (None: not yet, or nobody checks)
    sums_of: Optional[Callable]        # per-tensor sums for split verification (weights.verify)
    summing: bool                      # someone checks a checksum (receivers or learner ranks)
    zero_copy: bool
    packed_at: float                   # time.monotonic() when packing ended


@dataclass(eq=False)
class Early:
    """What a standing group was told before packing (``SendTransport.start_early``); ``Early()``: nothing."""

    standing: bool = False             # deliver to the group as it is (newcomers join at the next publish)
    announced: bool = False            # members were told of the version and wait for it (a failed pack drops them)
    post: Optional[EarlyPost] = None   # doorbell: posted before packing, members check shares while it packs
    checksum_after_seal: bool = False  # doorbell: the checksum is folded after the seal, not while packing

    def abort(self) -> None:
        if self.post is not None:
            self.post.abort()


@dataclass(eq=False)
class Sent:
    """What ``SendTransport.deliver`` reports."""

    confirmed: int                     # receivers whose checksum matched (all or none under split verification)
    transport: str                     # "shm", "gloo" or "nccl": how the bytes went
    place_s: float = 0.0               # time spent copying the buckets into shared memory (counts as packing)


@dataclass(eq=False)
class SendContext:
    """What every path on the publisher shares across epochs."""

    store: Any                         # the publisher's TCPStore
    cfg: Any                           # cfg.weights
    backend: str                       # "gloo" or "nccl"
    timeout_s: float                   # the publisher's per-publish limit
    shm: Any = None                    # ShmPublisher, when the shared-memory path is on
    bell: Any = None                   # bell_versions.BellSender, when the doorbell is available
    gloo_bind: Optional[str] = None    # where gloo's pair sockets listen (wire.gloo_bind); None: gloo's choice


class SendTransport(Protocol):
    """Publisher side of one epoch on one path."""

    kind: str                          # "wire", "shm" or "bell"
    live_age_s: float                  # how old a live set may be to tell that the group still stands
    epoch: int
    members: tuple[int, ...]           # member tokens, by rank 1, 2, ...
    verify_shares: int                 # shares the last version was checked in (0: not split)

    def roster(self) -> dict: ...
    def join(self, deadline: float) -> None: ...
    def may_start_early(self, quick: bool) -> bool: ...
    def start_early(self, version: int, layout: Optional[Layout], quick: bool) -> Early: ...
    def stream_early(self, version: int, layout: Optional[Layout], quick: bool) -> Optional[EarlyPost]: ...
    def deliver(self, version: int, p: Packed, early: Early, deadline: float) -> Sent: ...
    def settle(self) -> None: ...
    def close(self) -> None: ...


class Receiver(Protocol):
    """What a subscriber lends the receiving side of a path (``WeightSubscriber`` implements it)."""

    cfg: Any                           # cfg.weights
    timeout_s: float
    actor_id: int
    stats: dict
    pool: Any                          # buffers.BufferPool for versions received over the wire
    bell_cache: Any                    # transport_bell.BellCache: layouts and plans kept across doorbell epochs
    gloo_bind: Optional[str]           # where this member's gloo pair sockets listen (None: gloo's choice)

    def stopping(self) -> bool: ...
    def reader_for(self, prefix: str) -> Any: ...
    def refuse_shm(self, store, token: int, exc: BaseException) -> None: ...
    def hand_over(self, version: int, tensors: dict, ok: bool, t0: float, reader: Any,
                  nbytes: Optional[int] = None) -> None: ...
    def notify(self) -> None: ...


class ReceiveTransport(Protocol):
    """Subscriber side of one epoch on one path."""

    epoch: int

    def serve(self) -> bool: ...       # False: the epoch is over (leave it)
    def take(self) -> bool: ...        # one version announced in the mailbox; False: the epoch is lost
    def wake(self) -> None: ...
    def close(self) -> None: ...
