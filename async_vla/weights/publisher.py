"""Weight broadcast from learner rank 0 to actor processes (the full design: docs/WEIGHTS.md).

Why a separate process group: DeepSpeed's world is the learner ranks and must stay fixed for ZeRO-3
collectives; actors come and go. Rank 0 hosts its own ``TCPStore`` and builds a stand-alone
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU, same code) over ``PrefixStore(f"w/e{n}/pg")`` with
itself as rank 0 and the actors alive now, never registered with ``torch.distributed`` (``new_group`` would
drag actors into the training world), so we call ``pg.broadcast([t], opts).wait()`` directly.

Membership epochs go through the store (no clocks compared across hosts): an actor registers a token and a
side thread bumps its heartbeat; at ``publish()`` the publisher re-forms the group (invite -> ack within
``join_timeout_s`` -> roster) when the live set changed or the group broke; an actor that misses the ack is
suspended with back-off. Each broadcast is announced in the members' mailboxes (store queues), so an idle
actor sleeps in a queue pop, never in a collective. How a version travels is the epoch's path, picked at forming
(``async_vla.weights.transport``: the wire, shared memory, or the doorbell, one class each); ``publish`` is the
same outline for all: pack, (re-)form if needed, deliver, export.

Failure: every collective on the publisher has a per-op timeout of what is left of ``timeout_s``. A killed
actor makes the next op raise at once; a stopped one makes it time out. The publisher then drops its group -
it sets ``w/e<n>/drop`` in the store, which members blocked in one of that epoch's receives check every
``DROP_POLL_S`` (its sockets alone may stay open until the failed ops are collected; gloo's ``abort()`` does
not close them) - and retries once with a new epoch if time is left. A gloo group is destroyed on a thread of
its own: its destructor waits for in-flight ops, up to their timeout. A late or restarted actor loads
``<run>/weights/latest`` (``fetch_latest``) and joins at the next publish. NCCL groups are built with
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up only) and aborted before they are dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from async_vla.weights import bell as weight_bell
from async_vla.weights import native
from async_vla.weights.bell_versions import BellSender, NoRoom
from async_vla.weights.buckets import Layout
from async_vla.weights.export import Exporter
from async_vla.weights.members import MemberRegistry
from async_vla.weights.packer import BucketPacker
from async_vla.weights.pool import BufferPool
from async_vla.weights.shm import RETRY_S as SHM_RETRY_S, ShmPublisher
from async_vla.hosts import is_loopback
from async_vla.weights.store_guard import StoreGuard
from async_vla.weights.transport import Early, Packed, SendContext, SendTransport
from async_vla.weights.transport_bell import BellTransport
from async_vla.weights.transport_shm import ShmTransport
from async_vla.weights.transport_wire import WireTransport
from async_vla.weights.wire import WIRE_VERSION, gloo_bind, resolve_backend, td

log = logging.getLogger(__name__)

BYE_DRAIN_S = 0.5       # closing: how long the store stays up for live actors to read their goodbye


class WeightPublisher:
    """Learner rank 0: hosts the store, forms groups of live actors, broadcasts and exports weights."""

    def __init__(self, cfg, run_dir: Union[str, Path], world_timeout_s: Optional[float] = None,
                 lineage: Optional[str] = None):
        self.cfg = cfg.weights
        self.timeout_s = float(world_timeout_s or cfg.weights.timeout_s)
        self.backend = resolve_backend(cfg)
        on_gpu = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.weights_dir = Path(run_dir) / "weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        # Bind ourselves so the store listens on loopback only (TCPStore alone binds every interface) and port 0
        # gives a free port; the store takes ownership of the fd. It has no authentication: beyond loopback
        # (transport.host) peers reach it through a StoreGuard that refuses addresses outside
        # transport.weights_allowed_peers.
        exposed = not is_loopback(cfg.transport.host)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0 if exposed else cfg.transport.weights_port))
        sock.listen(128)
        store_port = sock.getsockname()[1]
        self._store = TCPStore("127.0.0.1", store_port, None, True, td(self.timeout_s),
                               wait_for_workers=False, master_listen_fd=sock.detach())
        self.guard: Optional[StoreGuard] = None
        if exposed:
            self.guard = StoreGuard(cfg.transport.host, cfg.transport.weights_port, store_port,
                                    cfg.transport.weights_allowed_peers)
        self.port = self.guard.port if self.guard is not None else store_port
        self.lineage = uuid.uuid4().hex if lineage is None else lineage
        """The learner lineage every version published here belongs to (None given: a new one, as a learner start
        mints; subscribers tag what they receive with it)."""
        self._store.set("w/lineage", self.lineage)
        self._store.set("w/wire", str(WIRE_VERSION))
        for key in ("w/tokens", "w/leaves"):    # counters read with multi_get, which waits for missing keys
            self._store.add(key, 0)
        self._pool = BufferPool()
        # Helper thread: half of each large copy (native kernel) or the sums while packing (torch fallback).
        self._summer = ThreadPoolExecutor(1, thread_name_prefix="weights-pack")
        if self.device.type == "cpu":
            log.info("weights: packing with %s", native.status())
        self._shm: Optional[ShmPublisher] = None
        if self.cfg.shm and self.backend == "gloo":
            try:
                self._shm = ShmPublisher(self.cfg.shm_dir, self.lineage, self._pool)
            except OSError as exc:
                log.warning("weights: no shared-memory path in %s (%s); broadcasting over gloo only",
                            self.cfg.shm_dir, exc)
        self._store.set("w/shm", self._shm.probe if self._shm is not None else "")
        self._bell_ok = self._shm is not None and weight_bell.available()
        self._ctx = SendContext(self._store, self.cfg, self.backend, self.timeout_s, self._shm,
                                BellSender(self._store, self._shm) if self._bell_ok else None,
                                # gloo's pair sockets: loopback in a one-host run (docs/RELIABILITY.md "Security")
                                gloo_bind(cfg.transport.host))
        self._wire_until = 0.0     # shared memory had no room: groups stay on the wire until then
        self._bell_after = 0.0     # a doorbell page could not be made: gloo messages until then
        self._endpoint = self.weights_dir / "endpoint.json"
        tmp = self.weights_dir / f".endpoint.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"host": cfg.transport.connect_host, "port": self.port,
                                   "lineage": self.lineage, "pid": os.getpid()}))
        os.replace(tmp, self._endpoint)
        self._registry = MemberRegistry()
        self._members = self._registry.members      # token -> Member
        self._live_at: tuple[float, list[int]] = (-1e9, [])     # when the live set was last read, and what it was
        self._epoch = 0
        self._group: Optional[SendTransport] = None    # this epoch's path (transport_wire / _shm / _bell)
        # Milestones (every run.eval_every versions) are kept only where an evaluator made weights/milestones/.
        self._exporter = Exporter(self.weights_dir, self.cfg.export_keep, self.lineage,
                                  milestone_every=cfg.run.eval_every)
        self._last_pack_s = 0.0
        self._layout: Optional[Layout] = None     # the last version's (reused while the tensors stay the same)
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------ membership
    def _live_tokens(self) -> list[int]:
        live = self._registry.live(self._store, 5 * self.cfg.heartbeat_s, 10 * self.cfg.heartbeat_s + 1.0)
        self._live_at = (time.monotonic(), live)
        return live

    def live_actors(self) -> list[int]:
        """Actor ids registered and heartbeating now (the next publish invites these)."""
        return sorted(self._members[t].actor_id for t in self._live_tokens())

    def wait_for_actors(self, n: int, timeout_s: float) -> int:
        """Wait until at least ``n`` actors are live (sync-mode start-up, tests); returns how many are."""
        end = time.monotonic() + timeout_s
        while len(live := self.live_actors()) < n and time.monotonic() < end:
            time.sleep(0.05)
        return len(live)

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _form(self, live: list[int], deadline: float) -> None:
        """A new epoch for the live members: invite, collect acknowledgements, pick the path, send the rosters,
        join. Members that do not answer are suspended with back-off."""
        self._drop_group()
        if not live:
            return
        s = self._store
        self._epoch += 1
        e = self._epoch
        for tok in live:
            s.queue_push(f"w/mbox/{tok}", json.dumps({"t": "invite", "e": e}))
        keys = [f"w/e{e}/ack/{tok}" for tok in live]
        with contextlib.suppress(dist.DistStoreError):
            s.wait(keys, td(min(self.cfg.join_timeout_s, max(0.0, deadline - time.monotonic()))))
        acked, now = [], time.monotonic()
        for tok, key in zip(live, keys):
            m = self._members[tok]
            if s.check([key]):
                acked.append(tok)
                m.fails = 0
                s.delete_key(key)
            else:   # alive by heartbeat but not answering: back off so it cannot stall every publish
                m.fails += 1
                m.suspended_until = now + min(60.0, self.cfg.join_timeout_s * 2 ** m.fails)
                log.warning("weights: actor %d (token %d) did not join epoch %d", m.actor_id, tok, e)
        if not acked:
            return
        # Ours from now on: whatever fails below, the retry's _drop_group closes it.
        self._group = t = self._open(self._kind(acked), e, tuple(acked))
        for rank, tok in enumerate(acked, 1):
            s.queue_push(f"w/mbox/{tok}", json.dumps({"t": "roster", "e": e, "rank": rank, "world": len(acked) + 1,
                                                      **t.roster()}))
        t.join(deadline)

    def _open(self, kind: str, epoch: int, members: tuple[int, ...]) -> SendTransport:
        if kind == "bell":
            try:
                return BellTransport(self._ctx, epoch, members)
            except OSError as exc:       # no room or no descriptor for the page: gloo messages for a while
                log.warning("weights: no doorbell page for epoch %d (%s); using gloo messages", epoch, exc)
                self._bell_after = time.monotonic() + SHM_RETRY_S
                kind = "shm"
        return (ShmTransport if kind == "shm" else WireTransport)(self._ctx, epoch, members)

    # ------------------------------------------------------------------ publishing
    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
                zero_copy: bool = False) -> dict[str, Any]:
        """Pack, broadcast to the live actors, export. Never blocks longer than ~timeout_s on actors.

        Returns stats: version, sync_s (pack + broadcast), pack_s, bytes, num_buckets, receivers (in the
        group), confirmed (receivers whose checksum matched; with split verification all or none, by the
        verdict, and publish returns right after it: receivers hand over a moment later), transport (shm, gloo
        or nccl), epoch, formed,
        failures, error, checksum (None when nobody verifies), export_path, announced_early (members were told
        before packing), verify_shares (receivers each checked one of this many shares: split verification on
        shared memory; 0 when each checked everything or nothing), shm_remade (shared-memory segments re-made
        so far because a receiver still held views of them: should stay near 0). ``zero_copy`` lets tensors
        above the bucket cap be sent without a copy over the wire (they must stay unchanged until this returns;
        export then runs synchronously); with shared memory on, everything is packed into the segment instead.
        """
        t0 = time.monotonic()
        p, early = self._pack(version, named_tensors, zero_copy)
        self._last_pack_s = p.packed_at - t0
        stats = self._deliver(version, p, early, deadline=p.packed_at + self.timeout_s)
        stats["epoch"] = self._epoch
        stats["shm_remade"] = self._shm.remade_pinned if self._shm is not None else 0
        stats["pack_s"] = p.packed_at - t0
        if p.csum is None and p.summing:
            p.csum = p.packer.checksum()
        stats["checksum"] = p.csum
        stats["sync_s"] = time.monotonic() - t0
        stats["export_path"], stats["export_error"] = "", ""
        self.last = stats
        if self.cfg.export:
            stats["export_path"] = str(self.weights_dir / f"v{version}.safetensors")
            error = self._exporter.start(version, p.layout, p.buckets, p.csum,
                                         p.zero_copy or not self.cfg.export_async)
            if error is not None:
                stats["export_error"] = f"v{version - 1}: {error}"   # the previous export; surfaced once
        return stats

    def _pack(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
              zero_copy: bool) -> tuple[Packed, Early]:
        """Pack the tensors into buckets (into the shared-memory segment when there is one), telling a standing
        group of the version first where its path lets members start early (``SendTransport.start_early``, and
        ``stream_early`` once the segment slot is taken)."""
        shm = self._shm is not None and self.cfg.shm
        g, early = self._group, Early()
        # Not when packing took long last time (a ZeRO-3 gather of a large model): members would wait that out.
        quick = self._last_pack_s <= 0.25 * min(self.timeout_s, float(self.cfg.timeout_s))
        if g is not None and g.may_start_early(quick) and self._standing(g):
            early = g.start_early(version, self._layout, quick)
        try:
            into = self._shm.arena(self._settle) if shm else self._pool
            if early.standing:   # (the slot packed into is known now)
                early.post = g.stream_early(version, self._layout, quick)
            zero_copy = zero_copy and not shm       # with shared memory everything is packed into the segment
            # The checksum only when someone checks it (receivers, learner ranks); an export computes its own.
            summing = self.cfg.verify or self.cfg.verify_ranks
            packer = BucketPacker(int(self.cfg.bucket_mb * 2**20), self.device, zero_copy, into, self._summer,
                                  sums=summing, previous=self._layout, split=early.post is None, stream=early.post)
            for name, t in named_tensors:
                packer.add(name, t)
            layout, buckets = packer.finish()
            self._layout = layout
            # One version exporting, one packing; none once both shared-memory segments take the packing.
            self._pool.trim(0 if shm and self._shm.in_place else 3 * layout.wire_bytes + 2 * packer.cap)
            csum = packer.checksum() if summing and not early.checksum_after_seal else None
            # Receivers through shared memory each check a share of these (wire.send_version).
            sums_of = packer.tensor_sums if self.cfg.verify else None
        except BaseException:
            early.abort()
            if shm:     # the slot we were packing into is ours again; the other may still be exporting v-1
                self._shm.undo()
            if early.announced:   # the members wait in the header broadcast: closing the group fails them at once
                self._drop_group()
            raise
        return Packed(packer, layout, buckets, csum, sums_of, summing, zero_copy, time.monotonic()), early

    def _deliver(self, version: int, p: Packed, early: Early, deadline: float) -> dict[str, Any]:
        """Send the packed version to the group - formed or re-formed first unless it stood when packing began -
        by its path; one retry with a new epoch after a failure, and the wire when shared memory has no room.
        Returns the stats ``publish`` reports."""
        stats: dict[str, Any] = {"version": version, "bytes": p.layout.total_bytes, "num_buckets": len(p.buckets),
                                 "checksum": p.csum, "receivers": 0, "confirmed": 0, "transport": "",
                                 "epoch": self._epoch, "formed": False, "failures": 0, "error": "",
                                 "announced_early": early.announced or early.post is not None, "verify_shares": 0,
                                 "doorbell": False}
        attempts = 2
        while attempts > 0:
            attempts -= 1
            if deadline - time.monotonic() < 0.05:
                break
            try:
                if not early.standing:   # (a standing group gets it as it is; newcomers come next time)
                    live = self._live_tokens()
                    if self._group is None or self._reform(live):
                        self._form(live, deadline)
                        stats["formed"] = True
                g = self._group
                if g is None:
                    break
                stats["doorbell"] = g.kind == "bell"
                sent = g.deliver(version, p, early, deadline)
                self._last_pack_s += sent.place_s
                stats["confirmed"], stats["transport"] = sent.confirmed, sent.transport
                stats["receivers"], stats["error"] = len(g.members), ""
                stats["verify_shares"] = g.verify_shares
                break
            except NoRoom as exc:   # planned: this version (and the next ones, a while) over the wire
                log.warning("weights: v%d over the wire: %s", version, exc)
                self._wire_until = time.monotonic() + SHM_RETRY_S
                self._drop_group()
                early, attempts = Early(), attempts + 1
            except (RuntimeError, TimeoutError, ValueError) as exc:   # DistError is a RuntimeError
                stats["failures"] += 1
                stats["error"] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.warning("weights: broadcast of v%d failed in epoch %d (%s); re-forming",
                            version, self._epoch, stats["error"])
                self._drop_group()
                early = Early()
        return stats

    # ------------------------------------------------------------------ which path, and does the group stand
    def _standing(self, g: SendTransport) -> bool:
        """The group still matches the live set (so a version may be announced or posted to it before packing),
        by a live set read from the store at most ``g.live_age_s`` ago."""
        seen_at, live = self._live_at
        try:
            if time.monotonic() - seen_at >= g.live_age_s:
                live = self._live_tokens()
            return not self._reform(live)
        except (RuntimeError, ValueError) as exc:   # the store went away: the normal path reports it
            log.debug("weights: live-set check failed: %s", exc)
            return False

    def _reform(self, live: list[int]) -> bool:
        """Does the group need re-forming: the live set changed, or it is not the path ``_form`` would take now
        (weights.shm / weights.doorbell switched, or shared memory has room again after a spell on the wire)."""
        g = self._group
        if g is None or set(live) != set(g.members):
            return True
        want = self._kind([t for t in g.members if t in self._members])
        if (g.kind == "bell") != (want == "bell"):
            return True
        return g.kind == "wire" and want != "wire"

    def _kind(self, tokens: list[int]) -> str:
        """The path for a group of these members, as things stand: "bell", "shm" or "wire"."""
        members = [self._members[t] for t in tokens]
        shm = (self._shm is not None and self.cfg.shm and time.monotonic() >= self._wire_until
               and all(m.shm for m in members))
        if not shm:
            return "wire"
        bell = (self._bell_ok and self.cfg.doorbell and all(m.bell for m in members)
                and len(members) <= weight_bell.MAX_MEMBERS and time.monotonic() >= self._bell_after)
        return "bell" if bell else "shm"

    def _settle(self) -> None:
        """A shared-memory slot is still pinned: let the group's receivers finish letting go of it first
        (``SendTransport.settle``); past that a slot still pinned is re-made as usual (``ShmPublisher.arena``)."""
        if self._group is not None:
            self._group.settle()

    def wait_export(self) -> Optional[BaseException]:
        """Block until the previous export is on disk (``latest`` points at it); returns its error, if any."""
        return self._exporter.wait()

    def close(self) -> None:
        if self._store is None:
            return
        self.wait_export()
        self._summer.shutdown()
        # Goodbye to every registered actor: each closes its store connections and looks for the next learner
        # (a --resume) after a pause, instead of a blocked queue_pop failing - loudly, with a C++ stack trace in
        # the actor's log - when this process exits. Best effort: a dead store needs no goodbye. Before dropping
        # the group: members of a doorbell epoch wake from the page straight into their mailbox, which must
        # hold it by then - and the store must outlive their reading it (at most BYE_DRAIN_S).
        boxes = [f"w/mbox/{tok}" for tok in self._members]
        with contextlib.suppress(RuntimeError, ValueError):
            for box in boxes:
                self._store.queue_push(box, json.dumps({"t": "bye"}))
        self._drop_group()
        end = time.monotonic() + BYE_DRAIN_S
        with contextlib.suppress(RuntimeError, ValueError):
            while boxes and time.monotonic() < end:
                boxes = [b for b in boxes if self._store.queue_len(b) > 0]
                time.sleep(0.005)
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        with contextlib.suppress(OSError):
            if json.loads(self._endpoint.read_text()).get("lineage") == self.lineage:
                self._endpoint.unlink()
        if self.guard is not None:
            self.guard.close()
        self._store = None

