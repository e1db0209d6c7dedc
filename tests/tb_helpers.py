"""Test support: what a run's TensorBoard directory must hold, and reading images back."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

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

REQUIRED_TAG_PREFIXES: tuple[str, ...] = ("rollout/success_rate_by_task/", "time/actor/", "time/learner/",
                                           "time/buffer/")
"""Tag families of which at least one member must exist (one tag per task id; per phase, async_vla/phases.py)."""


def missing_required(tags: Iterable[str]) -> list[str]:
    """Required tags (and tag families, as ``prefix*``) absent from ``tags``."""
    tags = set(tags)
    missing = [t for t in REQUIRED_TAGS if t not in tags]
    return missing + [p + "*" for p in REQUIRED_TAG_PREFIXES if not any(t.startswith(p) for t in tags)]


def read_images(tb_dir: Path, tag: str) -> list[tuple[int, bytes]]:
    """(step, encoded image: PNG, or GIF for videos) pairs of one image tag over every event file, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: list[tuple[int, bytes]] = []
    for path in sorted(p for p in Path(tb_dir).rglob("*") if p.is_file() and "tfevents" in p.name):
        acc = EventAccumulator(str(path), size_guidance={"images": 0})
        acc.Reload()
        if tag in acc.Tags().get("images", []):
            out.extend((e.step, e.encoded_image_string) for e in acc.Images(tag))
    return sorted(out, key=lambda si: si[0])
