"""Weights for actors without the learner's run directory (another host, no shared filesystem): the buffer process,
on the learner's node, serves the newest export in chunks on ``transport.weights_fetch_port``
(``WeightsFileServer``, a thread with its own ZeroMQ context); an actor with ``weights.fetch`` mirrors it into its
own ``<run>/weights`` (``mirror_latest``). Torch-free."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import zmq

from async_vla.messages import ROOT, PolicyTag, WeightsChunk, WeightsFetch
from async_vla.transport import Authenticator, ControlClient, ControlServer, CurveKeys

log = logging.getLogger(__name__)
CHUNK_BYTES = 8 * 1024**2
EXPORT_RE = re.compile(r"^v(\d+)\.safetensors$")   # the names export.py writes; never follow anything else


def latest_name(weights_dir: Path) -> Optional[str]:
    """The export ``latest`` points at, if it is one of ours."""
    try:
        name = (weights_dir / "latest").read_text().strip()
    except OSError:
        return None
    return name if EXPORT_RE.match(name) else None


class WeightsFileServer:
    """Answers ``WeightsFetch`` with ``WeightsChunk`` from ``weights_dir`` until ``close()``."""

    def __init__(self, weights_dir: Path, endpoint: str, keys: Optional[CurveKeys] = None):
        self.weights_dir = Path(weights_dir)
        self._ctx = zmq.Context(io_threads=1)
        self._auth = Authenticator(self._ctx, keys) if keys is not None else None
        self._server = ControlServer(endpoint, max_bytes=64 * 1024, ctx=self._ctx, keys=keys)
        self.endpoint = self._server.endpoint
        self.served_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weights-files", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            got = self._server.recv(0.1)
            if got is None:
                continue
            peer, msg = got
            if isinstance(msg, WeightsFetch):
                reply = self.chunk(msg)
                self._server.reply(peer, reply)
                self.served_bytes += int(reply.data.nbytes)

    def chunk(self, req: WeightsFetch) -> WeightsChunk:
        name = req.name or latest_name(self.weights_dir)
        empty = np.zeros(0, np.uint8)
        if name is None:
            return WeightsChunk(name="", version=-1, offset=0, total=0, data=empty)
        m = EXPORT_RE.match(name)
        if m is None:
            return WeightsChunk(name=name, version=-1, offset=0, total=0, data=empty, error="not an export name")
        path = self.weights_dir / name
        try:
            with open(path, "rb") as f:
                total = os.fstat(f.fileno()).st_size
                lineage = _lineage_of(f) if req.offset == 0 else ROOT
                f.seek(req.offset)
                data = f.read(min(req.max_bytes, CHUNK_BYTES))
        except FileNotFoundError:   # pruned since the client learnt its name: it starts over from latest
            return WeightsChunk(name=name, version=int(m.group(1)), offset=req.offset, total=0, data=empty,
                                error="gone")
        return WeightsChunk(name=name, version=int(m.group(1)), offset=req.offset, total=total,
                            data=np.frombuffer(data, np.uint8), lineage=lineage)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._server.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _lineage_of(f) -> str:
    """The learner lineage in an export's safetensors header (export.py writes it; a bad header: ROOT)."""
    try:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(min(n, 1 << 20))).get("__metadata__") or {}
        return str(meta.get("lineage", ROOT))
    except (ValueError, AttributeError):
        return ROOT


def mirror_latest(endpoint: str, weights_dir: Path, newer_than: Optional[PolicyTag] = None,
                  keys: Optional[CurveKeys] = None, timeout_s: float = 30.0) -> Optional[PolicyTag]:
    """Copy the server's newest export into ``weights_dir`` (temporary name, rename, then ``latest`` switched) unless it
    is not newer than ``newer_than``; its tag, else None (none newer, or no answer: the caller tries again later)."""
    from async_vla.transport import ControlTimeout

    weights_dir = Path(weights_dir)
    client = ControlClient(endpoint, keys=keys)
    try:
        for _ in range(3):   # an export pruned mid-copy: start over from the newer latest
            first = client.call(WeightsFetch(), timeout_s)
            if not isinstance(first, WeightsChunk) or not first.name or first.error:
                return None
            tag = PolicyTag(first.lineage, first.version)
            if newer_than is not None and tag.lineage == newer_than.lineage and tag.version <= newer_than.version:
                return None
            weights_dir.mkdir(parents=True, exist_ok=True)
            part = weights_dir / f".{first.name}.part{os.getpid()}"
            with open(part, "wb") as f:
                f.write(first.data.tobytes())
                got, chunk = first.data.nbytes, first
                while got < first.total and not chunk.error:
                    chunk = client.call(WeightsFetch(name=first.name, offset=got), timeout_s)
                    if not isinstance(chunk, WeightsChunk) or chunk.error or chunk.data.nbytes == 0:
                        break
                    f.write(chunk.data.tobytes())
                    got += chunk.data.nbytes
            if got != first.total:
                part.unlink(missing_ok=True)
                continue
            os.replace(part, weights_dir / first.name)
            pointer = weights_dir / f".latest.tmp{os.getpid()}"
            pointer.write_text(first.name)
            os.replace(pointer, weights_dir / "latest")
            for old in weights_dir.glob("v*.safetensors"):   # this mirror keeps the newest only
                if old.name != first.name:
                    old.unlink(missing_ok=True)
            return tag
        return None
    except ControlTimeout as exc:
        log.warning("weights fetch from %s: %s", endpoint, exc)
        return None
    finally:
        client.close()
