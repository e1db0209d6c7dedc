"""How one membership epoch's versions travel: the interface of a path, both sides, free of any one path's types.

The control plane (store, invites, rosters, membership, retries: ``publisher`` / ``subscriber``) is the same for
every path; what differs is how a version crosses, and a path is one file with both sides and its own state
(``transport_wire``: a gloo or NCCL process group carries header, manifest and buckets; members learn of each
version in their mailbox).

Publisher side (``SendTransport``): the publisher makes the path for the members that acknowledged an invite, pushes
each member its roster with ``roster()``'s fields, ``join``s it, and then, per version: when the group stands,
``start_early`` (before packing), then ``deliver``; ``close`` drops the epoch. Subscriber side
(``ReceiveTransport``): made from the roster, it ``take``s each version announced in the mailbox; ``close`` leaves
it. A path lends nothing of its own to the other side: what the subscriber offers every path is ``Receiver``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from async_vla.weights.buckets import Layout
from async_vla.weights.packer import BucketPacker

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
    summing: bool                      # someone checks a checksum (receivers or learner ranks)
    zero_copy: bool
    packed_at: float                   # time.monotonic() when packing ended


@dataclass(eq=False)
class Early:
    """What a standing group was told before packing (``SendTransport.start_early``); ``Early()``: nothing."""

    standing: bool = False             # deliver to the group as it is (newcomers join at the next publish)
    announced: bool = False            # members were told of the version and wait for it (a failed pack drops them)


@dataclass(eq=False)
class Sent:
    """What ``SendTransport.deliver`` reports."""

    confirmed: int                     # receivers whose checksum matched
    transport: str                     # how the bytes went ("gloo", "nccl")


@dataclass(eq=False)
class SendContext:
    """What every path on the publisher shares across epochs."""

    store: Any                         # the publisher's TCPStore
    cfg: Any                           # cfg.weights
    backend: str                       # "gloo" or "nccl"
    timeout_s: float                   # the publisher's per-publish limit
    gloo_bind: Optional[str] = None    # where gloo's pair sockets listen (wire.gloo_bind); None: gloo's choice


class SendTransport(Protocol):
    """Publisher side of one epoch on one path."""

    epoch: int
    members: tuple[int, ...]           # member tokens, by rank 1, 2, ...

    def roster(self) -> dict: ...
    def join(self, deadline: float) -> None: ...
    def may_start_early(self, quick: bool) -> bool: ...
    def start_early(self, version: int) -> Early: ...
    def deliver(self, version: int, p: Packed, early: Early, deadline: float) -> Sent: ...
    def close(self) -> None: ...


class Receiver(Protocol):
    """What a subscriber lends the receiving side of any path (``WeightSubscriber`` implements it)."""

    cfg: Any                           # cfg.weights
    timeout_s: float
    actor_id: int
    stats: dict
    pool: Any                          # pool.BufferPool for the versions received
    gloo_bind: Optional[str]           # where this member's gloo pair sockets listen (None: gloo's choice)

    def hand_over(self, version: int, tensors: dict, ok: bool, t0: float) -> None: ...
    def notify(self) -> None: ...


class ReceiveTransport(Protocol):
    """Subscriber side of one epoch on one path."""

    epoch: int
    JOIN_ERRORS: tuple

    def take(self) -> bool: ...        # one version announced in the mailbox; False: the epoch is lost
    def close(self) -> None: ...

