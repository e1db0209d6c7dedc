"""`bin/eval RUN --versions A,B --record`: a run trained without evaluations (run.eval_every=0, exports kept) gets
its curve afterwards; the points land in summary.json, progress.json, TensorBoard and success.png, marked
after_run, at the wall time the version was made; the run's own evaluations and its final figure stay as they are.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

from async_vla.config import dump_config, load_config
from async_vla.metrics import Monitor, read_scalars
from async_vla.policy import build_policy
from async_vla.weights.export import export_weights
from runner.report import RunRecorder

REPO = Path(__file__).resolve().parent.parent
SMALL = ["env.num_train_init_states=2", "env.num_eval_init_states=2", "env.task_ids=[0,1]", "actor.group_size=2",
         "policy.hidden_size=32", "policy.num_heads=2", "policy.num_layers=1", "policy.intermediate_size=64",
         "run.eval_every=0", "run.eval_envs=2", "weights.export_keep=100"]


def _fake_run(run_dir: Path) -> dict:
    """What bin/train leaves behind for a 3-version run evaluated at v0 and v3 only, with every export kept."""
    cfg = load_config(None, SMALL)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    recorder = RunRecorder(cfg, run_dir, Monitor(run_dir))
    recorder.eval_result(0, {"success_rate": 0.25, "successes": 1, "episodes": 4, "split": "eval",
                             "by_task": {0: 0.5, 1: 0.0}})
    for v in range(4):
        torch.manual_seed(v)
        export_weights(run_dir / "weights", v, build_policy(cfg).state_dict(), 0.0, keep=100)
        recorder.train_points.append({"version": v, "wall_s": 10.0 * v + 1, "success_rate": 0.5})
    recorder.eval_result(3, {"success_rate": 0.75, "successes": 3, "episodes": 4, "split": "eval",
                             "by_task": {0: 1.0, 1: 0.5}})
    summary = recorder.finish(3, {})
    recorder.monitor.close()
    return summary


def _bin_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bin" / "eval"), *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_versions_evaluated_after_the_run_join_its_record(tmp_path):
    run = tmp_path / "run"
    before = _fake_run(run)
    png_before = (run / "success.png").read_bytes()

    proc = _bin_eval(str(run), "--versions", "1,2", "--record", "--json")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)    # one document: a list, one result per version
    assert [r["version"] for r in printed] == [1, 2] and all(r["episodes"] == 4 for r in printed)

    # per-episode outcomes, and the paired comparison of each later version against the first on the same episodes
    assert all(len(r["outcomes"]) == 4 and sum(s for _, _, s in r["outcomes"]) == r["successes"] for r in printed)
    from async_vla.evalstats import mcnemar_one_sided_p, paired_changes

    gained, lost, shared = paired_changes(*({(t, i): s for t, i, s in r["outcomes"]} for r in printed))
    assert "vs_version" not in printed[0]
    assert {k: printed[1][k] for k in ("vs_version", "test", "gained", "lost", "shared")} == {
        "vs_version": 1, "test": "mcnemar", "gained": gained, "lost": lost, "shared": shared}
    assert printed[1]["p_one_sided"] == mcnemar_one_sided_p(gained, lost)
    text = _bin_eval(str(run), "--versions", "1,2")
    assert text.returncode == 0, text.stderr
    assert (f"version 2 vs version 1 on the same {shared} episodes: {gained} gained, {lost} lost (one-sided exact "
            f"McNemar p = {mcnemar_one_sided_p(gained, lost):.3g})") in text.stdout, text.stdout

    # the same figure as evaluating that export on its own: the record holds v2's weights' result
    alone = _bin_eval(str(run / "weights" / "v2.safetensors"), str(run / "config.yaml"), "--json")
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["successes"] == printed[1]["successes"]

    summary = json.loads((run / "summary.json").read_text())
    assert [p["version"] for p in summary["eval"]] == [0, 1, 2, 3]
    assert [bool(p.get("after_run")) for p in summary["eval"]] == [False, True, True, False]
    assert [p["wall_s"] for p in summary["eval"][1:3]] == [11.0, 21.0]   # when the learner made v1 and v2
    assert summary["final_eval"] == before["final_eval"] and summary["final_version"] == 3
    assert summary["best_eval_success"] == max(p["success_rate"] for p in summary["eval"])
    assert summary["initial_eval_success"] == 0.25          # still the run's own v0 evaluation
    progress = json.loads((run / "progress.json").read_text())
    assert progress["eval"] == summary["eval"]
    steps = [s for s, _ in read_scalars(run / "tb", "eval/success_rate")]
    assert sorted(steps) == [0, 1, 2, 3]
    assert (run / "success.png").read_bytes() != png_before

    # recording v2 again replaces its after-run point rather than adding a second one; an override without a
    # config file applies to the run's own config.yaml
    again = _bin_eval(str(run), "run.eval_envs=1", "--versions", "2", "--record")
    assert again.returncode == 0, again.stderr
    assert f"config: {run / 'config.yaml'}" in again.stdout
    again = json.loads((run / "summary.json").read_text())
    assert [p["version"] for p in again["eval"]] == [0, 1, 2, 3]


def test_practised_split_reads_out_the_scenes_the_actors_practise(tmp_path):
    """--split practised: actor.task_ids x the first actor.num_init_states train init states, every one `--repeats`
    times when sampled; two versions in one --json document, the later one compared by Fisher's test."""
    from async_vla.envs import make_env
    from async_vla.evalstats import fisher_one_sided_p

    run = tmp_path / "run"
    _fake_run(run)
    proc = _bin_eval(str(run), "actor.task_ids=[1]", "actor.num_init_states=1", "--versions", "1,2", "--split",
                     "practised", "--temperature", "1.6", "--repeats", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout)
    env = make_env(load_config(None, SMALL), 0)
    scene = [1, env.init_state_ids(1, "train")[0]]
    for res in (first, second):
        assert res["split"] == "practised" and res["episodes"] == 3 and res["temperature"] == 1.6
        assert [o[:2] for o in res["outcomes"]] == [scene] * 3
    assert second["test"] == "fisher" and second["p_one_sided"] == fisher_one_sided_p(
        second["successes"], 3, first["successes"], 3)

    chosen = _bin_eval(str(run), "actor.task_ids=[1]", "actor.init_state_ids=[1,0]", "--split", "practised",
                       "--json")
    assert chosen.returncode == 0, chosen.stderr
    train = env.init_state_ids(1, "train")
    assert [o[:2] for o in json.loads(chosen.stdout)["outcomes"]] == [[1, train[1]], [1, train[0]]]

    outside = _bin_eval(str(run), "actor.task_ids=[5]", "--split", "practised", "--json")
    assert outside.returncode == 2 and "actor.task_ids" in outside.stderr and "env.task_ids" in outside.stderr


def test_bad_requests_are_refused_before_any_evaluation(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    record = (run / "summary.json").read_text()

    missing = _bin_eval(str(run), "--versions", "2,7")
    assert missing.returncode == 2 and "weights/v7.safetensors" in missing.stderr
    assert "weights.export_keep" in missing.stderr

    own = _bin_eval(str(run), "--versions", "3", "--record")     # the run evaluated v3 itself
    assert own.returncode == 2 and "[3]" in own.stderr and "--versions" in own.stderr

    no_versions = _bin_eval(str(run), "--record")
    assert no_versions.returncode == 2 and "--versions" in no_versions.stderr

    not_a_run = _bin_eval(str(run / "weights"), "--versions", "1")
    assert not_a_run.returncode == 2 and "run directory" in not_a_run.stderr

    (run / "summary.json").rename(run / "summary.json.bak")        # a run still going has no summary yet
    going = _bin_eval(str(run), "--versions", "1", "--record")
    assert going.returncode == 2 and "still going" in going.stderr
    (run / "summary.json.bak").rename(run / "summary.json")

    other_policy = _bin_eval(str(run), "policy.path=/elsewhere/sft", "--versions", "1")   # not what it trained from
    assert other_policy.returncode == 2 and "policy.path" in other_policy.stderr, other_policy.stderr

    garbled = _bin_eval(str(run), "--versions", "one,two")
    assert garbled.returncode == 2 and "comma-separated" in garbled.stderr
    assert (run / "summary.json").read_text() == record                # nothing was written by any of these


def test_without_a_start_evaluation_training_starts_at_once_and_the_final_policy_is_scored(tmp_path):
    """run.eval_at_start=false: no evaluation of the initial weights (serial mode here; the async launcher's
    path is exercised by the LIBERO pipeline test, whose config sets it), the final one still happens."""
    from runner.serial import run_serial

    overrides = SMALL + ["run.mode=serial", "run.max_versions=2", "buffer.groups_per_batch=1",
                         "buffer.dynamic_sampling=false", "learner.backend=torch", "env.envs_per_actor=2",
                         "learner.micro_batch_trajectories=2", "logging.tensorboard=false"]
    without = run_serial(load_config(None, overrides + ["run.eval_at_start=false"]), tmp_path / "without")
    assert [p["version"] for p in without["eval"]] == [2]
    assert without["initial_eval_success"] is None and without["final_eval_success"] is not None   # no start figure
    with_start = run_serial(load_config(None, overrides), tmp_path / "with")
    assert [p["version"] for p in with_start["eval"]] == [0, 2]
