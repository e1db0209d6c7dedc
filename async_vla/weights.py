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
actor sleeps in a queue pop, never in a collective. One version on the wire: ``async_vla.weight_wire``; on
one host the bulk bytes go through shared memory: ``async_vla.weight_shm``.

Failure: every collective on the publisher has a per-op timeout of what is left of ``timeout_s``. A killed
actor makes the next op raise at once; a stopped one makes it time out. The publisher then *deletes* its
group (which closes the sockets, so survivors blocked in a receive fail at once - gloo's ``abort()`` does
not) and retries once with a new epoch if time is left. A late or restarted actor loads
``<run>/weights/latest`` (``fetch_latest``) and joins at the next publish. NCCL groups are built with
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up only) and aborted before they are dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from async_vla.weight_buckets import BucketPacker, BufferPool, Exporter, Layout, checksum, read_latest, unpack
from async_vla.weight_shm import ShmPublisher, ShmReader, ShmUnreadable, probe_ok, valid_path
from async_vla.weight_wire import BroadcastGroup, port_open, recv_version, resolve_backend, send_version, td

log = logging.getLogger(__name__)

POP_TIMEOUT_S = 60.0      # a mailbox wait wakes this often with nothing to do (close() wakes it at once)
CONNECT_TIMEOUT_S = 5.0


@dataclass
class _Member:
    actor_id: int
    hb: int = -1
    seen: float = field(default_factory=time.monotonic)
    fails: int = 0
    suspended_until: float = 0.0
    shm: bool = False          # can read our shared-memory segments (same host, same /dev/shm, same user)


class WeightPublisher:
    """Learner rank 0: hosts the store, forms groups of live actors, broadcasts and exports weights."""

    def __init__(self, cfg, run_dir: Union[str, Path], world_timeout_s: Optional[float] = None):
        self.cfg = cfg.weights
        self.timeout_s = float(world_timeout_s or cfg.weights.timeout_s)
        self.backend = resolve_backend(cfg.weights.backend)
        on_gpu = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.weights_dir = Path(run_dir) / "weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        # Bind ourselves so the store listens on cfg.transport.host only (TCPStore alone binds every
        # interface) and port 0 gives a free port; the store takes ownership of the fd.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.transport.host, cfg.transport.weights_port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._store = TCPStore(cfg.transport.host, self.port, None, True, td(self.timeout_s),
                               wait_for_workers=False, master_listen_fd=sock.detach())
        self.session = uuid.uuid4().hex
        self._store.set("w/session", self.session)
        self._pool = BufferPool()
        self._shm: Optional[ShmPublisher] = None
        if self.cfg.shm and self.backend == "gloo":
            try:
                self._shm = ShmPublisher(self.cfg.shm_dir, self.session, self._pool)
            except OSError as exc:
                log.warning("weights: no shared-memory path in %s (%s); broadcasting over gloo only",
                            self.cfg.shm_dir, exc)
        self._store.set("w/shm", self._shm.probe if self._shm is not None else "")
        self._endpoint = self.weights_dir / "endpoint.json"
        tmp = self.weights_dir / f".endpoint.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"host": cfg.transport.connect_host, "port": self.port,
                                   "session": self.session, "pid": os.getpid()}))
        os.replace(tmp, self._endpoint)
        self._members: dict[int, _Member] = {}
        self._missing: dict[int, float] = {}
        self._known = 0
        self._epoch = 0
        self._group: Optional[BroadcastGroup] = None
        self._exporter = Exporter(self.weights_dir, self.cfg.export_keep)
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------ membership
    def _live_tokens(self) -> list[int]:
        s, now = self._store, time.monotonic()
        stale = 5 * self.cfg.heartbeat_s
        while self._known < s.add("w/tokens", 0):
            tok = self._known + 1
            if not s.check([f"w/member/{tok}"]):
                # Registered a moment ago, info not written yet: look again next time - unless it has been
                # missing for long (the actor died in between), which must not block later tokens.
                first = self._missing.setdefault(tok, now)
                if now - first < 10 * self.cfg.heartbeat_s + 1.0:
                    break
                self._known = tok
                continue
            info = json.loads(s.get(f"w/member/{tok}"))
            self._members[tok] = _Member(int(info.get("actor_id", -tok)), shm=bool(info.get("shm")))
            self._known = tok
        newest: dict[int, int] = {}
        for tok, m in list(self._members.items()):
            if s.check([f"w/leave/{tok}"]):
                del self._members[tok]
                continue
            hb = s.add(f"w/hb/{tok}", 0)
            if hb != m.hb:
                m.hb, m.seen = hb, now
            newest[m.actor_id] = max(tok, newest.get(m.actor_id, 0))
        # A newer registration of the same actor id (restart, reconnect) retires the older token for good;
        # a silent token is kept (cheap) because a stopped actor that resumes heartbeats on it again.
        for tok in [t for t, m in self._members.items() if newest[m.actor_id] != t]:
            del self._members[tok]
        return sorted(t for t, m in self._members.items() if now - m.seen <= stale and now >= m.suspended_until)

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
        world = len(acked) + 1
        use_shm = self._shm is not None and all(self._members[tok].shm for tok in acked)
        for rank, tok in enumerate(acked, 1):
            s.queue_push(f"w/mbox/{tok}", json.dumps({"t": "roster", "e": e, "rank": rank, "world": world,
                                                      "backend": self.backend,
                                                      "shm": self._shm.prefix if use_shm else ""}))
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left to form the group")
        self._group = BroadcastGroup(self.backend, PrefixStore(f"w/e{e}/pg", s), 0, world, left, e, tuple(acked))
        self._group.use_shm = use_shm

    # ------------------------------------------------------------------ publishing
    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
                zero_copy: bool = False) -> dict[str, Any]:
        """Pack, broadcast to the live actors, export. Never blocks longer than ~timeout_s on actors.

        Returns stats: version, sync_s (pack + broadcast), pack_s, bytes, num_buckets, receivers (in the
        group), confirmed (receivers whose checksum matched), transport (shm, gloo or nccl), epoch, formed,
        failures, error, checksum, export_path. ``zero_copy`` lets tensors above the bucket cap be sent
        without a copy over the wire (they must stay unchanged until this returns; export then runs
        synchronously); with shared memory on, everything is packed into the segment instead.
        """
        t0 = time.monotonic()
        shm = self._shm is not None and self.cfg.shm
        into = self._shm.arena() if shm else self._pool
        zero_copy = zero_copy and not shm       # with shared memory everything is packed into the segment
        packer = BucketPacker(int(self.cfg.bucket_mb * 2**20), self.device, zero_copy, into)
        for name, t in named_tensors:
            packer.add(name, t)
        layout, buckets = packer.finish()
        # One version exporting, one packing; none once both shared-memory segments take the packing.
        self._pool.trim(0 if shm and self._shm.in_place else 3 * layout.wire_bytes + 2 * packer.cap)
        csum = checksum(unpack(layout, buckets))
        t_pack = time.monotonic()
        deadline = t_pack + self.timeout_s
        stats: dict[str, Any] = {"version": version, "bytes": layout.total_bytes, "num_buckets": len(buckets),
                                 "checksum": csum, "receivers": 0, "confirmed": 0, "transport": "",
                                 "epoch": self._epoch, "formed": False, "failures": 0, "error": ""}
        for _attempt in range(2):
            if deadline - time.monotonic() < 0.05:
                break
            try:
                live = self._live_tokens()
                if self._group is None or set(live) != set(self._group.members):
                    self._form(live, deadline)
                    stats["formed"] = True
                if self._group is None:
                    break
                stats["confirmed"], stats["transport"] = self._broadcast(self._group, version, layout, buckets,
                                                                         csum, deadline)
                stats["receivers"], stats["error"] = len(self._group.members), ""
                break
            except (RuntimeError, TimeoutError, ValueError) as exc:   # DistError is a RuntimeError
                stats["failures"] += 1
                stats["error"] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.warning("weights: broadcast of v%d failed in epoch %d (%s); re-forming",
                            version, self._epoch, stats["error"])
                self._drop_group()
        stats["epoch"] = self._epoch
        stats["pack_s"] = t_pack - t0
        stats["sync_s"] = time.monotonic() - t0
        stats["export_path"], stats["export_error"] = "", ""
        self.last = stats
        if self.cfg.export:
            stats["export_path"] = str(self.weights_dir / f"v{version}.safetensors")
            error = self._exporter.start(version, layout, buckets, csum, zero_copy or not self.cfg.export_async)
            if error is not None:
                stats["export_error"] = f"v{version - 1}: {error}"   # the previous export; surfaced once
        return stats

    def _broadcast(self, g: BroadcastGroup, version: int, layout: Layout, buckets: list[torch.Tensor], csum: float,
                   deadline: float) -> tuple[int, str]:
        def left() -> float:
            r = deadline - time.monotonic()
            if r <= 0:
                raise TimeoutError("weight broadcast ran out of time")
            return r

        shm = None
        if g.use_shm and self.cfg.shm and self._shm is not None:
            shm = self._shm.place(buckets, version)
            if shm is None:
                log.warning("weights: v%d over the wire: %s", version, self._shm.failed)
        for tok in g.members:
            self._store.queue_push(f"w/mbox/{tok}", json.dumps({"t": "bcast", "e": g.epoch, "v": version}))
        confirmed = send_version(g, version, layout, buckets, csum, left, self.cfg.overlap, shm)
        return confirmed, "shm" if shm else self.backend

    def wait_export(self) -> Optional[BaseException]:
        """Block until the previous export is on disk (``latest`` points at it); returns its error, if any."""
        return self._exporter.wait()

    def close(self) -> None:
        self.wait_export()
        self._drop_group()
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        with contextlib.suppress(OSError):
            if json.loads(self._endpoint.read_text()).get("session") == self.session:
                self._endpoint.unlink()
        self._store = None


class _Stop(Exception):   # close() was called: leave the session for good
    pass


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
        self._hb: Optional[tuple[Any, str, str]] = None     # (heartbeat store client, hb key, mailbox key)
        self._group: Optional[BroadcastGroup] = None
        self._pool = BufferPool()
        self._shm_reader: Optional[ShmReader] = None
        self._shm_refused = False      # a segment of this learner session could not be read: use the wire
        self._stop = threading.Event()
        self.stats = {"received": 0, "failures": 0, "epochs": 0, "checksum_errors": 0, "connects": 0,
                      "last_version": -1, "last_recv_s": 0.0, "bytes": 0}
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
            return out

    def fetch_latest(self, newer_than: int = -1) -> Optional[tuple[int, dict[str, torch.Tensor]]]:
        """Load the newest exported weights from ``<run>/weights`` (actor start, or after missing broadcasts);
        None if there are none newer than ``newer_than`` (checked before any tensor is read)."""
        got = read_latest(self.weights_dir, newer_than=newer_than)
        if got is None:
            return None
        version, tensors, _ = got
        with self._lock:
            self._delivered = max(self._delivered, version)
            if self._latest is not None and self._latest[0] <= version:
                self._latest = None
        return version, tensors

    @property
    def version(self) -> int:
        """Newest version handed out by poll() / fetch_latest() (-1 = none yet)."""
        return self._delivered

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        with self._hb_lock:
            hb, self._hb = self._hb, None
        if hb is not None:   # wake our own blocking mailbox pop and tell the publisher we left
            with contextlib.suppress(Exception):
                hb[0].set(hb[1].replace("/hb/", "/leave/"), "1")
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
            try:
                self._session()
            except _Stop:
                break
            except Exception as exc:  # noqa: BLE001 - the publisher went away, or a bad message: reconnect
                if not self._stop.is_set():
                    log.info("weights: actor %d reconnecting (%s)", self.actor_id, str(exc).splitlines()[0][:160]
                             if str(exc) else type(exc).__name__)
            finally:
                self._leave_group()
                with self._hb_lock:
                    self._hb = None
            backoff = 0.2 if self.stats["connects"] > connects else min(backoff * 2, 5.0)
            if self._stop.wait(backoff):
                break

    def _leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _session(self) -> None:
        port = self._resolve_port()
        if port is None or not port_open(self.host, port):
            return
        store = TCPStore(self.host, port, None, False, td(CONNECT_TIMEOUT_S), wait_for_workers=False)
        hb_store = TCPStore(self.host, port, None, False, td(CONNECT_TIMEOUT_S), wait_for_workers=False)
        session = store.get("w/session").decode()
        if session != self._publisher_session:
            # A new learner incarnation. After a resume from an older checkpoint its versions restart below the
            # ones the dead learner sent: accept them (its lineage is the one being trained), and drop anything
            # of the old lineage not yet handed out.
            with self._lock:
                if self._publisher_session:
                    log.info("weights: actor %d follows a new learner session (last version %d)", self.actor_id,
                             self._delivered)
                    self._delivered, self._latest = -1, None
                self._publisher_session = session
                self._shm_refused, self._shm_reader = False, None
        shm = (self.cfg.shm and not self._shm_refused and store.check(["w/shm"])
               and probe_ok(store.get("w/shm").decode(), session, self.cfg.shm_dir))
        token = store.add("w/tokens", 1)
        store.set(f"w/member/{token}", json.dumps({"actor_id": self.actor_id, "pid": os.getpid(),
                                                   "host": socket.gethostname(), "shm": bool(shm)}))
        mbox = f"w/mbox/{token}"
        with self._hb_lock:
            if self._stop.is_set():
                return
            self._hb = (hb_store, f"w/hb/{token}", mbox)
        self.stats["connects"] += 1
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
            kind, epoch = msg.get("t"), int(msg.get("e", -1))
            if kind == "stop":
                raise _Stop()
            if kind == "invite":
                self._leave_group()
                pending = epoch
                store.set(f"w/e{epoch}/ack/{token}", "1")
            elif kind == "roster" and epoch == pending:
                pending = -1
                try:
                    self._group = BroadcastGroup(msg["backend"], PrefixStore(f"w/e{epoch}/pg", store),
                                                 int(msg["rank"]), int(msg["world"]), self.timeout_s, epoch)
                    prefix = str(msg.get("shm") or "")
                    if prefix and valid_path(prefix, self.cfg.shm_dir):
                        if self._shm_reader is None or self._shm_reader.prefix != prefix:
                            self._shm_reader = ShmReader(prefix)    # kept across epochs: mapped once
                        self._group.shm_reader = self._shm_reader
                    self.stats["epochs"] += 1
                except Exception as exc:  # noqa: BLE001 - e.g. nccl without CUDA here: stay on the file path
                    self.stats["failures"] += 1
                    log.warning("weights: actor %d could not join epoch %d: %s", self.actor_id, epoch, exc)
            elif kind == "bcast" and self._group is not None and epoch == self._group.epoch:
                try:
                    self._receive(self._group)
                except ShmUnreadable as exc:
                    # Registered as able to read the learner's segments, but cannot: register again without
                    # (a new token re-forms the group on the wire) and do not claim it again for this learner.
                    self.stats["failures"] += 1
                    self._shm_refused, self._shm_reader = True, None
                    store.set(f"w/leave/{token}", "1")   # so a retry does not invite this token again
                    log.warning("weights: actor %d cannot read the learner's shared memory (%s); re-registering "
                                "for the wire", self.actor_id, exc)
                    raise
                except (RuntimeError, ValueError) as exc:
                    self.stats["failures"] += 1
                    log.info("weights: actor %d lost epoch %d: %s", self.actor_id, epoch,
                             str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__)
                    self._leave_group()

    def _receive(self, g: BroadcastGroup) -> None:
        t0 = time.monotonic()
        h, layout, tensors, ok = recv_version(g, self.timeout_s, self._pool, self.cfg.verify)
        if not ok:
            self.stats["checksum_errors"] += 1
            log.warning("weights: actor %d checksum mismatch on v%d", self.actor_id, h["version"])
            return
        self.stats.update(received=self.stats["received"] + 1, last_version=h["version"],
                          last_recv_s=time.monotonic() - t0, bytes=self.stats["bytes"] + layout.total_bytes)
        with self._lock:
            if h["version"] > self._delivered:
                self._latest = (h["version"], tensors)
                self._lock.notify_all()
