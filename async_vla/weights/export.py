"""Exported weights: ``<run>/weights/v<N>.safetensors`` written tile by tile from the broadcast's buckets, the
``latest`` pointer, and the reader an actor (re)starting or missing broadcasts loads from."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from async_vla.messages import ROOT, PolicyTag
from async_vla.weights.buckets import Layout, NamedTensors, bytes_of, checksum, dtype_name, named_items, unpack

log = logging.getLogger(__name__)

_SAFETENSORS_CODES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
_EXPORT_RE = re.compile(r"^v(\d+)\.safetensors$")
MILESTONES = "milestones"   # <run>/weights/milestones: exports kept for an evaluator (``Exporter``'s milestone_every)
MAX_MILESTONES = 3          # kept unread at most (the evaluator scores the newest and skips older ones anyway)


def write_safetensors(path: Union[str, Path], named: NamedTensors, metadata: Optional[dict[str, str]] = None) -> int:
    """Write a standard safetensors file tensor by tensor (views into shared buckets are fine here,
    unlike ``safetensors.torch.save_file`` which refuses tensors sharing storage). Returns bytes written."""
    items = [(n, t.detach()) for n, t in named_items(named)]
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
    off = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_CODES[dtype_name(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)             # the format allows space padding; keeps data 8-aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in items:
            if t.numel():
                f.write(bytes_of(t.cpu()).numpy().data)
    return 8 + len(raw) + off


def export_weights(weights_dir: Union[str, Path], version: int, named: NamedTensors, checksum_value: float,
                   keep: int = 2, lineage: str = ROOT, milestone: bool = False) -> Path:
    """Write ``v<version>.safetensors`` then point ``latest`` at it, both by atomic rename, and prune older exports
    down to ``keep``. ``lineage``: the publishing learner's (in the metadata). ``milestone``: also hard-link this
    version into ``milestones/`` (outside pruning) if that directory exists (an evaluator made it and deletes them)."""
    d = Path(weights_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"v{version}.safetensors"
    tmp = d / f".v{version}.safetensors.tmp{os.getpid()}"
    write_safetensors(tmp, named, {"version": str(version), "checksum": repr(checksum_value), "format": "pt",
                                   "lineage": lineage})
    os.replace(tmp, final)
    if milestone:
        _keep_milestone(d, final)
    ptr = d / f".latest.tmp{os.getpid()}"
    ptr.write_text(final.name + "\n")
    os.replace(ptr, d / "latest")
    exports = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _EXPORT_RE.match(p.name)))
    for v, p in exports[:-max(1, keep)]:
        if v != version:
            p.unlink(missing_ok=True)
    return final


def _keep_milestone(d: Path, final: Path) -> None:
    """Link ``final`` into ``milestones/`` under its own name, atomically (a reader never sees a partial one),
    when an evaluator asked for them (made the directory); at most ``MAX_MILESTONES`` are kept unread."""
    ms = d / MILESTONES
    if not ms.is_dir():
        return
    tmp = ms / f".{final.name}.tmp{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        os.link(final, tmp)
    except OSError:        # a filesystem without hard links: a copy
        shutil.copyfile(final, tmp)
    os.replace(tmp, ms / final.name)
    for _, old in milestones(d)[:-MAX_MILESTONES]:
        old.unlink(missing_ok=True)


def milestones(weights_dir: Union[str, Path]) -> list[tuple[int, Path]]:
    """(version, path) of every milestone export kept in ``<weights_dir>/milestones``, oldest first."""
    ms = Path(weights_dir) / MILESTONES
    if not ms.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ms.iterdir() if (m := _EXPORT_RE.match(p.name)))


def discard_milestones(weights_dir: Union[str, Path], up_to: Optional[int] = None) -> int:
    """Delete milestone exports of versions ``<= up_to`` (all when None); returns how many."""
    gone = 0
    for v, p in milestones(weights_dir):
        if up_to is None or v <= up_to:
            p.unlink(missing_ok=True)
            gone += 1
    return gone


def newest_milestone(weights_dir: Union[str, Path], after: int) -> Optional[Path]:
    """The newest milestone export of a version ``> after``, discarding the older ones it skips (an evaluator
    that falls behind the learner stays current; every point it reports is still a milestone); None if none."""
    pending = [(v, p) for v, p in milestones(weights_dir) if v > after]
    if not pending:
        return None
    discard_milestones(weights_dir, up_to=pending[-1][0] - 1)
    return pending[-1][1]


class Exporter:
    """Writes published versions to ``<run>/weights`` one at a time, in a background thread unless asked to wait; the
    buckets it reads must stay unchanged until the next ``start`` or ``wait`` returns. ``milestone_every``
    (``run.eval_every``): the first export at or past each multiple is also kept in ``milestones/`` when it exists."""

    def __init__(self, weights_dir: Union[str, Path], keep: int, lineage: str = ROOT, milestone_every: int = 0):
        self.weights_dir, self.keep, self.lineage = Path(weights_dir), keep, lineage
        self.milestone_every = max(0, int(milestone_every))
        self._last_export = -1      # version of the last export started (its milestone decided)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _is_milestone(self, version: int) -> bool:
        every, last = self.milestone_every, self._last_export
        self._last_export = version
        if not every or last < 0:    # the first export (v0, or a resumed part's start) was evaluated already
            return False
        return version // every > last // every

    def start(self, version: int, layout: Layout, buckets: Sequence[torch.Tensor], csum: Optional[float],
              sync: bool) -> Optional[BaseException]:
        """Wait for the previous export, then write this one (computing its checksum when ``csum`` is None);
        returns the previous export's error, if any."""
        previous = self.wait()
        milestone = self._is_milestone(version)

        def work():
            try:
                named = unpack(layout, [b.cpu() for b in buckets])
                export_weights(self.weights_dir, version, named, checksum(named) if csum is None else csum, self.keep,
                               self.lineage, milestone)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop training: logged, reported
                self._error = exc
                log.error("weights: export of v%d failed: %s", version, exc)

        if sync:
            work()
        else:
            self._thread = threading.Thread(target=work, name=f"weights-export-v{version}", daemon=True)
            self._thread.start()
        return previous

    def wait(self) -> Optional[BaseException]:
        """Block until the last export is on disk (``latest`` points at it); returns its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error


def read_latest(weights_dir: Union[str, Path], device: Union[str, torch.device] = "cpu",
                newer_than: Optional[PolicyTag] = None, lineage: Optional[str] = None
                ) -> Optional[tuple[PolicyTag, dict[str, torch.Tensor], float]]:
    """Load the export ``latest`` points at (or the newest ``v*.safetensors``): (tag, tensors, checksum). None when there
    is none, when it is not newer than ``newer_than``, or - with ``lineage`` - when another lineage wrote it; decided
    from the safetensors header alone. Retries when the file is pruned between reading the pointer and opening it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    d = Path(weights_dir)
    for _ in range(5):
        name = None
        try:
            name = (d / "latest").read_text().strip()
        except FileNotFoundError:
            pass
        if name is None or not _EXPORT_RE.match(name):   # never follow an untrusted path
            found = sorted((int(m.group(1)), p.name) for p in d.glob("v*.safetensors")
                           if (m := _EXPORT_RE.match(p.name))) if d.is_dir() else []
            if not found:
                return None
            name = found[-1][1]
        path = d / name
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tag = PolicyTag(meta.get("lineage", ROOT), int(meta.get("version", _EXPORT_RE.match(name).group(1))))
            if (lineage is not None and tag.lineage != lineage or newer_than is not None
                    and tag.lineage == newer_than.lineage and tag.version <= newer_than.version):
                return None
            tensors = load_file(str(path), device=str(device))
        except FileNotFoundError:
            continue
        return tag, tensors, float(meta.get("checksum", "nan"))
    return None
