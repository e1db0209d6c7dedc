"""Checkpoint files and digests shared by the learner backends: RNG state, sha256 digests of tensors, the
``v<version>`` directory names, the ``latest`` pointer and pruning. (Re-exported by ``learner.core``.)"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

CKPT_FORMAT = 1
LATEST_FILE = "latest"


# ------------------------------------------------------------------------------------------ RNG state
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA) generator states, for bit-identical resumes."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tensors_digest(items: Iterator[tuple[str, Tensor]] | Sequence[tuple[str, Tensor]]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes: equal digests = bit-equal tensors."""
    h = hashlib.sha256()
    for name, t in items:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, Tensor]]:
    """The optimizer's parameters (fp32 masters / partitions) and state tensors, in a stable order."""
    out: list[tuple[str, Tensor]] = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            out.append((f"g{gi}.p{pi}", p.data))
            for key, val in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(val, Tensor):
                    out.append((f"g{gi}.p{pi}.{key}", val))
    return out


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest ``v<version>`` checkpoint directories (never the latest)."""
    latest = (directory / LATEST_FILE).read_text().strip() if (directory / LATEST_FILE).is_file() else None
    tags = sorted((p for p in directory.glob("v*") if p.is_dir() and p.name[1:].isdigit()),
                  key=lambda p: int(p.name[1:]))
    for p in tags[:-keep] if keep > 0 else []:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def checkpoint_tag(version: int) -> str:
    return f"v{version:08d}"


def latest_tag(directory: Path | str) -> Optional[str]:
    """The tag named by ``<directory>/latest`` if that checkpoint exists; else (the pointer is missing, or names a
    directory a kill caught being replaced) the newest complete Torch checkpoint (``v<version>/learner.pt``,
    written via a temp dir and a rename, so present means complete); else None."""
    d = Path(directory)
    f = d / LATEST_FILE
    if f.is_file():
        tag = f.read_text().strip()
        if (d / tag).is_dir():
            return tag
    complete = sorted(p.name for p in d.glob("v*")
                      if re.fullmatch(r"v\d{8}", p.name) and (p / "learner.pt").is_file())
    return complete[-1] if complete else None
