"""The learning rate of each update (``learner.lr`` with ``learner.lr_decay`` / ``learner.lr_final``)."""
from __future__ import annotations

from typing import Optional


def lr_at(version: int, lr: float, decay: Optional[tuple[int, int]], lr_final: float) -> float:
    """The lr of the update that makes version ``version + 1``: ``lr`` up to version ``start``, then linear to
    ``lr_final`` at version ``end``, ``lr_final`` after it; ``lr`` throughout when ``decay`` is None."""
    if decay is None:
        return lr
    start, end = decay
    if version <= start:
        return lr
    if version >= end:
        return lr_final
    return lr + (lr_final - lr) * (version - start) / (end - start)
