"""The LIBERO bowl-on-plate scripted expert and its demos in the trajectory format (real LIBERO, no mocks)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from async_vla.config import load_config

pytestmark = [
    pytest.mark.libero,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # a demo episode is ~110 physics steps + 14 renders: minutes on a loaded machine
    pytest.mark.skipif(importlib.util.find_spec("libero") is None or importlib.util.find_spec("robosuite") is None,
                       reason="LIBERO simulator not installed (run bin/install-libero)"),
]


@pytest.fixture(scope="module")
def env():
    from async_vla.envs.libero import LiberoEnv

    e = LiberoEnv(load_config(overrides=["env.kind=libero", "env.suite=spatial", "env.task_ids=[0,1]",
                                         "env.image_size=32", "env.render_at=decision"]).env, seed=0)
    yield e
    e.close()


@pytest.mark.parametrize("task_id, init_state_id", [(0, 5), (1, 9)])
def test_expert_solves_train_init_states_physics_only(env, task_id, init_state_id):
    from async_vla.envs.libero_expert import BowlOnPlateExpert, expert_episode

    observations, actions, success = expert_episode(env, task_id, init_state_id, observe_every=None)
    assert success and env.check_success()
    assert len(observations) == 1 and len(actions) < env.max_steps(task_id)
    bowl, plate = BowlOnPlateExpert.goal_objects(env)
    assert (bowl, plate) == ("akita_black_bowl_1", "plate_1")


def test_demo_roundtrip_in_trajectory_format(env, tmp_path):
    from async_vla.demos import (DEMO_STATS_KEY, demo_action_stats, demos_to_trajectories, load_demos,
                                 record_expert_demos, save_demos, trajectories_to_samples)
    from async_vla.policy.build import default_tokenizer

    cfg = load_config(overrides=["env.kind=libero"])
    demos, report = record_expert_demos(env, [(0, 2)], chunk_size=8)
    assert report["succeeded"] == 1 and len(demos) == 1
    demo = demos[0]
    steps = demo.actions.shape[0]
    assert len(demo.observations) == -(-steps // 8)  # one rendered observation per decision point
    assert all(o.image.std() > 10 for o in demo.observations)  # real frames, not skipped renders
    stats = demo_action_stats(demos)
    np.testing.assert_allclose(stats.q01[:6], np.quantile(demo.actions[:, :6], 0.01, axis=0))
    tok = default_tokenizer(cfg.policy, "libero")
    tok.stats, tok.unnorm_key = {DEMO_STATS_KEY: stats}, DEMO_STATS_KEY
    (traj,) = demos_to_trajectories(demos, tok)
    traj.validate()
    assert traj.token_mask.sum() == steps * 7 and traj.success and traj.env_steps == steps
    # The tokens decode to the expert's actions within half a bin (inside the 1-99% bounds), gripper exact.
    decoded = tok.decode_actions(traj.action_tokens).reshape(-1, 7)[:steps]
    inside = (demo.actions >= stats.q01) & (demo.actions <= stats.q99)
    half_bin = (stats.q99 - stats.q01) / 255
    assert np.all(np.abs(decoded - demo.actions)[:, :6][inside[:, :6]] <= np.broadcast_to(half_bin[:6], (steps, 6))[inside[:, :6]] + 1e-6)
    np.testing.assert_allclose(decoded[:, 6], demo.actions[:, 6], atol=1e-2)
    save_demos(tmp_path, [traj], stats, {"chunk_size": 8})
    (back,), back_stats, info = load_demos(tmp_path)
    np.testing.assert_array_equal(back.action_tokens, traj.action_tokens)
    np.testing.assert_array_equal(back.images, traj.images)
    np.testing.assert_allclose(back_stats.q99, stats.q99)
    samples = trajectories_to_samples([back])
    assert len(samples) == traj.num_calls and samples.tokens.shape == traj.action_tokens.shape


@pytest.mark.timeout(1800)
def test_pipeline_demos_sft_rl_eval(tmp_path):
    """bin/libero-cpu end to end at toy sizes: one expert demo -> SFT -> two async GRPO versions through real LIBERO
    actors, the buffer and the learner (the run evaluates v2) -> the after-run curve evaluates v0's and v1's exports
    and adds them to the run's record."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    overrides = ["env.task_ids=[0]", "actor.task_ids=[0]", "actor.init_state_ids=[0,1]", "env.image_size=32", "env.max_steps=16", "env.num_eval_init_states=1",
                 "env.envs_per_actor=2", "actor.num_actors=1", "actor.group_size=2", "buffer.groups_per_batch=1",
                 "buffer.dynamic_sampling=false", "run.max_versions=2", "run.eval_every=0", "run.eval_envs=1",
                 "learner.micro_batch_trajectories=2", "transport.trajectory_port=0", "transport.control_port=0",
                 "transport.batch_port=0",
                 "transport.weights_port=0"]
    argv = [sys.executable, str(repo / "bin" / "libero-cpu"), str(repo / "configs" / "libero_cpu.yaml"), *overrides,
            "--out", str(tmp_path), "--per-task", "1", "--demo-workers", "1", "--epochs", "2", "--curve-every", "1",
            "--readout-episodes", "3", "--heldout-variants", "2"]
    # the control at the end replays the run's recording: without one the command stops before any work
    norecord = subprocess.run([*argv, "buffer.record=false"], capture_output=True, text=True, timeout=300, cwd=repo)
    assert norecord.returncode == 2 and "buffer.record=true" in norecord.stderr and not any(tmp_path.iterdir())
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1700, cwd=repo,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    demos = json.loads((tmp_path / "demos" / "demos.json").read_text())
    assert demos["num_demos"] == 1 and demos["episodes"][0][0] == 0 and demos["episodes"][0][1] < 40
    sft = json.loads((tmp_path / "sft" / "sft_metrics.json").read_text())
    import re

    calls = [int(m) for m in re.findall(r"\[demos\] demo task 0 init \d+: \d+ steps, (\d+) decision points", proc.stdout)]
    assert len(calls) == 1 and calls[0] >= 10          # the expert's shortest success is ~96 steps: 12 calls
    assert sft["eval_episodes"] == 1 and sft["sft"]["samples"] == calls[0]   # one SFT sample per decision point
    rl = tmp_path / "rl"
    summary = json.loads((rl / "summary.json").read_text())
    assert summary["final_version"] == 2
    # real LIBERO actors' groups reached the buffer and the learner trained on them, every one accounted for
    ledger = json.loads((rl / "ledger.json").read_text())
    assert ledger["ledger"]["trained"] >= 2 * 2  # 2 versions x 1 group x G=2 real LIBERO trajectories
    assert ledger["received"] == sum(ledger["ledger"].values())
    assert json.loads((rl / "versions.json").read_text())["libero_stack"]["mujoco"] == "2.3.7"
    # the config evaluates only the final version during the run; v0 and v1 are scored afterwards from their exports
    assert [(p["version"], bool(p.get("after_run"))) for p in summary["eval"]] == [(0, True), (1, True), (2, False)]
    assert summary["initial_eval_success"] == summary["eval"][0]["success_rate"]
    assert "--versions 0,1 --record" in proc.stdout   # the after-run bin/eval's command was printed
    # the practised scenes (task 0, init states 0-1), v0 against the final version: sampled, 2 repeats (>= 3
    # episodes), then greedy once per scene, each compared with v0
    for name, temperature, repeats in (("readout_practised", 1.6, 2), ("greedy_practised", 0.0, 1)):
        first, last = json.loads((tmp_path / f"{name}.json").read_text())
        assert (first["version"], last["version"]) == (0, 2) and last["vs_version"] == 0
        for res in (first, last):
            assert res["split"] == "practised" and res["temperature"] == temperature
            assert sorted(o[:2] for o in res["outcomes"]) == sorted([[0, 0], [0, 1]] * repeats)
        assert last["test"] == ("fisher" if temperature else "mcnemar") and 0 <= last["p_one_sided"] <= 1
        assert f"[libero-cpu] {name}: v0 {first['successes']}/{first['episodes']} -> v2" in proc.stdout
    # held-out: init state 49 of task 0 in two pinned scene variants, v0 and v2 paired on each
    parts = [json.loads((tmp_path / "heldout_scenes" / f"variant{k}.json").read_text()) for k in (0, 1)]
    assert [[o[:2] for r in part for o in r["outcomes"]] for part in parts] == [[[0, 49], [0, 49]]] * 2
    assert "env.scene_variant=1" in proc.stdout
    pooled = json.loads((tmp_path / "heldout_scenes.json").read_text())
    assert pooled["scenes"] == 2 and pooled["versions"] == [0, 2] and pooled["variants"] == 2
    assert pooled["successes"] == [sum(part[i]["successes"] for part in parts) for i in (0, 1)]
    # the noise-only control replays the run's recorded mixed groups: 16-step episodes never succeed, so there are
    # none, and the pipeline says so and keeps its readouts
    assert "grad-snr control" in proc.stdout and "no noise-only control: bin/grad-snr control exited" in proc.stdout
    assert not (tmp_path / "control_vs_run.json").exists()
    # with a control's permuted arm in place (here the SFT start itself), it goes through the same readouts and is
    # compared with the final version scene by scene
    import shutil

    shutil.copytree(tmp_path / "sft", tmp_path / "control" / "permuted" / "policy")
    (tmp_path / "control" / "control.json").write_text("{}")
    ctl = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=repo,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ctl.returncode == 0, ctl.stdout[-3000:] + ctl.stderr[-3000:]
    ran = [line for line in ctl.stdout.splitlines() if line.startswith("$ ")]
    assert len(ran) == 4 and all("bin/eval" in c and str(tmp_path / "control" / "permuted" / "policy") in c
                                 for c in ran)                     # sampled, greedy, two held-out variants
    versus = json.loads((tmp_path / "control_vs_run.json").read_text())
    final_sampled = json.loads((tmp_path / "readout_practised.json").read_text())[-1]
    assert versus["readout_practised"]["run"] == [final_sampled["successes"], final_sampled["episodes"]]
    assert versus["readout_practised"]["control"][1] == 4 and 0 <= versus["readout_practised"]["p_one_sided"] <= 1
    assert versus["greedy_practised"]["scenes"] == 2 and versus["heldout_scenes"]["scenes"] == 2
    assert versus["heldout_scenes"]["run"] == pooled["successes"][1]
    assert "the run's final version against its noise-only control" in ctl.stdout
    # the same command again finds every step done: no demos, SFT, training, control or evaluation is run twice
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=repo,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "holds a finished run: not training again" in again.stdout
    assert [line for line in again.stdout.splitlines() if line.startswith("$ ")] == []   # no command ran
    assert json.loads((rl / "summary.json").read_text())["eval"] == summary["eval"]
    # the live control: the run again from its own config with the outcomes shuffled in the loss and the run's
    # number of versions, then through the same readouts against the run's final version
    live = subprocess.run([*argv, "--control", "live"], capture_output=True, text=True, timeout=900, cwd=repo,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert live.returncode == 0, live.stdout[-3000:] + live.stderr[-3000:]
    from async_vla.config import load_config

    control_run = tmp_path / "control_live" / "rl"
    trained = [line for line in live.stdout.splitlines() if line.startswith("$ ") and "bin/train" in line]
    assert len(trained) == 1 and str(rl / "config.yaml") in trained[0]                 # the run's resolved config
    assert trained[0].endswith(f"loss.outcomes=shuffled run.max_versions=2 run.out_dir={control_run.parent} "
                               "run.name=rl")
    assert "grad-snr" not in live.stdout
    control_cfg = load_config(control_run / "config.yaml")
    assert control_cfg.loss.outcomes == "shuffled" and control_cfg.run.max_versions == 2
    assert json.loads((control_run / "summary.json").read_text())["final_version"] == 2
    assert json.loads((control_run / "ledger.json").read_text())["ledger"]["trained"] >= 2 * 2
    live_vs = json.loads((tmp_path / "control_live_vs_run.json").read_text())
    assert live_vs["control"] == str(control_run / "policy")
    assert live_vs["readout_practised"]["run"] == versus["readout_practised"]["run"]
    assert live_vs["greedy_practised"]["scenes"] == 2 and live_vs["heldout_scenes"]["scenes"] == 2
    assert (tmp_path / "control_live" / "heldout_scenes" / "variant1.json").is_file()
    live_again = subprocess.run([*argv, "--control", "live"], capture_output=True, text=True, timeout=600, cwd=repo,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert live_again.returncode == 0 and [ln for ln in live_again.stdout.splitlines() if ln.startswith("$ ")] == []
