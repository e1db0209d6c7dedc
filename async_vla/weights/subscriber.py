"""Actor side of the weight broadcast (design: docs/WEIGHTS.md). A background thread registers with the learner's
store, sleeps in its mailbox, joins each membership epoch and receives every version; ``poll()`` hands the newest
one, with its ``PolicyTag``, to the actor between chunks. A new learner (a ``--resume``) is followed whatever its
versions; what the old one sent but nobody took is dropped."""

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
from torch._C._distributed_c10d import TCPStore

from async_vla.weights.export import read_latest
from async_vla.weights.pool import BufferPool
from async_vla.weights.transport import POP_TIMEOUT_S, Stopped, WireReceiver
from async_vla.hosts import is_loopback
from async_vla.messages import PolicyTag
from async_vla.weights.wire import WIRE_VERSION, port_open, td

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
FETCH_TRIES = 3          # reads of the newest export while the learner followed keeps changing under us


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
        # gloo's pair sockets: loopback when the learner is (docs/RELIABILITY.md "Security").
        self.gloo_bind = "127.0.0.1" if is_loopback(self.host) else None
        self._port = port if port is not None else (cfg.transport.weights_port or None)
        self.timeout_s = float(cfg.weights.timeout_s)
        self.device = device
        self._lock = threading.Condition()
        self._hb_lock = threading.Lock()     # separate, so a slow store never blocks poll()
        self._latest: Optional[tuple[PolicyTag, dict[str, torch.Tensor]]] = None
        self._delivered = -1            # newest version of the followed lineage handed out
        self._live: Optional[str] = None   # the lineage of the learner we follow (None: none reached yet)
        self._hb: Optional[tuple[Any, str, str]] = None     # (heartbeat store client, hb key, mailbox key)
        self._epoch: Optional[WireReceiver] = None   # this epoch's group
        self.pool = BufferPool()          # buckets of versions received over the wire
        self._stop = threading.Event()
        self.stats = {"received": 0, "failures": 0, "epochs": 0, "checksum_errors": 0, "connects": 0,
                      "last_version": -1, "last_recv_s": 0.0, "bytes": 0, "wire_mismatch": 0, "byes": 0}
        self._thread = threading.Thread(target=self._run, name=f"weights-sub-{actor_id}", daemon=True)
        self._beat = threading.Thread(target=self._heartbeat, name=f"weights-hb-{actor_id}", daemon=True)
        self._thread.start()
        self._beat.start()

    # ------------------------------------------------------------------ public
    def poll(self, timeout: float = 0.0) -> Optional[tuple[PolicyTag, dict[str, torch.Tensor]]]:
        """The newest received (tag, tensors) not handed out yet, or None. Non-blocking by default."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._latest is None and timeout > 0 and not self._stop.is_set():
                if not self._lock.wait(max(0.0, end - time.monotonic())) and time.monotonic() >= end:
                    break
            out, self._latest = self._latest, None
            if out is not None:
                self._delivered = max(self._delivered, out[0].version)
        return out

    def fetch_latest(self, newer_than: Optional[PolicyTag] = None
                     ) -> Optional[tuple[PolicyTag, dict[str, torch.Tensor]]]:
        """The newest export in ``<run>/weights`` as (tag, tensors), or None if there is none or it is not newer than
        ``newer_than`` (decided before any tensor is read). Once a learner was reached, only its lineage's exports count;
        reaching one while reading (an actor's start) reads again when the export was another learner's."""
        for _ in range(FETCH_TRIES):
            with self._lock:
                live = self._live
            got = read_latest(self.weights_dir, newer_than=newer_than, lineage=live)
            if got is None:
                return None
            tag, tensors, _ = got
            with self._lock:
                if self._live is not None and tag.lineage != self._live:   # we moved on to another learner
                    continue
                self._delivered = max(self._delivered, tag.version)
                if self._latest is not None and self._latest[0].version <= tag.version:
                    self._latest = None
            return tag, tensors
        return None

    @property
    def version(self) -> int:
        """Newest version of the learner followed handed out by poll() / fetch_latest() (-1 = none yet)."""
        return self._delivered

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
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
            except Stopped:
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
        if self._epoch is not None:
            self._epoch.close()
            self._epoch = None

    def _session(self) -> None:
        """One learner: connect, register, then serve the mailbox (invites, rosters, versions) until it ends."""
        port = self._resolve_port()
        if port is None or not port_open(self.host, port):
            return
        store = TCPStore(self.host, port, None, False, td(CONNECT_TIMEOUT_S), wait_for_workers=False)
        hb_store = TCPStore(self.host, port, None, False, td(CONNECT_TIMEOUT_S), wait_for_workers=False)
        lineage = store.get("w/lineage").decode()
        if not self._wire_matches(store, port):
            return
        if lineage != self._live:
            self._follow(lineage)
        token = self._register(store, hb_store)
        if token is None:
            return
        self._serve_mailbox(store, token)

    def _wire_matches(self, store, port: int) -> bool:
        """Whether the learner speaks our wire version. Another release's stream would fail mid-version: stay out, say
        so once, and keep asking (it may be restarted with a matching release)."""
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

    def _follow(self, lineage: str) -> None:
        """A new learner (the first, or one restarted): its versions are tagged with its lineage from now on, and
        whatever the previous one sent that was not handed out yet is dropped."""
        with self._lock:
            if self._live is not None:
                log.info("weights: actor %d follows a new learner %s (last version %d)", self.actor_id,
                         lineage[:12], self._delivered)
            self._delivered, self._latest, self._live = -1, None, lineage

    def _register(self, store, hb_store) -> Optional[int]:
        """A new token with this actor's member info, and the heartbeat on it; None when closing."""
        token = store.add("w/tokens", 1)
        store.add(f"w/hb/{token}", 1)      # before the member info: the publisher reads every member's at once
        store.set(f"w/member/{token}", json.dumps({"actor_id": self.actor_id, "pid": os.getpid(),
                                                   "host": socket.gethostname()}))
        with self._hb_lock:
            if self._stop.is_set():
                return None
            self._hb = (hb_store, f"w/hb/{token}", f"w/mbox/{token}")
        self.stats["connects"] += 1
        return token

    def _serve_mailbox(self, store, token: int) -> None:
        """Wait in the mailbox: an invite is acknowledged, its roster joins the epoch, a broadcast announcement of the
        current epoch is received."""
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
                    raise Stopped()
                continue
            if self._stop.is_set():
                raise Stopped()
            msg = json.loads(raw)
            log.debug("weights: actor %d mailbox %s", self.actor_id, msg)
            kind, epoch = msg.get("t"), int(msg.get("e", -1))
            if kind == "stop":
                raise Stopped()
            if kind == "bye":   # closing our connections before its store goes avoids c10d's loud recv error
                raise _Bye()
            if kind == "invite":
                self._leave_group()
                pending = epoch
                store.set(f"w/e{epoch}/ack/{token}", "1")
            elif kind == "roster" and epoch == pending:
                pending = -1
                self._epoch = self._join(store, msg, epoch)
            elif kind == "bcast" and self._epoch is not None and epoch == self._epoch.epoch:
                if not self._epoch.take():
                    self._leave_group()

    def _join(self, store, msg: dict, epoch: int) -> Optional[WireReceiver]:
        """This member's end of the epoch's group; None (counted) when it cannot join (e.g. nccl without CUDA
        here: it stays on the file path)."""
        try:
            joined = WireReceiver(self, store, msg, epoch)
        except Exception as exc:  # noqa: BLE001
            self.stats["failures"] += 1
            log.warning("weights: actor %d could not join epoch %d: %s", self.actor_id, epoch, exc)
            return None
        self.stats["epochs"] += 1
        return joined

    @staticmethod
    def _leave(store, token: int) -> None:
        """Tell the publisher this registration is over (it looks at the keys only when the count moved)."""
        store.set(f"w/leave/{token}", "1")
        store.add("w/leaves", 1)

    # ------------------------------------------------------------------ for WireReceiver
    def notify(self) -> None:
        """A version was handed over: wake a waiting ``poll()``."""
        with self._lock:
            self._lock.notify_all()

    def hand_over(self, version: int, tensors: dict, ok: bool, t0: float) -> None:
        """A received version: count it and make it the one ``poll()`` hands out (or count a checksum mismatch)."""
        if not ok:
            self.stats["checksum_errors"] += 1
            log.warning("weights: actor %d checksum mismatch on v%d", self.actor_id, version)
            return
        self.stats.update(received=self.stats["received"] + 1, last_version=version,
                          last_recv_s=time.monotonic() - t0,
                          bytes=self.stats["bytes"] + sum(t.nbytes for t in tensors.values()))
        with self._lock:
            if version > self._delivered:
                self._latest = (PolicyTag(self._live, version), tensors)   # drops an older one nobody took
