"""The doorbell path: every member reads the learner's segments and can use the bell (``bell``: a shared page with
futexes), so the epoch needs no process group at all. Each version is posted on the page - before packing when its
offsets are known (``bell_versions.EarlyPost``) - and members, who serve the page until the epoch is dropped, sum
their verification shares while it is packed, pin it once sealed, acknowledge, and take the verdict. (The
interface and the other paths: ``async_vla.weights.transport``.)"""

from __future__ import annotations

import logging
import time
from typing import Optional

from async_vla.weights import bell as weight_bell
from async_vla.weights import transport
from async_vla.weights.bell import BellDropped, BellMember, BellPublisher, PostReplaced
from async_vla.weights.bell_versions import BellSender, EarlyPost, SharePlan, ViewPlan
from async_vla.weights.buckets import Layout
from async_vla.weights.shm import ShmUnreadable, valid_path
from async_vla.weights.transport import Early, Packed, Receiver, SendContext, Sent
from async_vla.weights.wire import td

log = logging.getLogger("async_vla.weights.publisher")
sub_log = logging.getLogger("async_vla.weights.subscriber")


class BellTransport:
    """Publisher side: the epoch's page (made in ``open``: the rosters name it), versions posted on it."""

    kind = "bell"
    # A member that dies is seen at once (its lock) and a silent one at the acknowledgement deadline, so the
    # store round trip (~0.2 ms) for the live set only tells about newcomers, who join at the first publish after.
    live_age_s = 0.1

    def __init__(self, ctx: SendContext, epoch: int, members: tuple[int, ...]):
        """Makes the page; OSError when there is no room or no descriptor for it."""
        self.ctx, self.epoch, self.members = ctx, epoch, tuple(members)
        self.bell = BellPublisher(ctx.shm.prefix, epoch, len(self.members))
        self.verify_shares = 0

    def roster(self) -> dict:
        return {"backend": self.ctx.backend, "shm": self.ctx.shm.prefix, "bell": self.bell.path}

    def join(self, deadline: float) -> None:
        """Raises when a member does not open the page in time (the retry re-forms without it)."""
        self.bell.wait_joined(min(deadline, time.monotonic() + self.ctx.cfg.join_timeout_s))

    def _split(self) -> int:
        return BellSender.split(self, self.ctx.cfg.verify, self.ctx.cfg.verify_split)

    def may_start_early(self, quick: bool) -> bool:
        return bool(self.ctx.cfg.shm)

    def start_early(self, version: int, layout: Optional[Layout], quick: bool) -> Early:
        """The group stands: deliver to it as it is (the checksum is folded after the seal)."""
        return Early(standing=True, checksum_after_seal=True)

    def stream_early(self, version: int, layout: Optional[Layout], quick: bool) -> Optional[EarlyPost]:
        """Members check their shares while we pack when the offsets are known now (the layout went to this slot
        last time) - unless packing took long last time (a ZeRO-3 gather of a large model): members would wait
        that out, as for an early announcement on the wire."""
        return self.ctx.bell.post_early(self, version, layout, self._split()) if quick else None

    def deliver(self, version: int, p: Packed, early: Early, deadline: float) -> Sent:
        confirmed = self.ctx.bell.send(self, version, p.layout, p.buckets, deadline, p.sums_of, early.post,
                                       self._split(), p.packer.compact)
        return Sent(confirmed, "shm")

    def settle(self) -> None:
        """Wait (at most ``SETTLE_S``) until every member has marked the last judged post released in its slot."""
        end = time.monotonic() + min(transport.SETTLE_S, self.ctx.timeout_s)
        while self.bell.released(self.bell.judged) < len(self.members) and time.monotonic() < end:
            time.sleep(transport.SETTLE_POLL_S)

    def close(self) -> None:
        self.bell.drop()


class BellCache:
    """What a subscriber keeps across doorbell epochs: layouts by digest (their manifests come from the store) and
    the view / share plans of the last two (segment, layout) pairs (segments alternate)."""

    def __init__(self):
        self.layouts: dict[int, Layout] = {}
        self.plans: dict[tuple, tuple[ViewPlan, Optional[SharePlan]]] = {}

    def plans_for(self, layout: Layout, split: int, rank: int, offsets: list[int]
                  ) -> tuple[ViewPlan, Optional[SharePlan]]:
        key = (layout.digest, split, rank, tuple(offsets))
        if key not in self.plans:       # the last two (segments alternate)
            self.plans = {key: (ViewPlan(layout, offsets), SharePlan(layout, split, rank, offsets) if split else None),
                          **dict(list(self.plans.items())[-1:])}
        return self.plans[key]

    def layout_of(self, store, digest: int, timeout_s: float) -> Layout:
        if digest not in self.layouts:
            # The publisher puts a new layout's manifest in the store before posting it: a digest without one is
            # a bad record, not something to wait the mailbox's minute for.
            store.set_timeout(td(min(timeout_s, transport.DROP_CHECK_S * 5)))
            try:
                raw = store.get(f"w/manifest/{digest}")
            finally:
                store.set_timeout(td(transport.POP_TIMEOUT_S))
            layout = Layout.from_manifest_bytes(raw)
            if layout.digest != digest:
                raise ValueError("the manifest in the store does not match the bell's digest")
            self.layouts = {digest: layout, **dict(list(self.layouts.items())[-1:])}
        return self.layouts[digest]


class BellReceiver:
    """Subscriber side: this member's end of the page; ``serve`` takes every posted version until the epoch is
    dropped, then the subscriber goes back to its mailbox."""

    JOIN_ERRORS: tuple = (OSError, ValueError, KeyError, RuntimeError)

    def __init__(self, sub: Receiver, store, msg: dict, epoch: int, token: int, probe: str):
        self.sub, self.store, self.epoch, self.token = sub, store, epoch, token
        path, prefix = str(msg.get("bell", "")), str(msg.get("shm") or "")
        if not (valid_path(path, sub.cfg.shm_dir) and valid_path(prefix, sub.cfg.shm_dir)):
            raise ValueError(f"roster names a bell or segments outside {sub.cfg.shm_dir}")
        self.reader = sub.reader_for(prefix)
        self.member: Optional[BellMember] = BellMember(path, int(msg["rank"]), epoch, probe)

    def take(self) -> bool:
        return True         # versions come through the page, never announced in the mailbox

    def serve(self) -> bool:
        """Take posted versions until the epoch is dropped (False: leave it); raises what ends the session."""
        sub, member = self.sub, self.member
        try:
            while not member.dropped:
                if sub.stopping():
                    raise transport.Stopped()
                p = member.next_post(weight_bell.MEMBER_SLICE_S)
                if p is None:
                    if not member.publisher_alive():
                        raise RuntimeError("the weight publisher is gone")
                    continue
                rec = member.record(p)
                if rec is None:       # aborted, or already replaced by the next post: take that one
                    continue
                try:
                    self._receive(member, p, rec)
                except PostReplaced:
                    continue
        except ShmUnreadable as exc:
            sub.stats["failures"] += 1
            sub.refuse_shm(self.store, self.token, exc)
            raise
        except BellDropped:
            pass
        except (TimeoutError, ValueError, RuntimeError) as exc:
            sub.stats["failures"] += 1
            sub_log.info("weights: actor %d lost epoch %d: %s", sub.actor_id, self.epoch,
                         str(exc).splitlines()[0][:160])
            if not member.publisher_alive():
                raise
        return False

    def _receive(self, member: BellMember, p: int, rec: dict[str, int]) -> None:
        """One posted version: views and share sum while the publisher packs, pin once sealed, acknowledge, verdict."""
        sub = self.sub
        t0 = time.monotonic()
        deadline, stop = t0 + sub.timeout_s, sub.stopping
        acked = False
        try:
            layout = sub.bell_cache.layout_of(self.store, rec["digest"], sub.timeout_s)
            gen, version, offsets = rec["generation"], rec["version"], rec["offsets"]
            if len(offsets) != len(layout.buckets) or rec["stream_bytes"] != layout.total_bytes:
                raise ValueError("bell record does not match its manifest")
            nbytes = [b.nbytes for b in layout.buckets]
            reader = self.reader
            try:
                reader.views(gen, offsets, nbytes)          # bounds checked (the views themselves are not needed)
                base = reader.mapped(gen)
            except ShmUnreadable:
                if member.post_moved(p):    # an aborted post's segment may be gone (re-made): not our failing
                    raise PostReplaced(f"post {p} was replaced while its segment was mapped") from None
                raise
            views, shares = sub.bell_cache.plans_for(layout, rec["split"], member.rank, offsets)
            tensors = views.views(base)                     # made while the publisher packs
            share = 0
            if shares is not None:
                share = shares.value(member.follow_sum(p, shares, base.data_ptr(), deadline, stop))
            member.wait_sealed(p, layout.total_bytes, deadline, stop)
            # Sealed: what is left is a pin, one acknowledgement and the verdict - a fresh deadline for them (a long
            # packing after an early post must not eat the time the rest is allowed).
            deadline = time.monotonic() + sub.timeout_s
            # Pinned before we acknowledge: a member that confirms a version holds it (one that cannot pin it
            # refuses it, and the verdict fails it for everyone).
            # (``pinned`` holds the pin from the moment it is taken; our views of the same mapping hold it after.)
            pinned = reader.pin_mapping(gen, version)
            if pinned.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                tensors = views.views(pinned)   # re-mapped in between: views of the mapping that is pinned
            del base, pinned
            member.ack(p, True, share)
            acked = True
            ok = member.wait_verdict(p, deadline, stop)
            reader.check(gen, version)   # pinned, so it cannot have changed: never take another version
        except (PostReplaced, BellDropped):
            raise
        except BaseException:
            if not acked:   # tell the publisher now rather than letting it wait out its timeout
                member.ack(p, False, 0)
            raise
        sub.hand_over(version, tensors, ok, t0, reader, layout.total_bytes)
        del tensors
        member.released(p)
        sub.notify()

    def wake(self) -> None:
        member = self.member
        if member is not None:     # the receiving thread may sleep on the page's futexes
            member.wake()

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
