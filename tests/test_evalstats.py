"""Success-count statistics against slow references and published values."""

import itertools
import math

import pytest

from async_vla.evalstats import (fisher_one_sided_p, mcnemar_one_sided_p, paired_changes, paired_scenes,
                                 rate_summary, wilson_interval)


def test_wilson_known_values():
    # Wilson (1927) / Newcombe (1998) table values at 95%
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(9, 10) == pytest.approx((0.5958, 0.9821), abs=1e-4)
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    lo, hi = wilson_interval(190, 200)
    assert lo < 0.95 < hi and hi < 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_wilson_is_the_score_test_inversion():
    """Slow reference: the interval is the set of p the score test does not reject (z^2 >= (p_hat-p)^2 n/(p(1-p)))."""
    z = 1.959963984540054
    for k, n in ((3, 20), (17, 20), (100, 200)):
        grid = [i / 20000 for i in range(1, 20000)]
        inside = [p for p in grid if (k / n - p) ** 2 * n / (p * (1 - p)) <= z * z]
        lo, hi = wilson_interval(k, n)
        assert lo == pytest.approx(min(inside), abs=1e-4) and hi == pytest.approx(max(inside), abs=1e-4)


def test_fisher_against_enumeration():
    """Slow reference: enumerate every way to deal the successes over the pooled episodes."""
    for k_a, n_a, k_b, n_b in ((5, 6, 1, 6), (3, 5, 3, 5), (0, 4, 2, 4), (4, 7, 1, 5)):
        pooled = [1] * (k_a + k_b) + [0] * (n_a + n_b - k_a - k_b)
        hits = total = 0
        for chosen in itertools.combinations(range(len(pooled)), n_a):
            total += 1
            hits += sum(pooled[i] for i in chosen) >= k_a
        assert fisher_one_sided_p(k_a, n_a, k_b, n_b) == pytest.approx(hits / total, rel=1e-12)
    assert fisher_one_sided_p(10, 10, 0, 10) == pytest.approx(1 / math.comb(20, 10))


def test_rate_summary():
    s = rate_summary(180, 200)
    assert s["success"] == 0.9 and s["episodes"] == 200 and s["successes"] == 180
    assert s["interval95"][0] < 0.9 < s["interval95"][1]


def test_mcnemar_against_enumeration_of_the_discordant_pairs():
    """Every sign pattern of n discordant pairs is equally likely under the null: the p-value is the share of
    patterns with at least as many gains."""
    import itertools

    for gained, lost in [(0, 0), (3, 0), (0, 3), (5, 2), (2, 5), (7, 4), (6, 6)]:
        n = gained + lost
        patterns = list(itertools.product((0, 1), repeat=n))
        ref = sum(1 for p in patterns if sum(p) >= gained) / len(patterns)
        assert mcnemar_one_sided_p(gained, lost) == pytest.approx(ref, rel=1e-12)
    assert mcnemar_one_sided_p(5, 0) == pytest.approx(1 / 32)   # five gains, no loss
    with pytest.raises(ValueError):
        mcnemar_one_sided_p(-1, 2)


def test_paired_changes_count_only_the_shared_episodes():
    before = {(0, 40): True, (0, 41): False, (1, 40): False, (1, 41): True, (2, 40): True}
    after = {(0, 40): True, (0, 41): True, (1, 40): False, (1, 41): False, (3, 40): True}
    assert paired_changes(before, after) == (1, 1, 4)


def test_paired_scenes_pair_by_variant_task_and_init_state_in_the_after_direction():
    # variant 0: after solves (8, 40) that before fails; variant 1: before solves (8, 41) that after fails, and
    # (8, 40) of variant 1 is a different scene from (8, 40) of variant 0
    before = [{"outcomes": [[8, 40, False], [8, 41, True]]}, {"outcomes": [[8, 40, True], [8, 41, True]]}]
    after = [{"outcomes": [[8, 41, True], [8, 40, True]]}, {"outcomes": [[8, 40, True], [8, 41, False]]},
             {"outcomes": [[8, 40, True]]}]                    # a third variant only after saw: not paired
    r = paired_scenes(before, after)
    assert (r["scenes"], r["successes"], r["gained"], r["lost"]) == (4, [3, 3], 1, 1)
    assert r["p_one_sided"] == pytest.approx(mcnemar_one_sided_p(1, 1))
    wins = [{"outcomes": [[0, i, True] for i in range(6)]}]
    fails = [{"outcomes": [[0, i, False] for i in range(6)]}]
    up, down = paired_scenes(fails, wins), paired_scenes(wins, fails)
    assert (up["gained"], up["lost"], down["gained"], down["lost"]) == (6, 0, 0, 6)
    assert up["p_one_sided"] == pytest.approx(1 / 64) and down["p_one_sided"] == 1.0
    assert up["interval_after"][0] > 0.5 > up["interval_before"][1]
    with pytest.raises(ValueError, match="evaluated twice"):
        paired_scenes([{"outcomes": [[0, 1, True], [0, 1, False]]}], wins)
