"""Actor side of the weight broadcast (the publisher and the design: ``async_vla.weights``, docs/WEIGHTS.md).

A background thread registers with the learner's store, sleeps in its mailbox (a store queue), joins each
membership epoch's process group and receives every announced version; ``poll()`` hands the newest one to the
actor between chunks. Through shared memory the tensors are read-only views of the learner's pinned segment
(``async_vla.weights.shm``): the actor's own ``load_state_dict`` is the only copy. A new learner session (after a
crash and ``--resume``) is followed even when its versions restart lower.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from async_vla.weights import bell as weight_bell
from async_vla.weights.bell import BellDropped, BellMember, PostReplaced
from async_vla.weights.bell_versions import SharePlan, ViewPlan
from async_vla.weights.buckets import Layout
from async_vla.weights.pool import BufferPool, views_tracked
from async_vla.weights.export import read_latest
from async_vla.weights.shm import ShmUnreadable, probe_ok, valid_path
from async_vla.weights.shm_reader import ShmReader
from async_vla.weights.store_guard import is_loopback
from async_vla.weights.wire import WIRE_VERSION, BroadcastGroup, port_open, recv_version, td

log = logging.getLogger(__name__)

POP_TIMEOUT_S = 60.0      # a mailbox wait wakes this often with nothing to do (close() wakes it at once)
CONNECT_TIMEOUT_S = 5.0
DROP_CHECK_S = 1.0        # how long a check for "the publisher dropped this epoch" may wait for the store


class _Stop(Exception):   # close() was called: leave the session for good
    pass


class _Bye(Exception):    # the learner is closing its store: let go of it first, then look for the next learner
    pass


BYE_WAIT_S = 1.0          # after a learner's goodbye: long enough for its process to be gone before we look again


class WeightSubscriber:
    """Actor side: a background thread joins the learner's broadcasts; ``poll()`` hands over new weights."""

    def __init__(self, cfg, actor_id: int, run_dir: Union[str, Path], connect_host: Optional[str] = None,
                 port: Optional[int] = None, device: Optional[Union[str, torch.device]] = None):
        self.cfg = cfg.weights
        self.actor_id = int(actor_id)
        self.weights_dir = Path(run_dir) / "weights"
        self.host = connect_host or cfg.transport.connect_host
        self._port = port if port is not None else (cfg.transport.weights_port or None)
        self.timeout_s = float(cfg.weights.timeout_s)
        self.device = device
        self._lock = threading.Condition()
        self._hb_lock = threading.Lock()     # separate, so a slow store never blocks poll()
        self._latest: Optional[tuple[int, dict[str, torch.Tensor]]] = None
        self._delivered = -1
        self._publisher_session = ""   # the learner incarnation ("w/session") we last took weights from
        self._lineage = 0               # how many times we moved on to a new learner incarnation
        self._handed_lineage = 0
        self._export_session = ""       # session of the export fetch_latest handed out last ("": none/unknown)
        self._hb: Optional[tuple[Any, str, str]] = None     # (heartbeat store client, hb key, mailbox key)
        self._group: Optional[BroadcastGroup] = None
        self._bell: Optional[BellMember] = None     # this epoch's doorbell, when it runs on one
        self._layouts: dict[int, Layout] = {}       # bell epochs: layouts by digest (manifests come from the store)
        self._plans: dict[tuple, tuple[ViewPlan, Optional[SharePlan]]] = {}
        self._pool = BufferPool()
        self._shm_reader: Optional[ShmReader] = None
        self._shm_refused = False      # a segment of this learner session could not be read: use the wire
        self._stop = threading.Event()
        self.stats = {"received": 0, "failures": 0, "epochs": 0, "checksum_errors": 0, "connects": 0,
                      "last_version": -1, "last_recv_s": 0.0, "bytes": 0, "wire_mismatch": 0, "byes": 0}
        self._thread = threading.Thread(target=self._run, name=f"weights-sub-{actor_id}", daemon=True)
        self._beat = threading.Thread(target=self._heartbeat, name=f"weights-hb-{actor_id}", daemon=True)
        self._thread.start()
        self._beat.start()

    # ------------------------------------------------------------------ public
    def poll(self, timeout: float = 0.0) -> Optional[tuple[int, dict[str, torch.Tensor]]]:
        """The newest received (version, tensors) not handed out yet, or None. Non-blocking by default."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._latest is None and timeout > 0 and not self._stop.is_set():
                if not self._lock.wait(max(0.0, end - time.monotonic())) and time.monotonic() >= end:
                    break
            out, self._latest = self._latest, None
            if out is not None:
                self._delivered = max(self._delivered, out[0])
                self._handed_lineage = self._lineage   # (a session change clears _latest under this lock)
        reader = self._shm_reader
        if reader is not None:   # the version our caller loaded last time is let go of by now: unpin it
            reader.release_unused()
        return out

    def fetch_latest(self, newer_than: int = -1) -> Optional[tuple[int, dict[str, torch.Tensor]]]:
        """Load the newest exported weights from ``<run>/weights`` (actor start, or after missing broadcasts);
        None if there are none newer than ``newer_than`` (checked before any tensor is read). Once connected,
        only exports of the learner session we follow count (a dead learner's ``latest`` can outlive it), and a
        ``newer_than`` from an older session (``lineage``) is ignored: version numbers restart on a resume."""
        with self._lock:
            live, lineage = self._publisher_session, self._lineage
            if live and self._handed_lineage < lineage:
                newer_than = -1
        meta: dict = {}
        got = read_latest(self.weights_dir, newer_than=newer_than, session=live, meta_out=meta)
        if got is None:
            return None
        version, tensors, _ = got
        with self._lock:
            if self._lineage != lineage:     # we moved on to another learner session while reading
                return None
            self._delivered = max(self._delivered, version)
            if self._latest is not None and self._latest[0] <= version:
                self._latest = None
            self._handed_lineage, self._export_session = lineage, meta.get("session", "")
        return version, tensors

    @property
    def version(self) -> int:
        """Newest version handed out by poll() / fetch_latest() (-1 = none yet)."""
        return self._delivered

    @property
    def lineage(self) -> int:
        """Which learner session the version ``poll()`` last returned belongs to: 0 for the first one this
        subscriber followed, +1 at every move to a new one (a resumed learner, whose versions restart lower). A
        policy that refuses old versions (the vLLM backend's ``VersionGuard``) takes a lower version of a
        newer lineage."""
        return self._handed_lineage

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        bell = self._bell
        if bell is not None:     # our thread may sleep on the bell's futexes: wake it
            bell.wake()
        with self._hb_lock:
            hb, self._hb = self._hb, None
        if hb is not None:   # wake our own blocking mailbox pop and tell the publisher we left
            with contextlib.suppress(Exception):
                self._leave(hb[0], int(hb[1].rsplit("/", 1)[1]))
                hb[0].queue_push(hb[2], json.dumps({"t": "stop"}))
        self._thread.join(timeout)
        self._beat.join(timeout)

    # ------------------------------------------------------------------ thread
    def _heartbeat(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            with self._hb_lock:
                hb = self._hb
                if hb is not None:
                    with contextlib.suppress(Exception):
                        hb[0].add(hb[1], 1)

    def _resolve_port(self) -> Optional[int]:
        if self._port:
            return self._port
        try:
            return int(json.loads((self.weights_dir / "endpoint.json").read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _run(self) -> None:
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.set_device(torch.device(self.device))   # the CUDA device is per thread
        backoff = 0.2
        while not self._stop.is_set():
            connects = self.stats["connects"]
            bye = False
            try:
                self._session()
            except _Stop:
                break
            except _Bye:
                bye = True
                self.stats["byes"] += 1
            except Exception as exc:  # noqa: BLE001 - the publisher went away, or a bad message: reconnect
                if not self._stop.is_set():
                    log.info("weights: actor %d reconnecting (%s)", self.actor_id, str(exc).splitlines()[0][:160]
                             if str(exc) else type(exc).__name__)
            finally:
                self._leave_group()
                with self._hb_lock:
                    self._hb = None
            backoff = 0.2 if self.stats["connects"] > connects else min(backoff * 2, 5.0)
            if self._stop.wait(BYE_WAIT_S if bye else backoff):
                break

    def _leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    def _session(self) -> None:
        """One learner: connect, register, then serve the mailbox (invites, rosters, versions) until it ends."""
        port = self._resolve_port()
        if port is None or not port_open(self.host, port):
            return
        store = TCPStore(self.host, port, None, False, td(CONNECT_TIMEOUT_S), wait_for_workers=False)
        hb_store = TCPStore(self.host, port, None, False, td(CONNECT_TIMEOUT_S), wait_for_workers=False)
        session = store.get("w/session").decode()
        if not self._wire_matches(store, port):
            return
        if session != self._publisher_session:
            self._follow_session(session)
        # Pinning needs to see when a handed-out view is gone (views_tracked): without it, read over the wire.
        probe = store.get("w/shm").decode() if store.check(["w/shm"]) else ""
        shm = (self.cfg.shm and not self._shm_refused and views_tracked()
               and probe_ok(probe, session, self.cfg.shm_dir))
        token = self._register(store, hb_store, shm)
        if token is None:
            return
        self._serve_mailbox(store, token, probe)

    def _wire_matches(self, store, port: int) -> bool:
        """The learner speaks our weight wire version. A learner from another release: its stream would fail
        mid-version (or worse, parse). Stay out, say so once, and keep asking (it may be restarted with a matching
        release)."""
        wire = store.get("w/wire").decode() if store.check(["w/wire"]) else "1"
        if wire == str(WIRE_VERSION):
            return True
        self.stats["wire_mismatch"] += 1
        if self.stats["wire_mismatch"] == 1:
            log.error("weights: the learner at %s:%d speaks weight wire v%s, actor %d speaks v%d: not joining "
                      "its broadcasts (run the same async_vla release on both sides; until then this actor "
                      "only loads exports from %s)", self.host, port, wire, self.actor_id, WIRE_VERSION,
                      self.weights_dir)
        return False

    def _follow_session(self, session: str) -> None:
        """A new learner incarnation. After a resume from an older checkpoint its versions restart below the ones
        the dead learner sent: accept them (its lineage is the one being trained), and drop anything of the old
        lineage not yet handed out."""
        with self._lock:
            # (also at the first connection, when what we handed out is a dead learner's export)
            moved = bool(self._publisher_session) or (self._delivered >= 0 and bool(self._export_session)
                                                      and self._export_session != session)
            if moved:
                log.info("weights: actor %d follows a new learner session (last version %d)", self.actor_id,
                         self._delivered)
                self._delivered, self._latest = -1, None
                self._lineage += 1
            self._publisher_session = session
            self._shm_refused, self._shm_reader = False, None

    def _register(self, store, hb_store, shm: bool) -> Optional[int]:
        """A new token with this actor's member info, and the heartbeat on it; None when closing."""
        token = store.add("w/tokens", 1)
        store.add(f"w/hb/{token}", 1)      # before the member info: the publisher reads every member's at once
        store.set(f"w/member/{token}", json.dumps({"actor_id": self.actor_id, "pid": os.getpid(),
                                                   "host": socket.gethostname(), "shm": bool(shm),
                                                   "bell": bool(shm and weight_bell.available())}))
        with self._hb_lock:
            if self._stop.is_set():
                return None
            self._hb = (hb_store, f"w/hb/{token}", f"w/mbox/{token}")
        self.stats["connects"] += 1
        return token

    def _serve_mailbox(self, store, token: int, probe: str) -> None:
        """Wait in the mailbox: an invite is acknowledged, its roster joins the epoch (a doorbell epoch is served
        until it is dropped), a broadcast announcement of the current gloo / NCCL epoch is received."""
        mbox = f"w/mbox/{token}"
        store.set_timeout(td(POP_TIMEOUT_S))
        pending = -1
        while True:
            try:
                raw = store.queue_pop(mbox, True)
            except dist.DistNetworkError:
                raise
            except dist.DistStoreError:   # idle timeout
                if self._stop.is_set():
                    raise _Stop()
                continue
            if self._stop.is_set():
                raise _Stop()
            msg = json.loads(raw)
            log.debug("weights: actor %d mailbox %s", self.actor_id, msg)
            kind, epoch = msg.get("t"), int(msg.get("e", -1))
            if kind == "stop":
                raise _Stop()
            if kind == "bye":   # closing our connections before its store goes avoids c10d's loud recv error
                raise _Bye()
            if kind == "invite":
                self._leave_group()
                pending = epoch
                store.set(f"w/e{epoch}/ack/{token}", "1")
            elif kind == "roster" and epoch == pending and msg.get("bell"):
                pending = -1
                self._bell_epoch(store, msg, epoch, probe, token)
            elif kind == "roster" and epoch == pending:
                pending = -1
                self._join_group(store, msg, epoch)
            elif kind == "bcast" and self._group is not None and epoch == self._group.epoch:
                self._take_broadcast(store, token, epoch)

    def _join_group(self, store, msg: dict, epoch: int) -> None:
        """Join a gloo / NCCL epoch (through the learner's shared-memory segment when the roster names one)."""
        try:
            self._group = BroadcastGroup(msg["backend"], PrefixStore(f"w/e{epoch}/pg", store),
                                         int(msg["rank"]), int(msg["world"]), self.timeout_s, epoch,
                                         bind="127.0.0.1" if is_loopback(self.host) else None)
            self._group.dropped = lambda e=epoch: self._dropped(store, e)
            # Split verification ends with this count instead of an acknowledgement (wire).
            self._group.released = lambda e=epoch: store.add(f"w/e{e}/released", 1)
            prefix = str(msg.get("shm") or "")
            if prefix and valid_path(prefix, self.cfg.shm_dir):
                if self._shm_reader is None or self._shm_reader.prefix != prefix:
                    self._shm_reader = ShmReader(prefix)    # kept across epochs: mapped once
                self._group.shm_reader = self._shm_reader
            self.stats["epochs"] += 1
        except Exception as exc:  # noqa: BLE001 - e.g. nccl without CUDA here: stay on the file path
            self.stats["failures"] += 1
            log.warning("weights: actor %d could not join epoch %d: %s", self.actor_id, epoch, exc)

    def _take_broadcast(self, store, token: int, epoch: int) -> None:
        """Receive one announced version of the current gloo / NCCL epoch; a failure leaves the epoch."""
        try:
            self._receive(self._group)
        except ShmUnreadable as exc:
            # Registered as able to read the learner's segments, but cannot: register again without
            # (a new token re-forms the group on the wire) and do not claim it again for this learner.
            self.stats["failures"] += 1
            self._shm_refused, self._shm_reader = True, None
            self._leave(store, token)   # so a retry does not invite this token again
            log.warning("weights: actor %d cannot read the learner's shared memory (%s); re-registering "
                        "for the wire", self.actor_id, exc)
            raise
        except (RuntimeError, ValueError) as exc:
            self.stats["failures"] += 1
            log.info("weights: actor %d lost epoch %d: %s", self.actor_id, epoch,
                     str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__)
            self._leave_group()

    @staticmethod
    def _leave(store, token: int) -> None:
        """Tell the publisher this registration is over (it looks at the keys only when the count moved)."""
        store.set(f"w/leave/{token}", "1")
        store.add("w/leaves", 1)

    # ------------------------------------------------------------------ doorbell epochs (async_vla.weights.bell)
    def _bell_epoch(self, store, msg: dict, epoch: int, probe: str, token: int) -> None:
        """Join an epoch that runs on a bell and take its versions until it is dropped; then back to the mailbox."""
        path, prefix = str(msg.get("bell", "")), str(msg.get("shm") or "")
        try:
            if not (valid_path(path, self.cfg.shm_dir) and valid_path(prefix, self.cfg.shm_dir)):
                raise ValueError(f"roster names a bell or segments outside {self.cfg.shm_dir}")
            if self._shm_reader is None or self._shm_reader.prefix != prefix:
                self._shm_reader = ShmReader(prefix)    # kept across epochs: mapped once
            self._bell = BellMember(path, int(msg["rank"]), epoch, probe)
            self.stats["epochs"] += 1
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            self.stats["failures"] += 1
            log.warning("weights: actor %d could not join epoch %d: %s", self.actor_id, epoch, exc)
            self._leave_group()
            return
        member = self._bell
        try:
            while not member.dropped:
                if self._stop.is_set():
                    raise _Stop()
                p = member.next_post(weight_bell.MEMBER_SLICE_S)
                if p is None:
                    if not member.publisher_alive():
                        raise RuntimeError("the weight publisher is gone")
                    continue
                rec = member.record(p)
                if rec is None:       # aborted, or already replaced by the next post: take that one
                    continue
                try:
                    self._bell_receive(store, member, p, rec)
                except PostReplaced:
                    continue
        except ShmUnreadable as exc:
            self.stats["failures"] += 1
            self._shm_refused, self._shm_reader = True, None
            self._leave(store, token)
            log.warning("weights: actor %d cannot read the learner's shared memory (%s); re-registering for the "
                        "wire", self.actor_id, exc)
            raise
        except BellDropped:
            pass
        except (TimeoutError, ValueError, RuntimeError) as exc:
            self.stats["failures"] += 1
            log.info("weights: actor %d lost epoch %d: %s", self.actor_id, epoch, str(exc).splitlines()[0][:160])
            if not member.publisher_alive():
                raise
        finally:
            self._leave_group()

    def _bell_receive(self, store, member: BellMember, p: int, rec: dict[str, int]) -> None:
        """One posted version: views and share sum while the publisher packs, pin once sealed, acknowledge, verdict."""
        t0 = time.monotonic()
        deadline, stop = t0 + self.timeout_s, self._stop.is_set
        acked = False
        try:
            layout = self._layout_of(store, rec["digest"])
            gen, version, offsets = rec["generation"], rec["version"], rec["offsets"]
            if len(offsets) != len(layout.buckets) or rec["stream_bytes"] != layout.total_bytes:
                raise ValueError("bell record does not match its manifest")
            nbytes = [b.nbytes for b in layout.buckets]
            reader = self._shm_reader
            try:
                reader.views(gen, offsets, nbytes)          # bounds checked (the views themselves are not needed)
                base = reader.mapped(gen)
            except ShmUnreadable:
                if member.post_moved(p):    # an aborted post's segment may be gone (re-made): not our failing
                    raise PostReplaced(f"post {p} was replaced while its segment was mapped") from None
                raise
            views, shares = self._bell_plans(layout, rec["split"], member.rank, offsets)
            tensors = views.views(base)                     # made while the publisher packs
            share = 0
            if shares is not None:
                share = shares.value(member.follow_sum(p, shares, base.data_ptr(), deadline, stop))
            member.wait_sealed(p, layout.total_bytes, deadline, stop)
            # Sealed: what is left is a pin, one acknowledgement and the verdict - a fresh deadline for them (a long
            # packing after an early post must not eat the time the rest is allowed).
            deadline = time.monotonic() + self.timeout_s
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
        self._hand_over(version, tensors, ok, t0, reader, layout.total_bytes)
        del tensors
        member.released(p)
        with self._lock:
            self._lock.notify_all()

    def _bell_plans(self, layout: Layout, split: int, rank: int, offsets: list[int]
                    ) -> tuple[ViewPlan, Optional[SharePlan]]:
        key = (layout.digest, split, rank, tuple(offsets))
        if key not in self._plans:       # the last two (segments alternate)
            self._plans = {key: (ViewPlan(layout, offsets), SharePlan(layout, split, rank, offsets) if split else None),
                           **dict(list(self._plans.items())[-1:])}
        return self._plans[key]

    def _layout_of(self, store, digest: int) -> Layout:
        if digest not in self._layouts:
            # The publisher puts a new layout's manifest in the store before posting it: a digest without one is
            # a bad record, not something to wait the mailbox's minute for.
            store.set_timeout(td(min(self.timeout_s, DROP_CHECK_S * 5)))
            try:
                raw = store.get(f"w/manifest/{digest}")
            finally:
                store.set_timeout(td(POP_TIMEOUT_S))
            layout = Layout.from_manifest_bytes(raw)
            if layout.digest != digest:
                raise ValueError("the manifest in the store does not match the bell's digest")
            self._layouts = {digest: layout, **dict(list(self._layouts.items())[-1:])}
        return self._layouts[digest]

    def _hand_over(self, version: int, tensors: dict, ok: bool, t0: float, reader: Optional[ShmReader],
                   nbytes: Optional[int] = None) -> None:
        """A received version: count it and make it the one ``poll()`` hands out (or count a checksum mismatch),
        then unpin what nobody holds any more, so the publisher may rewrite it."""
        if not ok:
            self.stats["checksum_errors"] += 1
            log.warning("weights: actor %d checksum mismatch on v%d", self.actor_id, version)
        else:
            self.stats.update(received=self.stats["received"] + 1, last_version=version,
                              last_recv_s=time.monotonic() - t0,
                              bytes=self.stats["bytes"] + (sum(t.nbytes for t in tensors.values())
                                                           if nbytes is None else nbytes))
            with self._lock:
                if version > self._delivered:
                    self._latest = (version, tensors)   # drops an older one nobody took
        if reader is not None:
            reader.release_unused()

    @staticmethod
    def _dropped(store, epoch: int) -> bool:
        """Has the publisher given up on ``epoch``? Asked between wait slices, with a short store timeout: a
        stalled learner must not hold this thread longer than the op it waits on (a lost connection raises)."""
        store.set_timeout(td(DROP_CHECK_S))
        try:
            return store.check([f"w/e{epoch}/drop"])
        except dist.DistStoreError:      # no answer in time: keep waiting on the op (it has its own timeout)
            return False
        finally:
            store.set_timeout(td(POP_TIMEOUT_S))

    def _receive(self, g: BroadcastGroup) -> None:
        t0 = time.monotonic()

        def hand_over(h: dict, tensors: dict, ok: bool) -> None:   # runs before the acknowledgement
            self._hand_over(h["version"], tensors, ok, t0, g.shm_reader)

        recv_version(g, self.timeout_s, self._pool, self.cfg.verify, hand_over)
        log.debug("weights: actor %d received in %.3f s", self.actor_id, time.monotonic() - t0)
        with self._lock:   # wake a waiting poll() only now: its copy would hold up our acknowledgement (GIL)
            self._lock.notify_all()
