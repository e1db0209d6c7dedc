"""The one path to TensorBoard: ``Monitor(run_dir)`` writes event files under ``<run>/tb``.

Every process that logs (learner rank 0, buffer service, fleet) opens its own Monitor on the same run
directory; each writer creates its own event file (the file name carries host, pid and a counter), and
TensorBoard / ``read_tags`` merge every file of the directory. ``REQUIRED_TAGS`` lists the tags a run must
contain; a test reads a run's events back and checks them.

A disabled Monitor (``logging.tensorboard=false``, or learner ranks other than 0) accepts every call and
writes nothing, so callers never branch on it.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import numpy as np

TB_SUBDIR = "tb"

REQUIRED_TAGS: tuple[str, ...] = (
    "rollout/success_rate",
    "eval/success_rate",
    "buffer/received", "buffer/trained", "buffer/filtered_uniform", "buffer/filtered_difficulty",
    "buffer/stale", "buffer/expired_partial", "buffer/malformed",
    "buffer/lag_mean", "buffer/lag_max",
    "loss/policy", "loss/clip_frac_low", "loss/clip_frac_high", "loss/nsr_rescued_frac", "loss/kl",
    "offpolicy/is_weight_mean", "offpolicy/is_weight_max", "offpolicy/mis_masked_frac", "offpolicy/behav_kl",
    "perf/learner_step_s", "perf/learner_idle_frac", "perf/trajectories_per_s", "perf/env_steps_per_s",
    "perf/tokens_per_s",
    "weights/sync_s", "weights/bytes", "weights/version",
)
"""Scalar tags every run must write (besides rollout/success_rate_by_task/* and lag histograms)."""

REQUIRED_TAG_PREFIXES: tuple[str, ...] = ("rollout/success_rate_by_task/",)
"""Tag families of which at least one member must exist (one tag per task id)."""


class Monitor:
    """TensorBoard writer for one process. ``enabled=False`` makes every method a no-op."""

    def __init__(self, run_dir: Union[str, Path], enabled: bool = True, flush_secs: int = 10):
        self.tb_dir = Path(run_dir) / TB_SUBDIR
        self.enabled = bool(enabled)
        self._writer: Any = None
        if self.enabled:
            # Imported here: processes that never log do not pay for the TensorBoard import.
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.tb_dir), flush_secs=flush_secs)

    def scalar(self, tag: str, value: Any, step: int) -> None:
        """One scalar. NaN and inf are written as they are (a NaN loss should be visible, not hidden)."""
        if self._writer is None:
            return
        self._writer.add_scalar(tag, float(value), global_step=int(step))

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        """Every numeric entry of ``values`` as its own tag (non-numeric entries are skipped)."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if isinstance(value, (numbers.Real, np.number, np.bool_)):  # bools log as 0/1
                self._writer.add_scalar(tag, float(value), global_step=int(step))

    def histogram(self, tag: str, values: Iterable[float], step: int) -> None:
        """A histogram of ``values`` (empty or all-non-finite inputs are skipped: TensorBoard rejects them)."""
        if self._writer is None:
            return
        arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64).ravel()
        arr = arr[np.isfinite(arr)]
        if arr.size == 0:
            return
        self._writer.add_histogram(tag, arr, global_step=int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _event_files(tb_dir: Union[str, Path]) -> list[Path]:
    root = Path(tb_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and "tfevents" in p.name)


def _accumulators(tb_dir: Union[str, Path]) -> Iterable[Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # One accumulator per file: a directory accumulator follows a single "current" file and can skip
    # files written concurrently by other processes.
    for path in _event_files(tb_dir):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        yield acc


def read_tags(tb_dir: Union[str, Path]) -> set[str]:
    """Every scalar and histogram tag in the event files under ``tb_dir`` (all writers, recursively)."""
    tags: set[str] = set()
    for acc in _accumulators(tb_dir):
        kinds = acc.Tags()
        tags.update(kinds.get("scalars", []))
        tags.update(kinds.get("histograms", []))
    return tags


def read_scalars(tb_dir: Union[str, Path], tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one scalar tag over every event file, sorted by step (for tests and reports)."""
    out: list[tuple[int, float]] = []
    for acc in _accumulators(tb_dir):
        if tag in acc.Tags().get("scalars", []):
            out.extend((e.step, e.value) for e in acc.Scalars(tag))
    return sorted(out, key=lambda sv: sv[0])


def missing_required(tags: Iterable[str], required: Optional[Iterable[str]] = None) -> list[str]:
    """Required tags (and tag families, as ``prefix*``) absent from ``tags``."""
    tags = set(tags)
    missing = [t for t in (REQUIRED_TAGS if required is None else required) if t not in tags]
    if required is None:
        missing += [p + "*" for p in REQUIRED_TAG_PREFIXES if not any(t.startswith(p) for t in tags)]
    return missing


def is_finite_number(value: Any) -> bool:
    """True for a real, finite number (helper for callers filtering metrics)."""
    return isinstance(value, numbers.Real) and math.isfinite(float(value))
