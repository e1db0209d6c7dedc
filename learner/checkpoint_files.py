"""What a checkpoint holds besides the weights, shared by the learner backends: RNG state, sha256 digests of tensors,
the optimizer's tensors in a stable order. Where checkpoints are (names, ``latest``, pruning):
``learner.checkpoint_names``."""

from __future__ import annotations

import hashlib
import random
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

CKPT_FORMAT = 1


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
