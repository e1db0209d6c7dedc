"""The buffer's outcome filters as small pure functions, free of torch (the buffer process never imports it): which
complete groups carry a learning signal (``mixed_outcome``, ``difficulty_mask``). Which data is too old to train on
is ``Admission``'s (admission.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

# A rate this close to a difficulty bound counts as on it (see difficulty_mask).
BOUND_TOL = 1e-6


def mixed_outcome(successes: Any, G: int) -> bool:
    """True when a complete group of G outcomes has both a success and a failure (0 < #success < G).

    ``successes``: G booleans / 0-1 values (list, numpy array or tensor). A group of another length is a
    caller bug (partial or merged group) and raises ValueError instead of silently passing.
    """
    flags = as_numpy(successes).reshape(-1)
    if flags.size != G:
        raise ValueError(f"expected {G} outcomes, got {flags.size}")
    n = int(np.count_nonzero(flags))
    return 0 < n < G


def difficulty_mask(success_rate: Any, lo: float, hi: float) -> bool:
    """True when lo < success_rate < hi (ROLL's difficulty mask, e.g. (0.1, 0.95)); strict on both ends.

    ``success_rate``: a scalar (python / numpy / 0-d tensor), or a group's per-trajectory outcomes, whose
    mean is then the rate. A rate within 1e-6 of a bound counts as on it (excluded): a float32 rate of 1/10
    is 0.10000000149 and must not slip inside (0.1, hi); true rates k/G are never that close to a bound.
    """
    arr = as_numpy(success_rate).astype(np.float64)
    rate = float(arr) if arr.ndim == 0 else float(arr.mean())
    return bool(lo + BOUND_TOL < rate < hi - BOUND_TOL)


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view of a list, array or tensor, without importing torch (a tensor is recognised by ``detach``)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":   # numpy has no bfloat16
            t = t.float()
        return t.numpy()
    return np.asarray(x)
