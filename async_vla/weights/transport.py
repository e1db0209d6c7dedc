"""How one membership epoch's versions travel: the epoch's gloo or NCCL process group carries every version - header,
manifest (when the layout changed), buckets, acknowledgements (``wire.send_version`` / ``recv_version``). Each version
is announced in the members' mailboxes first, so an idle member sleeps in a queue pop, never in a collective. The
control plane (store, invites, rosters, retries) is ``publisher`` / ``subscriber``."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from async_vla.weights.buckets import Layout
from async_vla.weights.wire import BroadcastGroup, recv_version, send_version, td

log = logging.getLogger("async_vla.weights.publisher")
sub_log = logging.getLogger("async_vla.weights.subscriber")

POP_TIMEOUT_S = 60.0    # a subscriber's mailbox wait wakes this often with nothing to do (close() wakes it at once)
DROP_CHECK_S = 1.0      # how long a check for "the publisher dropped this epoch" may wait for the store


class Stopped(Exception):
    """The subscriber was closed: leave the session for good."""


@dataclass(eq=False)
class Packed:
    """One version packed by the publisher."""

    layout: Layout
    buckets: list
    csum: Optional[float]              # the checksum (None: nobody checks it)
    packed_at: float                   # time.monotonic() when packing ended


class WireTransport:
    """Publisher side: the epoch's process group (formed in ``join``), the buckets over it."""

    def __init__(self, store: Any, cfg: Any, backend: str, bind: Optional[str], epoch: int, members: tuple[int, ...]):
        """``store``: the publisher's TCPStore; ``cfg``: cfg.weights; ``bind``: where gloo's pair sockets listen."""
        self.store, self.cfg, self.backend, self.bind = store, cfg, backend, bind
        self.epoch, self.members = epoch, tuple(members)
        self.group: Optional[BroadcastGroup] = None

    def roster(self) -> dict:
        return {"backend": self.backend}

    def join(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left to form the group")
        self.group = BroadcastGroup(self.backend, PrefixStore(f"w/e{self.epoch}/pg", self.store), 0,
                                    len(self.members) + 1, left, self.epoch, self.members,
                                    bind=self.bind)

    def _announce(self, version: int) -> None:
        for tok in self.members:
            self.store.queue_push(f"w/mbox/{tok}", json.dumps({"t": "bcast", "e": self.epoch, "v": version}))

    def deliver(self, version: int, p: Packed, deadline: float) -> int:
        """Send the version; returns how many receivers confirmed its checksum."""
        def left() -> float:
            r = deadline - time.monotonic()
            if r <= 0:
                raise TimeoutError("weight broadcast ran out of time")
            return r

        self._announce(version)
        return send_version(self.group, version, p.layout, p.buckets, p.csum, left, self.cfg.overlap)

    def close(self) -> None:
        if self.group is None:
            return
        # Tell members still blocked in this epoch's receive to give up now. Closing our side is not enough: the
        # failed ops can keep gloo's context (and its sockets) open until our garbage collector runs, and a member
        # would wait out its own timeout and miss the re-forming invite.
        with contextlib.suppress(RuntimeError, ValueError):
            self.store.set(f"w/e{self.epoch}/drop", "1")
        self.group.close()
        self.group = None


def epoch_dropped(store, epoch: int) -> bool:
    """Has the publisher given up on ``epoch``? Asked between wait slices, with a short store timeout: a stalled
    learner must not hold the receiving thread longer than the op it waits on (a lost connection raises)."""
    store.set_timeout(td(DROP_CHECK_S))
    try:
        return store.check([f"w/e{epoch}/drop"])
    except dist.DistStoreError:      # no answer in time: keep waiting on the op (it has its own timeout)
        return False
    finally:
        store.set_timeout(td(POP_TIMEOUT_S))


class WireReceiver:
    """Subscriber side: this member's end of the epoch's group (``sub``: its ``WeightSubscriber``); each version
    announced in the mailbox is taken."""

    def __init__(self, sub, store, msg: dict, epoch: int):
        self.sub, self.store, self.epoch = sub, store, epoch
        self.group = BroadcastGroup(msg["backend"], PrefixStore(f"w/e{epoch}/pg", store), int(msg["rank"]),
                                    int(msg["world"]), sub.timeout_s, epoch, bind=sub.gloo_bind)
        self.group.dropped = lambda e=epoch: epoch_dropped(store, e)

    def take(self) -> bool:
        """Receive one announced version; False when that lost the epoch (leave it)."""
        sub, g, t0 = self.sub, self.group, time.monotonic()
        try:
            recv_version(g, sub.timeout_s, sub.pool, sub.cfg.verify,
                         lambda h, tensors, ok: sub.hand_over(h["version"], tensors, ok, t0))
        except (RuntimeError, ValueError) as exc:
            sub.stats["failures"] += 1
            sub_log.info("weights: actor %d lost epoch %d: %s", sub.actor_id, self.epoch,
                         str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__)
            return False
        sub_log.debug("weights: actor %d received in %.3f s", sub.actor_id, time.monotonic() - t0)
        sub.notify()   # wake a waiting poll() only now: its copy would hold up our acknowledgement (GIL)
        return True

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
