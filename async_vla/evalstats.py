"""Statistics of success counts: the 95% interval every reported success rate carries, and the one-sided test
that says whether one success count is really above another (pure functions; tests/test_evalstats.py).
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: int, episodes: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (default 95%); (0, 1) for no episodes. Unlike the Wald interval it
    stays inside [0, 1] and does not collapse at 0 or n successes."""
    if episodes <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= episodes:
        raise ValueError(f"successes must be in 0..{episodes}, got {successes}")
    p = successes / episodes
    denom = 1.0 + z * z / episodes
    centre = (p + z * z / (2 * episodes)) / denom
    half = z * math.sqrt(p * (1 - p) / episodes + z * z / (4 * episodes * episodes)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def fisher_one_sided_p(k_after: int, n_after: int, k_before: int, n_before: int) -> float:
    """One-sided Fisher exact p-value of "the after rate is higher than the before rate": given the total successes,
    the after count is hypergeometric under the null; p = P(X >= k_after)."""
    for k, n in ((k_after, n_after), (k_before, n_before)):
        if not 0 <= k <= n:
            raise ValueError(f"success count {k} not in 0..{n}")
    total, succ = n_after + n_before, k_after + k_before
    denom = math.comb(total, succ)
    top = min(succ, n_after)
    return sum(math.comb(n_after, x) * math.comb(n_before, succ - x) for x in range(k_after, top + 1)) / denom


def rate_summary(successes: int, episodes: int) -> dict:
    """``{"success", "successes", "episodes", "interval95"}`` for summaries and tables."""
    lo, hi = wilson_interval(successes, episodes)
    return {"success": successes / episodes if episodes else None, "successes": int(successes),
            "episodes": int(episodes), "interval95": [lo, hi]}


def paired_changes(before: dict, after: dict) -> tuple[int, int, int]:
    """``(gained, lost, both)`` over the episodes two evaluations share (``before`` / ``after``: episode key ->
    success): failed then succeeded, the reverse, and the number shared."""
    shared = before.keys() & after.keys()
    gained = sum(1 for k in shared if after[k] and not before[k])
    lost = sum(1 for k in shared if before[k] and not after[k])
    return gained, lost, len(shared)


def mcnemar_one_sided_p(gained: int, lost: int) -> float:
    """One-sided exact McNemar p-value of "after succeeds more often than before" on paired episodes: the gains among
    the ``gained + lost`` discordant pairs are Binomial(n, 1/2) under the null; p = P(X >= gained)."""
    if gained < 0 or lost < 0:
        raise ValueError(f"counts must be >= 0, got gained={gained}, lost={lost}")
    n = gained + lost
    return sum(math.comb(n, x) for x in range(gained, n + 1)) / 2 ** n
