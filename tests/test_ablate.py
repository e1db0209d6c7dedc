"""bin/ablate's pure parts: variants (as config overrides), selection, rows read from run summaries, the table."""

import json

import pytest

from async_vla.config import load_config
from runner.ablate import VARIANTS, mean_interval, result_from_summary, select, table, time_to

REPO_CONFIG = "configs/quickstart.yaml"


def validate(overrides):
    return load_config(REPO_CONFIG, overrides)


def test_variants_cover_the_seeds_claims_and_are_valid_configs():
    names = {v.name for v in VARIANTS}
    assert len(names) == len(VARIANTS)
    assert {"default", "no_dynamic_sampling", "symmetric_clip", "nsr_on", "k1", "k2", "k4"} <= names
    assert {f"eta{e}_{c}" for e in (0, 2, 4) for c in ("none", "tis", "mis")} <= names
    assert {f"k{k}_eta4_{c}" for k in (2, 4) for c in ("none", "tis", "mis")} <= names
    chosen, notes = select(None, validate)
    for v in chosen:
        cfg = validate(list(v.overrides))
        if v.name.startswith("eta"):
            eta, corr = v.name[3:].split("_")
            assert cfg.buffer.max_staleness == int(eta) and cfg.loss.correction == corr
        if v.name.startswith("k") and "_eta4_" in v.name:
            k, corr = v.name[1:].split("_eta4_")
            assert (cfg.learner.minibatches, cfg.buffer.max_staleness, cfg.loss.correction) == (int(k), 4, corr)
    assert not validate(list(select(["no_dynamic_sampling"])[0][0].overrides)).buffer.dynamic_sampling
    assert validate(list(select(["symmetric_clip"])[0][0].overrides)).loss.eps_high == 0.2
    assert validate(list(select(["nsr_on"])[0][0].overrides)).loss.nsr == "band"
    # a variant whose knob the schema lacks is left out with a note (the k variants until learner.minibatches
    # exists), and is an error when named
    left_out = [n.split()[0] for n in notes]
    assert set(left_out) | {v.name for v in chosen} == names and not set(left_out) & {v.name for v in chosen}
    for name in left_out:
        with pytest.raises(ValueError, match=f"variant {name} is not available"):
            select([name], validate)


def test_select_rejects_unknown_names():
    assert [v.name for v in select(None)[0]] == [v.name for v in VARIANTS]
    with pytest.raises(ValueError, match="unknown variant.*'nope'.*choose from"):
        select(["default", "nope"])


def test_time_to_threshold():
    evals = [{"wall_s": 5.0, "success_rate": 0.5}, {"wall_s": 9.0, "success_rate": 0.8},
             {"wall_s": 12.0, "success_rate": 0.95}]
    assert time_to(evals, 0.8) == 9.0 and time_to(evals, 0.9) == 12.0 and time_to(evals, 0.99) is None


def test_mean_interval_is_a_student_t_interval():
    m, (lo, hi) = mean_interval([0.5, 0.6, 0.7])
    assert m == pytest.approx(0.6) and (hi - lo) / 2 == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=1e-3)
    assert mean_interval([0.4]) == (0.4, None) and mean_interval([]) == (None, None)
    assert mean_interval([1.0, 1.0, 1.0]) == (1.0, (1.0, 1.0))


def _summary(tmp_path, name, evals, accepted, uniform, version, lag_max, successes, episodes):
    d = tmp_path / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({
        "final_eval_success": evals[-1]["success_rate"], "initial_eval_success": evals[0]["success_rate"],
        "final_eval": {"success": successes / episodes, "successes": successes, "episodes": episodes},
        "eval": evals, "final_version": version,
        "ledger": {"groups": {"accepted": accepted, "filtered_uniform": uniform, "trained": accepted,
                              "stale": 7, "expired_empty": 5},   # neither is a filter verdict: not counted
                   "lag_max": lag_max}}))
    return d


def test_rows_and_table_from_summaries(tmp_path):
    a = _summary(tmp_path, "a", [{"wall_s": 1, "success_rate": 0.5}, {"wall_s": 50, "success_rate": 0.9}], 30, 10,
                 100, 2, 180, 200)
    b = _summary(tmp_path, "b", [{"wall_s": 1, "success_rate": 0.5}, {"wall_s": 50, "success_rate": 0.6}], 10, 30,
                 80, 1, 120, 200)
    ra, rb = result_from_summary("default", 0, a, 0.8), result_from_summary("default", 1, b, 0.8)
    assert (ra.final, ra.successes, ra.episodes, ra.time_to_threshold_s, ra.versions, ra.admitted_frac,
            ra.lag_max) == (0.9, 180, 200, 50.0, 100, 0.75, 2)
    assert rb.time_to_threshold_s is None and rb.admitted_frac == 0.25
    missing = result_from_summary("nsr_on", 0, tmp_path / "none", 0.8)
    assert missing.error and "no summary" in missing.error
    md = table([ra, rb, missing], 0.8, "120 s of wall time", notes=["k2 left out"])
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    cells = [c.strip() for c in rows["default"].split("|")[1:-1]]
    # seeds, per-seed finals, mean (t interval over the 2 seeds: 75 +- 12.706 * 0.212 / sqrt 2, clipped),
    # pooled 300/400 with its Wilson interval, start, versions, admitted, max lag, reached
    # + clip frac, KL(behaviour || proximal), entropy: "—" without TensorBoard logs
    assert cells[2:] == ["2", "90 60", "75% (0–100%)", "300/400 (71–79%)", "50%", "90", "50%", "2", "—", "—", "—",
                         "1/2"]
    assert "Budget 120 s of wall time per run" in md and "| 1 | — |" in rows["nsr_on"] and "nsr_on seed 0: no summary" in md and "- k2 left out" in md


def test_serial_mode_trains_each_variant_at_its_eta_and_twins_run_once():
    from runner.ablate import same_config, serial_lag_overrides

    serial = ["run.mode=serial"]
    variants = {v.name: v for v in VARIANTS}
    resolved = {}
    for name in ("default", "k1", "eta0_mis", "eta2_none", "eta4_tis"):
        ov = serial + list(variants[name].overrides)
        ov += serial_lag_overrides(validate(ov))
        cfg = validate(ov)
        # the fixed serial lag is the variant's eta: the most staleness async mode would admit
        assert cfg.run.serial_lag == cfg.buffer.max_staleness
        resolved[name] = cfg.model_dump(mode="json")
    assert resolved["eta4_tis"]["run"]["serial_lag"] == 4 and resolved["eta0_mis"]["run"]["serial_lag"] == 0
    # k1 and eta2_none are the quickstart's own settings: the same config as the default, so they share its runs
    assert same_config(resolved) == {"k1": "default", "eta2_none": "default"}
    # outside serial mode lag comes from real concurrency: nothing is added
    assert serial_lag_overrides(validate([])) == []


def test_table_reports_a_twin_as_the_same_runs(tmp_path):
    from dataclasses import replace

    from runner.ablate import RunResult

    base = [RunResult("default", s, f"r{s}", final=f, successes=int(f * 200), episodes=200) for s, f in
            enumerate((0.4, 0.5, 0.6))]
    twins = [replace(r, variant="k1", extra={"same_as": "default"}) for r in base]
    md = table(base + twins, 0.8, "60 versions")
    k1_row = next(line for line in md.splitlines() if line.startswith("| k1 |"))
    assert "same config as default" in k1_row and "40 50 60" in k1_row


@pytest.mark.parametrize("extra, message", [
    (["--jobs", "2"], "--jobs > 1 needs run.mode=serial"),
    (["run.mode=serial", "run.serial_lag=1"], "drop the run.serial_lag override"),
])
def test_bin_ablate_refuses_parallel_async_runs_and_a_serial_lag_of_its_own(tmp_path, extra, message):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(repo / "bin" / "ablate"), str(repo / REPO_CONFIG), *extra,
                           "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "runs").exists()   # refused before anything was made


def test_training_signals_are_second_half_means_from_tensorboard(tmp_path):
    from async_vla.tb_events import EventFileWriter

    d = _summary(tmp_path, "a", [{"wall_s": 1, "success_rate": 0.5}], 3, 1, 4, 0, 100, 200)
    w = EventFileWriter(d / "tb")
    for step, (lo, hi, kl, ent) in enumerate([(0.5, 0.5, 9.0, 9.0), (0.5, 0.5, 9.0, 9.0),
                                              (0.02, 0.01, 0.004, 1.5), (0.04, 0.03, 0.006, 2.5)]):
        w.scalar("loss/clip_frac_low", lo, step)
        w.scalar("loss/clip_frac_high", hi, step)
        w.scalar("offpolicy/behav_kl", kl, step)
        w.scalar("loss/entropy", ent, step)
    w.close()
    r = result_from_summary("k4", 0, d, 0.8)
    # the first half (steps 0-1) is left out; clip frac sums both sides
    assert r.clip_frac == pytest.approx(0.05) and r.behav_kl == pytest.approx(0.005) and r.entropy == pytest.approx(2.0)
    cells = [c.strip() for c in table([r], 0.8, "4 versions").splitlines()[2].split("|")[1:-1]]
    assert cells[-4:-1] == ["5.0%", "0.005", "2.000"]
