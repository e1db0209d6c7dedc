"""Statistics of success counts: the 95% interval every reported success rate carries, and the one-sided test
that says whether one success count is really above another, unpaired or paired by episode or scene (pure
functions; tests/test_evalstats.py).
"""

from __future__ import annotations

import math
from typing import Sequence

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


def scene_outcomes(results: Sequence[dict]) -> dict:
    """``{(part, task, init state): success}`` of evaluations on pinned scenes, one ``bin/eval --json`` result (its
    ``outcomes``: ``[task, init state, success]``) per part, e.g. per scene variant: every key one scene."""
    out = {}
    for part, res in enumerate(results):
        for task, state, success in res["outcomes"]:
            key = (part, int(task), int(state))
            if key in out:
                raise ValueError(f"scene {key} evaluated twice: give one episode per scene (greedy, no --repeats)")
            out[key] = bool(success)
    return out


def paired_scenes(before: Sequence[dict], after: Sequence[dict]) -> dict:
    """Two policies' greedy results on the same pinned scenes (one evaluation per part each, parts in the same
    order), paired by scene: the scenes both saw, each one's successes on them with 95% intervals, the scenes only
    ``after`` solved (gained) and only ``before`` solved (lost), and the one-sided exact McNemar p of "after is
    above before"."""
    b, a = scene_outcomes(before), scene_outcomes(after)
    gained, lost, scenes = paired_changes(b, a)
    shared = b.keys() & a.keys()
    kb, ka = sum(b[k] for k in shared), sum(a[k] for k in shared)
    return {"scenes": scenes, "successes": [kb, ka], "interval_before": list(wilson_interval(kb, scenes)),
            "interval_after": list(wilson_interval(ka, scenes)), "gained": gained, "lost": lost,
            "p_one_sided": mcnemar_one_sided_p(gained, lost)}
