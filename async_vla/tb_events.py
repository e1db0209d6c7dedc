"""TensorBoard event files without torch (the buffer process never imports it): the records ``Monitor`` writes,
encoded with the ``tensorboard`` package's own protobufs into TFRecord files named as ``SummaryWriter`` names them,
so several writers share one directory."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1   # Castagnoli, reflected
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``. Pure Python: the records we write are small (a GIF of an eval video, at
    most a few hundred KB, is the largest)."""
    crc, table = 0xFFFFFFFF, _CRC_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: the CRC rotated right by 15 bits plus a constant (raw CRCs of data holding CRCs are
    weak)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord framing ``data``."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


HISTOGRAM_BINS = 30
"""Buckets of a histogram record (equal widths between the smallest and the largest value)."""

_counter = itertools.count()


class EventFileWriter:
    """Appends ``Event`` records to a new event file in ``log_dir``. Thread-safe. Records are buffered and flushed
    at least every ``flush_secs`` (a background thread), on ``flush()`` and on ``close()``."""

    def __init__(self, log_dir: Union[str, Path], flush_secs: float = 10.0):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_counter)}"
        self.path = self.log_dir / name
        self._lock = threading.Lock()
        self._file: Optional[object] = open(self.path, "wb")
        self._stop = threading.Event()
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()
        self._flusher = threading.Thread(target=self._flush_every, args=(float(flush_secs),),
                                         name="tb-flush", daemon=True)
        self._flusher.start()

    def _flush_every(self, secs: float) -> None:
        while not self._stop.wait(secs):
            self.flush()

    def _write(self, event: Event) -> None:
        data = record(event.SerializeToString())
        with self._lock:
            if self._file is None:
                raise ValueError(f"the event file {self.path} is closed")
            self._file.write(data)

    def add_summary(self, summary: Summary, step: int) -> None:
        """One ``Summary`` (any kind of value) at ``step``."""
        self._write(Event(wall_time=time.time(), step=int(step), summary=summary))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step)

    def histogram(self, tag: str, values: np.ndarray, step: int) -> None:
        """A histogram of the finite, non-empty float array ``values`` (the caller filters)."""
        arr = np.asarray(values, dtype=np.float64).ravel()
        counts, edges = np.histogram(arr, bins=HISTOGRAM_BINS)
        proto = HistogramProto(min=float(arr.min()), max=float(arr.max()), num=float(arr.size),
                               sum=float(arr.sum()), sum_squares=float(np.dot(arr, arr)),
                               bucket_limit=edges[1:].tolist(), bucket=counts.astype(np.float64).tolist())
        self.add_summary(Summary(value=[Summary.Value(tag=tag, histo=proto)]), step)

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        self._stop.set()
        self._flusher.join()
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.flush()
            f.close()
