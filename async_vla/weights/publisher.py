"""Weight broadcast from learner rank 0 to actor processes; the design (why a separate process group, epochs,
failures): docs/WEIGHTS.md.

Rank 0 hosts a ``TCPStore``; actors register and heartbeat there. At ``publish()`` the publisher packs, re-forms
the group (invite -> ack within ``join_timeout_s`` -> roster) when the live set changed or the group broke,
delivers over the epoch's group (``transport``) and exports. A failed delivery drops the group and retries once with
a new epoch; an actor that misses an invite is suspended with back-off and catches up from the export."""

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

from async_vla.weights import native
from async_vla.weights.buckets import Layout
from async_vla.weights.export import Exporter
from async_vla.weights.members import MemberRegistry
from async_vla.weights.packer import BucketPacker
from async_vla.weights.pool import BufferPool
from async_vla.hosts import is_loopback
from async_vla.weights.store_guard import StoreGuard
from async_vla.weights.transport import Packed, WireTransport
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
        self._bind = gloo_bind(cfg.transport.host)   # loopback in a one-host run (docs/RELIABILITY.md "Security")
        self._endpoint = self.weights_dir / "endpoint.json"
        tmp = self.weights_dir / f".endpoint.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"host": cfg.transport.connect_host, "port": self.port,
                                   "lineage": self.lineage, "pid": os.getpid()}))
        os.replace(tmp, self._endpoint)
        self._registry = MemberRegistry()
        self._members = self._registry.members      # token -> Member
        self._epoch = 0
        self._group: Optional[WireTransport] = None    # this epoch's group
        # Milestones (every run.eval_every versions) are kept only where an evaluator made weights/milestones/.
        self._exporter = Exporter(self.weights_dir, self.cfg.export_keep, self.lineage,
                                  milestone_every=cfg.run.eval_every)
        self._layout: Optional[Layout] = None     # the last version's (reused while the tensors stay the same)
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------ membership
    def _live_tokens(self) -> list[int]:
        return self._registry.live(self._store, 5 * self.cfg.heartbeat_s, 10 * self.cfg.heartbeat_s + 1.0)

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
        self._group = t = WireTransport(self._store, self.cfg, self.backend, self._bind, e, tuple(acked))
        for rank, tok in enumerate(acked, 1):
            s.queue_push(f"w/mbox/{tok}", json.dumps({"t": "roster", "e": e, "rank": rank, "world": len(acked) + 1,
                                                      **t.roster()}))
        t.join(deadline)

    # ------------------------------------------------------------------ publishing
    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Pack, broadcast to the live actors, export. Never blocks longer than ~timeout_s on actors. Returns stats
        (docs/WEIGHTS.md lists them)."""
        t0 = time.monotonic()
        p = self._pack(named_tensors)
        stats = self._deliver(version, p, deadline=p.packed_at + self.timeout_s)
        stats.update(epoch=self._epoch, pack_s=p.packed_at - t0, sync_s=time.monotonic() - t0, export_path="",
                     export_error="")
        self.last = stats
        if self.cfg.export:
            stats["export_path"] = str(self.weights_dir / f"v{version}.safetensors")
            error = self._exporter.start(version, p.layout, p.buckets, p.csum, not self.cfg.export_async)
            if error is not None:
                stats["export_error"] = f"v{version - 1}: {error}"   # the previous export; surfaced once
        return stats

    def _pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Packed:
        # The checksum only when someone checks it (receivers, learner ranks); an export computes its own.
        summing = self.cfg.verify or self.cfg.verify_ranks
        packer = BucketPacker(int(self.cfg.bucket_mb * 2**20), self.device, self._pool, self._summer,
                              sums=summing, previous=self._layout)
        for name, t in named_tensors:
            packer.add(name, t)
        layout, buckets = packer.finish()
        self._layout = layout
        self._pool.trim(3 * layout.wire_bytes + 2 * packer.cap)   # one version exporting, one packing
        return Packed(layout, buckets, packer.checksum() if summing else None, time.monotonic())

    def _deliver(self, version: int, p: Packed, deadline: float) -> dict[str, Any]:
        """Send the packed version to the group - formed or re-formed first when the live set changed; one retry
        with a new epoch after a failure. Returns the stats ``publish`` reports."""
        stats: dict[str, Any] = {"version": version, "bytes": p.layout.total_bytes, "num_buckets": len(p.buckets),
                                 "checksum": p.csum, "receivers": 0, "confirmed": 0, "transport": "",
                                 "epoch": self._epoch, "formed": False, "failures": 0, "error": ""}
        for _ in range(2):
            if deadline - time.monotonic() < 0.05:
                break
            try:
                live = self._live_tokens()
                if self._group is None or set(live) != set(self._group.members):
                    self._form(live, deadline)
                    stats["formed"] = True
                g = self._group
                if g is None:
                    break
                stats["confirmed"], stats["transport"] = g.deliver(version, p, deadline), self.backend
                stats["receivers"], stats["error"] = len(g.members), ""
                break
            except (RuntimeError, TimeoutError, ValueError) as exc:   # DistError is a RuntimeError
                stats["failures"] += 1
                stats["error"] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.warning("weights: broadcast of v%d failed in epoch %d (%s); re-forming",
                            version, self._epoch, stats["error"])
                self._drop_group()
        return stats

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
        # the actor's log - when this process exits. Best effort: a dead store needs no goodbye. The store must
        # outlive their reading it (at most BYE_DRAIN_S).
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
        with contextlib.suppress(OSError):
            if json.loads(self._endpoint.read_text()).get("lineage") == self.lineage:
                self._endpoint.unlink()
        if self.guard is not None:
            self.guard.close()
        self._store = None

