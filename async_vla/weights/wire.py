"""The process group of one epoch (gloo or NCCL, same code) and how one version crosses it: an int64 header, the
manifest when the layout changed, the buckets, then one (received, checksum ok) acknowledgement per receiver to
rank 0 (docs/WEIGHTS.md)."""

from __future__ import annotations

import contextlib
import logging
import datetime
import ipaddress
import os
import socket
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions

from async_vla.hosts import is_loopback
from async_vla.weights.buckets import MAX_MANIFEST_BYTES, BufferPool, Layout, checksum, empty_buckets, unpack

log = logging.getLogger(__name__)

MAGIC = 0x5745494748      # "WEIGH"
WIRE_VERSION = 5          # of this stream (the publisher's store "w/wire"; a subscriber of another one does not join)
HEADER_KEYS = ("magic", "version", "buckets", "manifest", "nbytes", "checksum", "digest", "seq")
DROP_POLL_S = 0.25        # a receiver blocked in a collective checks this often whether the publisher gave up
ACK_TAG = 7


def resolve_backend(cfg, cuda_available: Optional[bool] = None) -> str:
    """weights.backend -> "nccl" or "gloo". auto: nccl on GPU unless two members of the group would share a GPU of
    this host (async_vla.placement.shared_weight_gpu: NCCL refuses that), gloo otherwise."""
    from async_vla.placement import shared_weight_gpu

    name = cfg.weights.backend
    if name != "auto":
        return name
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        return "gloo"
    shared = shared_weight_gpu(cfg)
    if shared is not None:
        log.info("weights.backend=auto: broadcasting over gloo, not NCCL: %s", shared)
        return "gloo"
    return "nccl"


def port_open(host: str, port: int) -> bool:
    """Plain probe first: a TCPStore client aimed at a dead port retries for its whole timeout, loudly."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def gloo_bind(host: str) -> Optional[str]:
    """Where the publisher's gloo pair sockets listen, given ``transport.host``: 127.0.0.1 when it is loopback, the
    address itself when it is one, None (gloo's choice) for a wildcard or a name (docs/RELIABILITY.md "Security")."""
    if is_loopback(host):
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if ip.is_unspecified else str(ip)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, float(seconds)))


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


class BroadcastGroup:
    """One epoch's process group plus what both sides remember about it."""

    def __init__(self, backend: str, store, rank: int, world: int, timeout_s: float, epoch: int,
                 members: tuple[int, ...] = (), bind: Optional[str] = None):
        """``bind``: the address gloo's pair sockets listen on and advertise (``gloo_bind``); None = gloo's own
        choice (GLOO_SOCKET_IFNAME, else the address the host name resolves to)."""
        self.backend, self.epoch, self.members, self.rank = backend, epoch, members, rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.layout: Optional[Layout] = None      # manifest this group has already seen
        self.seq = 0
        self.dropped: Optional[Callable[[], bool]] = None   # receiver: has the publisher given up on this epoch?
        if backend == "gloo" and bind is not None:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = td(timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world, td(timeout_s))
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td(timeout_s)
            # Default error handling tears the whole process down on a timeout; we want an exception.
            with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):
                self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            raise ValueError(f"unknown weights backend {backend!r}")

    def _finish(self, work, timeout_s: float) -> None:
        if self.backend == "nccl":
            work.wait(td(timeout_s))
            torch.cuda.current_stream(self.device).synchronize()
        elif self.dropped is None:
            work.wait()
        else:   # wait in slices, giving up as soon as the publisher says it dropped this epoch
            end = time.monotonic() + timeout_s
            while True:
                try:
                    work.wait(td(max(0.001, min(DROP_POLL_S, end - time.monotonic()))))
                    return
                except RuntimeError:
                    if work.is_completed():   # it finished as our slice ran out: its own result decides
                        work.wait()
                        return
                    if time.monotonic() >= end:
                        raise
                    if self.dropped():
                        raise RuntimeError(f"the publisher dropped epoch {self.epoch}") from None

    def bcast(self, t: torch.Tensor, timeout_s: float) -> None:
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, td(timeout_s)
        self._finish(self.pg.broadcast([t], opts), timeout_s)

    def bcast_many(self, tensors: list[torch.Tensor], timeout_s: float, overlap: bool = True) -> None:
        """Issue every broadcast, then wait (gloo's worker threads overlap consecutive ops); with
        ``overlap=False`` wait for each before issuing the next (the naive loop, a benchmark baseline)."""
        works = []
        for t in tensors:
            if t.numel():
                opts = BroadcastOptions()
                opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, td(timeout_s)
                works.append(self.pg.broadcast([t.view(torch.uint8)], opts))
                if not overlap:
                    self._finish(works.pop(), timeout_s)
        for w in works:
            self._finish(w, timeout_s)

    # The acknowledgement is point-to-point with rank 0 (not an allreduce) so that a stopped actor can
    # only delay the publisher, never another actor.
    def send_ack(self, t: torch.Tensor, timeout_s: float) -> None:
        work = self.pg.send([t], 0, ACK_TAG)
        work.wait(td(timeout_s))

    def recv_acks(self, timeout_s_left) -> torch.Tensor:
        """Sum of the (received, checksum ok) pairs of every member; ``timeout_s_left()`` per wait."""
        if not self.members:
            return torch.zeros(2, dtype=torch.int64)
        # Post every receive before waiting on any: a gloo send waits for its matching receive, so with the
        # receives posted one after another a stopped rank 1 would hold rank 2's send (and rank 2 itself)
        # until this epoch is torn down.
        out = [torch.zeros(2, dtype=torch.int64, device=self.device) for _ in self.members]
        works = [self.pg.recv([t], rank, ACK_TAG) for rank, t in enumerate(out, start=1)]
        for w in works:
            w.wait(td(timeout_s_left()))
        return torch.stack([t.cpu() for t in out]).sum(0)

    def close(self) -> None:
        if self.backend == "nccl":
            with contextlib.suppress(Exception):
                self.pg.abort()
        pg, self.pg = self.pg, None
        if pg is not None and self.backend == "gloo":
            # Destroying a gloo group joins its worker threads, which first finish their in-flight ops - up to
            # the ops' timeout when a peer is gone or stalled. Let that happen on a thread of its own: once it
            # is destroyed its sockets close (peers blocked in a receive fail then, if no drop notice reached
            # them first), and we are free to join the next epoch now. Not a daemon: an interpreter exiting
            # under a destructor still running aborts ("terminate called without an active exception"), so
            # exit waits for it instead (bounded by the ops' timeout).
            box = [pg]
            del pg          # the box holds the only reference now, so the destructor runs where it is emptied
            threading.Thread(target=box.clear, name=f"weights-drop-e{self.epoch}").start()


def parse_header(t: torch.Tensor) -> dict[str, int]:
    return dict(zip(HEADER_KEYS, (int(x) for x in t.cpu().tolist())))


def send_version(g: BroadcastGroup, version: int, layout: Layout, buckets: Sequence[torch.Tensor],
                 csum: Optional[float], left: Callable[[], float], overlap: bool = True) -> int:
    """Rank 0: header int64[8], the manifest when this group has not seen it, the buckets, then the (received, checksum
    ok) acknowledgements; returns how many confirmed (``csum`` None: sent as -1, receipts count). ``left()``: time per
    wait."""
    manifest = layout.manifest_bytes() if g.layout is None or g.layout.digest != layout.digest else b""
    header = torch.tensor([MAGIC, version, len(buckets), len(manifest), layout.wire_bytes,
                           -1 if csum is None else int(csum), layout.digest, g.seq],
                          dtype=torch.int64, device=g.device)
    g.seq += 1
    g.bcast(header, left())
    if manifest:
        g.bcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(g.device), left())
        g.layout = layout
    g.bcast_many(list(buckets), left(), overlap)
    return int(g.recv_acks(left)[1])


def recv_version(g: BroadcastGroup, timeout_s: float, pool: Optional[BufferPool] = None, verify: bool = True,
                 before_ack: Optional[Callable[[dict[str, int], dict[str, torch.Tensor], bool], None]] = None
                 ) -> tuple[dict[str, int], Layout, dict[str, torch.Tensor], bool]:
    """Receiver side of ``send_version``: (header, layout, tensors by name, checksum ok), views into fresh or pooled
    buckets. ``before_ack(header, tensors, ok)`` runs before the acknowledgement, which is sent either way."""
    header = torch.zeros(len(HEADER_KEYS), dtype=torch.int64, device=g.device)
    g.bcast(header, timeout_s)
    h = parse_header(header)
    if h["magic"] != MAGIC:
        raise ValueError("bad weight header")
    if h["manifest"]:
        if not 0 < h["manifest"] <= MAX_MANIFEST_BYTES:
            raise ValueError("manifest size out of range")
        raw = torch.empty(h["manifest"], dtype=torch.uint8, device=g.device)
        g.bcast(raw, timeout_s)
        g.layout = Layout.from_manifest_bytes(raw.cpu().numpy().tobytes())
    layout = g.layout
    if (layout is None or layout.digest != h["digest"] or len(layout.buckets) != h["buckets"]
            or layout.wire_bytes != h["nbytes"]):
        raise ValueError("weight header does not match the manifest")
    buckets = empty_buckets(layout, g.device, pool)
    if pool is not None:
        pool.trim(3 * layout.wire_bytes)   # the caller's version, the one waiting to be taken, this one
    g.bcast_many(buckets, timeout_s)
    tensors = unpack(layout, buckets)
    ok = not verify or h["checksum"] < 0 or int(checksum(tensors)) == h["checksum"]   # < 0: none was sent
    if before_ack is not None:
        before_ack(h, tensors, ok)
    g.send_ack(torch.tensor([1, int(ok)], dtype=torch.int64, device=g.device), timeout_s)
    return h, layout, tensors, ok
