"""The wire path: an epoch's gloo or NCCL process group carries every version - header, manifest (when the layout
changed), buckets, acknowledgements (``wire.send_version`` / ``recv_version``). Each version is announced in the
members' mailboxes first, so an idle member sleeps in a queue pop, never in a collective. (The interface and the
other paths: ``async_vla.weights.transport``.)"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Optional

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from async_vla.weights import transport
from async_vla.weights.buckets import Layout
from async_vla.weights.shm import ShmUnreadable
from async_vla.weights.transport import Early, Packed, Receiver, SendContext, Sent
from async_vla.weights.wire import BroadcastGroup, recv_version, send_version, td

log = logging.getLogger("async_vla.weights.publisher")
sub_log = logging.getLogger("async_vla.weights.subscriber")


class WireTransport:
    """Publisher side: the epoch's process group (formed in ``join``), the buckets over it."""

    kind = "wire"
    live_age_s = 0.0        # an early announcement reads the live set afresh

    def __init__(self, ctx: SendContext, epoch: int, members: tuple[int, ...]):
        self.ctx, self.epoch, self.members = ctx, epoch, tuple(members)
        self.group: Optional[BroadcastGroup] = None

    @property
    def verify_shares(self) -> int:
        return self.group.verify_shares if self.group is not None else 0

    def roster(self) -> dict:
        return {"backend": self.ctx.backend, "shm": "", "bell": ""}

    def join(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left to form the group")
        self.group = BroadcastGroup(self.ctx.backend, PrefixStore(f"w/e{self.epoch}/pg", self.ctx.store), 0,
                                    len(self.members) + 1, left, self.epoch, self.members,
                                    bind=self.ctx.gloo_bind)

    def may_start_early(self, quick: bool) -> bool:
        """Announce before packing: its members wake and wait in the header broadcast while we pack, instead of
        after (their wake-up leaves the critical path). Not when packing took long last time (a member's own
        timeout must not run out while it waits), nor on NCCL (a waiting collective would hold the actor's CUDA
        stream)."""
        return self.group is not None and self.ctx.backend == "gloo" and quick

    def start_early(self, version: int, layout: Optional[Layout], quick: bool) -> Early:
        try:
            self._announce(version)
        except (RuntimeError, ValueError) as exc:   # the store went away: the normal path reports it
            log.debug("weights: early announcement of v%d failed: %s", version, exc)
            return Early()
        return Early(standing=True, announced=True)

    def stream_early(self, version: int, layout: Optional[Layout], quick: bool) -> None:
        return None         # members wait in the header broadcast for the whole version

    def _announce(self, version: int) -> None:
        for tok in self.members:
            self.ctx.store.queue_push(f"w/mbox/{tok}", json.dumps({"t": "bcast", "e": self.epoch, "v": version}))

    def _place(self, p: Packed, version: int) -> tuple[Optional[tuple[int, list[int]]], float]:
        """Where the buckets are for the receivers: (segment generation, offsets) or None (over the wire), and how
        long putting them there took."""
        return None, 0.0

    def deliver(self, version: int, p: Packed, early: Early, deadline: float) -> Sent:
        def left() -> float:
            r = deadline - time.monotonic()
            if r <= 0:
                raise TimeoutError("weight broadcast ran out of time")
            return r

        cfg = self.ctx.cfg
        if p.csum is None and p.summing:
            p.csum = p.packer.checksum()
        sums = p.sums_of() if p.sums_of is not None else None
        shm, place_s = self._place(p, version)
        if not early.announced:
            self._announce(version)
        confirmed = send_version(self.group, version, p.layout, p.buckets, p.csum, left, cfg.overlap, shm,
                                 sums if cfg.verify_split else None)
        return Sent(confirmed, "shm" if shm else self.ctx.backend, place_s)

    def settle(self) -> None:
        """Wait (at most ``SETTLE_S``) until every member has counted itself released for each split-verified
        version (``wire.send_version`` returns after the verdict, before receivers hand the version over and let
        go of the one it replaces). Normally the counts are in long before the next publish; back to back, this
        keeps a slot from being re-made needlessly. Past the wait a slot still pinned is re-made as usual."""
        g = self.group
        if g is None or not g.released_owed:
            return
        key, end = f"w/e{g.epoch}/released", time.monotonic() + min(transport.SETTLE_S, self.ctx.timeout_s)
        try:
            while (have := self.ctx.store.add(key, 0)) < g.released_owed:
                if time.monotonic() >= end:
                    log.info("weights: %d of %d releases in epoch %d after %.1f s; going on", have,
                             g.released_owed, g.epoch, transport.SETTLE_S)
                    g.released_owed = have     # owed by a member that is gone: do not wait for it again
                    return
                time.sleep(transport.SETTLE_POLL_S)
        except (RuntimeError, ValueError) as exc:   # the store went away: the broadcast reports it
            log.debug("weights: settling epoch %d failed: %s", g.epoch, exc)

    def close(self) -> None:
        if self.group is None:
            return
        # Tell members still blocked in this epoch's receive to give up now. Closing our side is not enough: the
        # failed ops can keep gloo's context (and its sockets) open until our garbage collector runs, and a member
        # would wait out its own timeout and miss the re-forming invite.
        with contextlib.suppress(RuntimeError, ValueError):
            self.ctx.store.set(f"w/e{self.epoch}/drop", "1")
        self.group.close()
        self.group = None


def epoch_dropped(store, epoch: int) -> bool:
    """Has the publisher given up on ``epoch``? Asked between wait slices, with a short store timeout: a stalled
    learner must not hold the receiving thread longer than the op it waits on (a lost connection raises)."""
    store.set_timeout(td(transport.DROP_CHECK_S))
    try:
        return store.check([f"w/e{epoch}/drop"])
    except dist.DistStoreError:      # no answer in time: keep waiting on the op (it has its own timeout)
        return False
    finally:
        store.set_timeout(td(transport.POP_TIMEOUT_S))


class WireReceiver:
    """Subscriber side: this member's end of the epoch's group; each version announced in the mailbox is taken."""

    JOIN_ERRORS: tuple = (Exception,)    # e.g. nccl without CUDA here: stay on the file path

    def __init__(self, sub: Receiver, store, msg: dict, epoch: int, token: int, probe: str):
        self.sub, self.store, self.epoch, self.token = sub, store, epoch, token
        self.group = BroadcastGroup(msg["backend"], PrefixStore(f"w/e{epoch}/pg", store), int(msg["rank"]),
                                    int(msg["world"]), sub.timeout_s, epoch, bind=sub.gloo_bind)
        self.group.dropped = lambda e=epoch: epoch_dropped(store, e)
        # Split verification ends with this count instead of an acknowledgement (wire).
        self.group.released = lambda e=epoch: store.add(f"w/e{e}/released", 1)

    def serve(self) -> bool:
        return True         # versions are announced in the mailbox: ``take`` each

    def take(self) -> bool:
        """Receive one announced version; False when that lost the epoch (leave it)."""
        sub = self.sub
        try:
            self._receive()
        except ShmUnreadable as exc:
            sub.stats["failures"] += 1
            sub.refuse_shm(self.store, self.token, exc)
            raise
        except (RuntimeError, ValueError) as exc:
            sub.stats["failures"] += 1
            sub_log.info("weights: actor %d lost epoch %d: %s", sub.actor_id, self.epoch,
                         str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__)
            return False
        return True

    def _receive(self) -> None:
        sub, g, t0 = self.sub, self.group, time.monotonic()

        def hand_over(h: dict, tensors: dict, ok: bool) -> None:   # runs before the acknowledgement
            sub.hand_over(h["version"], tensors, ok, t0, g.shm_reader)

        recv_version(g, sub.timeout_s, sub.pool, sub.cfg.verify, hand_over)
        sub_log.debug("weights: actor %d received in %.3f s", sub.actor_id, time.monotonic() - t0)
        sub.notify()   # wake a waiting poll() only now: its copy would hold up our acknowledgement (GIL)

    def wake(self) -> None:
        pass                # our thread waits in the mailbox or in a collective with its own timeout

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

