"""Wall-clock bounds for tests on a shared, loaded machine.

A bound a test needs ("returned promptly, not after the 60 s it would otherwise take") is written as
``slack(s)``: ``s`` seconds scaled by how loaded the machine is (1-minute load average per core, times 3, at least
1), or by ``ASYNC_VLA_TEST_TIME_SCALE`` when set. Use it only where the alternative the test rules out takes far
longer than any scaled bound (or forever); where two outcomes differ by a small time, assert on state, not time.
"""

from __future__ import annotations

import os


def time_scale() -> float:
    forced = os.environ.get("ASYNC_VLA_TEST_TIME_SCALE")
    if forced:
        return float(forced)
    return max(1.0, 3.0 * os.getloadavg()[0] / (os.cpu_count() or 1))


def slack(seconds: float) -> float:
    """``seconds`` scaled for the machine's load right now."""
    return seconds * time_scale()
