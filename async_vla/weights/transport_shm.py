"""The shared-memory path: every member is on the learner's host and reads its segments (``shm``, ``shm_reader``),
so the epoch's gloo group carries only the header with the buckets' offsets (and the acknowledgements, or the
split-verification verdict); the bytes stay in the segment, which receivers pin and view read-only. A version
that finds no room in shared memory goes over the group instead (``wire``). (The interface and the other paths:
``async_vla.weights.transport``.)"""

from __future__ import annotations

import logging
import time
from typing import Optional

from async_vla.weights.shm import valid_path
from async_vla.weights.transport import Packed, Receiver
from async_vla.weights.transport_wire import WireReceiver, WireTransport

log = logging.getLogger("async_vla.weights.publisher")


class ShmTransport(WireTransport):
    """Publisher side: a gloo group whose rosters name the segments; each version is placed there first."""

    kind = "shm"

    def roster(self) -> dict:
        return {**super().roster(), "shm": self.ctx.shm.prefix}

    def _place(self, p: Packed, version: int) -> tuple[Optional[tuple[int, list[int]]], float]:
        shm = self.ctx.shm
        if not (self.ctx.cfg.shm and shm is not None):
            return None, 0.0
        t0 = time.monotonic()
        placed = shm.place(p.buckets, version)
        if placed is None:
            log.warning("weights: v%d over the wire: %s", version, shm.failed)
        # (members announced early wait through this too: it counts as packing)
        return placed, time.monotonic() - t0


class ShmReceiver(WireReceiver):
    """Subscriber side: the group, with this subscriber's mappings of the segments the roster names."""

    def __init__(self, sub: Receiver, store, msg: dict, epoch: int, token: int, probe: str):
        super().__init__(sub, store, msg, epoch, token, probe)
        prefix = str(msg.get("shm") or "")
        if valid_path(prefix, sub.cfg.shm_dir):   # (if not, a version sent through it fails: ShmUnreadable)
            self.group.shm_reader = sub.reader_for(prefix)
