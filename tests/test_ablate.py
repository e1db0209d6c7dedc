"""bin/ablate's pure parts: variant selection, time-to-threshold, rows read from run summaries, the table."""

import json

import pytest

from async_vla.config import load_config
from runner.ablate import VARIANTS, result_from_summary, select, table, time_to

REPO_CONFIG = "configs/quickstart.yaml"


def test_every_variant_is_a_valid_config_and_names_are_unique():
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)
    for v in VARIANTS:
        cfg = load_config(REPO_CONFIG, list(v.overrides))
        if v.name.startswith("eta4"):
            assert cfg.buffer.max_staleness == 4 and cfg.loss.correction == v.name.split("_")[1]
    assert not load_config(REPO_CONFIG, list(select(["no_dynamic_sampling"])[0].overrides)).buffer.dynamic_sampling
    assert load_config(REPO_CONFIG, list(select(["symmetric_clip"])[0].overrides)).loss.eps_high == 0.2


def test_select_rejects_unknown_names():
    assert [v.name for v in select(None)] == [v.name for v in VARIANTS]
    with pytest.raises(ValueError, match="unknown variant.*'nope'.*choose from"):
        select(["default", "nope"])


def test_time_to_threshold():
    evals = [{"wall_s": 5.0, "success_rate": 0.5}, {"wall_s": 9.0, "success_rate": 0.8},
             {"wall_s": 12.0, "success_rate": 0.95}]
    assert time_to(evals, 0.8) == 9.0 and time_to(evals, 0.9) == 12.0 and time_to(evals, 0.99) is None


def _summary(tmp_path, name, evals, accepted, uniform, version, lag_max):
    d = tmp_path / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({
        "final_eval_success": evals[-1]["success_rate"], "best_eval_success": max(e["success_rate"] for e in evals),
        "eval": evals, "final_version": version,
        "ledger": {"groups": {"accepted": accepted, "filtered_uniform": uniform, "trained": accepted,
                              "stale": 7, "expired_empty": 5},   # neither is a filter verdict: not counted
                   "lag_max": lag_max}}))
    return d


def test_rows_and_table_from_summaries(tmp_path):
    a = _summary(tmp_path, "a", [{"wall_s": 1, "success_rate": 0.5}, {"wall_s": 50, "success_rate": 0.9}], 30, 10,
                 100, 2)
    b = _summary(tmp_path, "b", [{"wall_s": 1, "success_rate": 0.5}, {"wall_s": 50, "success_rate": 0.6}], 10, 30,
                 80, 1)
    ra, rb = result_from_summary("default", 0, a, 0.8), result_from_summary("default", 1, b, 0.8)
    assert (ra.final, ra.best, ra.time_to_threshold_s, ra.versions, ra.admitted_frac, ra.lag_max) == \
        (0.9, 0.9, 50.0, 100, 0.75, 2)
    assert rb.time_to_threshold_s is None and rb.admitted_frac == 0.25
    missing = result_from_summary("nsr_on", 0, tmp_path / "none", 0.8)
    assert missing.error and "no summary" in missing.error
    md = table([ra, rb, missing], 0.8, 120)
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 2 | 75% | 75% | 1/2 | 50 | 90 | 50% | 2 |" in rows["default"]  # means over the two seeds
    assert "0/1" in rows["nsr_on"] and "nsr_on seed 0: no summary" in md
