"""The one path to TensorBoard: ``Monitor(run_dir)`` writes event files under ``<run>/tb`` through
``async_vla.tb_events`` (no torch). Each process opens its own Monitor (one event file per writer) and readers merge
every file of the directory; a disabled Monitor accepts every call and writes nothing (docs/LEARNER.md "TensorBoard").
"""
from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from async_vla.tb_events import EventFileWriter

TB_SUBDIR = "tb"

# TensorBoard names a verl user knows -> the learner metric of ours they are copied from (docs/LEARNER.md has
# the table with what each means and how it differs from verl's). Written next to our own tags, which stay.
VERL_TAGS = {
    "actor/pg_loss": "loss/policy",
    "actor/pg_clipfrac_lower": "loss/dual_clip_frac",
    "actor/ppo_kl": "loss/approx_kl",
    "actor/entropy": "loss/entropy",
    "actor/kl_loss": "loss/kl_ref",
    "actor/grad_norm": "learner/grad_norm",
    "actor/lr": "learner/lr",
    "rollout_corr/rollout_is_mean": "offpolicy/is_weight_mean",
    "rollout_corr/rollout_is_max": "offpolicy/is_weight_max",
    "rollout_corr/rollout_rs_masked_fraction": "offpolicy/mis_masked_frac",
    "rollout_corr/kl": "offpolicy/behav_kl",
    "critic/score/mean": "learner/reward_mean",
    "critic/rewards/mean": "learner/reward_mean",
    "critic/advantages/mean": "learner/adv_mean",
    "critic/advantages/max": "learner/adv_max",
    "critic/advantages/min": "learner/adv_min",
    "timing_s/update_actor": "perf/learner_step_s",
    "timing_s/old_log_prob": "perf/learner_prox_s",
    "training/global_step": "learner/version",
}


def verl_aliases(metrics: dict[str, float]) -> dict[str, float]:
    """The ``VERL_TAGS`` copies of ``metrics`` (those whose source exists), plus ``actor/pg_clipfrac``: the
    fraction of loss tokens a PPO clip silences, either side (verl's pg_clipfrac; ours split low / high)."""
    out = {verl: metrics[ours] for verl, ours in VERL_TAGS.items() if ours in metrics}
    if "loss/clip_frac_low" in metrics:
        out["actor/pg_clipfrac"] = metrics["loss/clip_frac_low"] + metrics["loss/clip_frac_high"]
    return out


VIDEO_MIN_SIDE = 128
"""Videos of smaller images (the built-in env's 32 px) are enlarged by a whole factor (nearest pixel) to this."""
VIDEO_MAX_FRAMES = 150
"""Longer episodes (LIBERO: up to ~500 steps) keep every n-th frame, played at the same real-time speed."""


def video_frames(frames: np.ndarray) -> tuple[np.ndarray, int]:
    """uint8 [T, H, W, 3] -> (the frames a video shows, env steps per shown frame): every n-th frame (and the
    last) when T > VIDEO_MAX_FRAMES, enlarged by a whole factor to at least VIDEO_MIN_SIDE."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    stride = max(1, math.ceil(len(frames) / VIDEO_MAX_FRAMES))
    idx = list(range(0, len(frames), stride))
    if idx[-1] != len(frames) - 1:
        idx.append(len(frames) - 1)   # the last frame shows how the episode ended
    shown = frames[idx]
    scale = max(1, math.ceil(VIDEO_MIN_SIDE / min(frames.shape[1:3])))
    if scale > 1:
        shown = shown.repeat(scale, axis=1).repeat(scale, axis=2)
    return shown, stride


def gif_bytes(frames: np.ndarray, frame_ms: int) -> bytes:
    """An animated, looping GIF of uint8 [T, H, W, 3] frames, ``frame_ms`` per frame (Pillow)."""
    import io

    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=max(20, int(frame_ms)),
                   loop=0, optimize=False)
    return buf.getvalue()


class Monitor:
    """TensorBoard writer for one process. ``enabled=False`` makes every method a no-op."""

    def __init__(self, run_dir: Union[str, Path], enabled: bool = True, flush_secs: int = 10):
        self.tb_dir = Path(run_dir) / TB_SUBDIR
        self.enabled = bool(enabled)
        self._writer: Optional["EventFileWriter"] = None
        if self.enabled:
            # Imported here: processes that never log do not pay for the protobuf import. Not torch's
            # SummaryWriter: the buffer process logs too, and must not import torch.
            from async_vla import tb_events

            self._writer = tb_events.EventFileWriter(self.tb_dir, flush_secs=flush_secs)

    def scalar(self, tag: str, value: Any, step: int) -> None:
        """One scalar. NaN and inf are written as they are (a NaN loss should be visible, not hidden)."""
        if self._writer is None:
            return
        self._writer.scalar(tag, float(value), int(step))

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        """Every numeric entry of ``values`` as its own tag (non-numeric entries are skipped)."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if isinstance(value, (numbers.Real, np.number, np.bool_)):  # bools log as 0/1
                self._writer.scalar(tag, float(value), int(step))

    def histogram(self, tag: str, values: Iterable[float], step: int) -> None:
        """A histogram of ``values`` (empty or all-non-finite inputs are skipped: TensorBoard rejects them)."""
        if self._writer is None:
            return
        arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64).ravel()
        arr = arr[np.isfinite(arr)]
        if arr.size == 0:
            return
        self._writer.histogram(tag, arr, int(step))

    def video(self, tag: str, frames: np.ndarray, step: int, fps: float) -> None:
        """An episode (uint8 [T, H, W, 3]) as an animated GIF in TensorBoard's Images tab: the record
        ``SummaryWriter.add_video`` writes, encoded with Pillow (docs/LEARNER.md "Eval videos" says why)."""
        if self._writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        shown, stride = video_frames(frames)
        data = gif_bytes(shown, 1000.0 * stride / fps)
        image = Summary.Image(height=shown.shape[1], width=shown.shape[2], colorspace=3, encoded_image_string=data)
        self._writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _accumulators(tb_dir: Union[str, Path]) -> Iterable[Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # One accumulator per file: a directory accumulator follows a single "current" file and can skip
    # files written concurrently by other processes.
    for path in sorted(p for p in Path(tb_dir).rglob("*") if p.is_file() and "tfevents" in p.name):
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
