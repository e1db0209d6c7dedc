"""Recording of the buffer's input stream in the wire format (``buffer.record=true``: every received trajectory as
it travels, interleaved with the other state-changing inputs as ``ControlCommand("j.*")``), and its replay into a
fresh GroupBuffer, which reproduces the ledger exactly. File format and rotation: docs/CONTRACTS.md "The buffer".
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from async_vla.buffer.group_buffer import GroupBuffer

log = logging.getLogger(__name__)

MAGIC = b"AVLAREC1"
_REC = struct.Struct("<dI")
_LEN = struct.Struct("<Q")
MAX_FRAMES = 4096  # a record claiming more is corruption, not data


class Recorder:
    """Appends records to rotating files. Not thread-safe (the buffer service owns it)."""

    def __init__(self, directory, file_bytes: int, max_files: int, meta: Optional[dict] = None):
        self.dir = Path(directory)
        if self.dir.is_dir() and any(self.dir.glob("rec-*.bin")):
            # A restarted buffer starts a new stream (its ledger starts from zero too); keep the old one aside.
            n = 1
            while self.dir.with_name(f"{self.dir.name}-{n}").exists():
                n += 1
            self.dir.rename(self.dir.with_name(f"{self.dir.name}-{n}"))
            log.warning("recording: previous recording moved to %s-%d", self.dir.name, n)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file_bytes = int(file_bytes)
        self.max_files = int(max_files)
        (self.dir / "meta.json").write_text(json.dumps({"format": 1, **(meta or {})}, indent=1))
        self.records = 0
        self.bytes_written = 0
        self.files_deleted = 0
        self._file = None
        self._file_size = 0

    def write(self, t: float, frames: Sequence) -> None:
        """One record: the frames of one message (bytes, memoryview or zmq.Frame)."""
        if self._file is None or self._file_size >= self.file_bytes:
            self._rotate()
        views = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        parts = [_REC.pack(float(t), len(views))]
        for v in views:
            parts.append(_LEN.pack(v.nbytes))
            parts.append(v)
        for p in parts:
            self._file.write(p)
        n = _REC.size + sum(_LEN.size + v.nbytes for v in views)
        self._file_size += n
        self.bytes_written += n
        self.records += 1

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        path = self.dir / f"rec-{self.records:012d}.bin"
        self._file = open(path, "wb")
        self._file.write(MAGIC)
        self._file_size = len(MAGIC)
        files = sorted(self.dir.glob("rec-*.bin"))
        for old in files[:-self.max_files]:  # bounded disk: the oldest go first
            old.unlink()
            self.files_deleted += 1
            log.info("recording: deleted %s (record_max_files=%d)", old.name, self.max_files)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def recording_info(directory) -> dict:
    """Files, index of the first kept record, and whether rotation dropped the start."""
    files = sorted(Path(directory).glob("rec-*.bin"))
    first = int(files[0].stem.split("-")[1]) if files else 0
    return {"files": [f.name for f in files], "first_record": first, "truncated": first > 0}


def iter_records(directory, limit: Optional[int] = None) -> Iterator[tuple[float, list[bytes]]]:
    """(t, frames) for every record in order; stops quietly at a torn tail (a crash mid-write)."""
    count = 0
    for path in sorted(Path(directory).glob("rec-*.bin")):
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{path} is not a recording file")
            while limit is None or count < limit:
                head = f.read(_REC.size)
                if not head:
                    break
                rec = _read_record(f, head)
                if rec is None:
                    log.warning("recording: torn record at the end of %s (ignored)", path.name)
                    break
                count += 1
                yield rec


def _read_record(f, head: bytes) -> Optional[tuple[float, list[bytes]]]:
    if len(head) < _REC.size:
        return None
    t, n = _REC.unpack(head)
    if n > MAX_FRAMES:
        raise ValueError(f"corrupt recording record ({n} frames)")
    frames = []
    for _ in range(n):
        raw = f.read(_LEN.size)
        if len(raw) < _LEN.size:
            return None
        (size,) = _LEN.unpack(raw)
        data = f.read(size)
        if len(data) < size:
            return None
        frames.append(data)
    return t, frames


def iter_recording(directory) -> Iterator[list[bytes]]:
    """Frame lists, one per recorded message (decode with async_vla.messages.decode)."""
    for _, frames in iter_records(directory):
        yield frames


class ReplayClock:
    """A clock that reads whatever time the replay last set (so expiry decisions repeat exactly)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(rec_dir, cfg, limit: Optional[int] = None, ledger=None,
           each: Optional[Callable[[int, "GroupBuffer"], None]] = None) -> "GroupBuffer":
    """Feed the recording in ``rec_dir`` (its first ``limit`` records) into a fresh GroupBuffer; return it.
    ``ledger``: the buffer's ``Ledger`` (a subclass sees every trajectory's fate: runner/faults/audit.py);
    ``each(n, buffer)`` is called after the n-th record (1-based) is applied."""
    from async_vla.buffer.group_buffer import GroupBuffer
    from async_vla.messages import decode

    rec_dir = Path(rec_dir)
    meta = json.loads((rec_dir / "meta.json").read_text())
    clock = ReplayClock()
    buf = GroupBuffer.from_config(cfg, meta["run_id"], clock=clock, valid_task_ids=meta.get("valid_task_ids"),
                                  ledger=ledger)
    buf.set_max_staleness(meta.get("max_staleness", buf.max_staleness), source="replay")
    for n, (t, frames) in enumerate(iter_records(rec_dir, limit), 1):
        clock.t = t
        buf.apply_journal(decode(frames, max_bytes=2**40))
        if each is not None:
            each(n, buf)
    return buf


def replay_recording(run_dir, cfg=None, limit: Optional[int] = None) -> "GroupBuffer":
    """Replay ``<run_dir>/recording`` (the current buffer's) into a fresh GroupBuffer; return it. ``cfg`` defaults
    to ``<run_dir>/config.yaml`` (the resolved config the service wrote)."""
    from async_vla.config import load_config

    run_dir = Path(run_dir)
    cfg = cfg if cfg is not None else load_config(run_dir / "config.yaml")
    return replay(run_dir / "recording", cfg, limit)
