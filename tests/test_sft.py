"""SFT bootstrap: demo collection, training, greedy evaluation, rollouts and the bin/sft script."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from async_vla.config import load_config
from async_vla.envs import make_env
from async_vla.envs.expert import expert_episode
from async_vla.policy import build_policy, load_policy
from async_vla.sft import collect_demos, evaluate_greedy, rollout, sft_train, smoothed_targets

REPO = Path(__file__).resolve().parent.parent
SMALL = ["policy.hidden_size=64", "policy.num_heads=2", "policy.num_layers=1", "policy.intermediate_size=128",
         "policy.max_instruction_tokens=12", "env.num_train_init_states=6", "env.num_eval_init_states=3"]


def setup(tasks="[4,7]", small: bool = True):
    cfg = load_config(None, (SMALL if small else SMALL[4:]) + [f"env.task_ids={tasks}"])
    return cfg, make_env(cfg, 0), build_policy(cfg)


def test_collect_demos_shapes_and_padding():
    cfg, env, _ = setup("[0,1]")
    demos, used = collect_demos(env, env.task_ids, 1, 8, seed=3)
    assert [t for t, _ in used] == [0, 1]
    assert all(i in env.init_state_ids(t, "train") for t, i in used)
    n_steps = [len(expert_episode(env, t, i)[1]) for t, i in used]
    assert len(demos) == sum(n_steps)  # one sample per step (all offsets)
    assert demos.images.shape == (len(demos), 32, 32, 3) and demos.images.dtype == np.uint8
    assert demos.proprio.shape == (len(demos), 8) and demos.actions.shape == (len(demos), 8, 7)
    # the last sample of the first demo: one expert step, then "hold" padding keeping the gripper state
    last = demos.actions[n_steps[0] - 1]
    assert np.all(last[1:, :6] == 0) and np.all(last[1:, 6] == last[0, 6])
    sparse, _ = collect_demos(env, env.task_ids, 1, 8, seed=3, all_offsets=False)
    assert len(sparse) == sum((n + 7) // 8 for n in n_steps)


def test_smoothed_targets():
    q = smoothed_targets(torch.tensor([0, 100, 255]), 256, 5.0)
    assert q.shape == (3, 256)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert q.argmax(-1).tolist() == [0, 100, 255]


def test_sft_fits_its_demo_and_evaluates():
    torch.manual_seed(0)
    cfg, env, policy = setup(small=False)  # the default size: the 1-layer test model fits continuous values slowly
    demos, used = collect_demos(env, env.task_ids, 1, 8, seed=0)
    m = sft_train(policy, demos, epochs=150, lr=1e-3, batch_size=4, seed=0)
    assert m["loss_curve"][-1] < 0.25 * m["loss_curve"][0]
    assert m["train_token_accuracy"] > 0.9 and m["optimizer_steps"] == 150 * ((len(demos) + 3) // 4)
    # the policy replays its own demos greedily
    envs = [copy.deepcopy(env) for _ in range(len(used))]
    res = rollout(policy, envs, used, temperature=0.0)
    assert all(r.success for r in res)
    ev = evaluate_greedy(policy, envs, split="eval")
    assert set(ev["by_task"]) == {4, 7} and ev["episodes"] == 6 and 0.0 <= ev["success_rate"] <= 1.0
    assert ev["success_rate"] == pytest.approx(np.mean(list(ev["by_task"].values())))
    single = evaluate_greedy(policy, env, task_ids=[4], split="train")  # one env works too
    assert single["episodes"] == 6 and policy.training is False


def test_rollout_keeps_behaviour_data():
    cfg, env, policy = setup()
    envs = [copy.deepcopy(env) for _ in range(3)]
    res = rollout(policy, envs, [(4, 0), (4, 1), (7, 2)], 1.6, torch.Generator().manual_seed(0), keep_data=True)
    for r in res:
        calls = len(r.observations)
        assert calls == len(r.action_tokens) == len(r.logprobs) >= 1
        assert (calls - 1) * 8 < r.env_steps <= calls * 8 and r.env_steps <= env.max_steps(r.task_id)
        assert r.action_tokens[0].shape == (56,) and np.all(r.logprobs[0] <= 0)
        lp = policy.token_logprobs(r.observations[0].image[None], r.observations[0].proprio[None],
                                   [env.instruction(r.task_id)], torch.from_numpy(r.action_tokens[0][None]), 1.6)
        np.testing.assert_allclose(lp.detach().numpy()[0], r.logprobs[0], atol=1e-5)
    with pytest.raises(ValueError):
        rollout(policy, envs, [(4, 0)], 1.0)


def test_bin_sft_writes_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO / "bin" / "sft"), *SMALL, "env.task_ids=[4]", "--demos", "1", "--epochs", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    # by default it evaluates val and train layouts only: choosing a recipe with bin/sft never shows held-out
    assert "greedy success, val:" in proc.stdout and "greedy success, train" in proc.stdout, proc.stdout
    assert "[sft] training:" not in proc.stdout + proc.stderr   # progress stays out of a log (not a terminal)
    assert "held-out" not in proc.stdout, proc.stdout
    report = json.loads((out / "sft_metrics.json").read_text())
    assert 0.0 <= report["val_success"] <= 1.0 and report["demos_per_task"] == 1 and "eval_success" not in report
    pol = load_policy(out)
    assert pol.policy_cfg.hidden_size == 64
    # bin/eval on the directory evaluates on the tasks it was made on (its config.yaml), not the defaults
    ev = subprocess.run([sys.executable, str(REPO / "bin" / "eval"), str(out)], capture_output=True, text=True,
                        timeout=300, cwd=REPO)
    assert ev.returncode == 0, ev.stderr
    assert f"config: {out / 'config.yaml'}" in ev.stdout and "tasks [4]" in ev.stdout, ev.stdout
    assert [line.split(":")[0].strip() for line in ev.stdout.splitlines() if line.startswith("  task ")] == ["task 4"]
    # ... and on a run directory, its final policy/ with the run's config
    run = tmp_path / "run"
    shutil.copytree(out, run / "policy")
    shutil.copy(out / "config.yaml", run / "config.yaml")
    ev = subprocess.run([sys.executable, str(REPO / "bin" / "eval"), str(run), "--json"], capture_output=True,
                        text=True, timeout=300, cwd=REPO)
    assert ev.returncode == 0, ev.stderr
    doc = json.loads(ev.stdout)
    assert doc["by_task"].keys() == {"4"}, ev.stdout
    # the built-in env's episodes also by the cell of the block the task names: held-out cells only, all counted
    cells = doc["by_cell"]
    assert sum(c["episodes"] for c in cells.values()) == doc["episodes"] > 0
    assert sum(c["successes"] for c in cells.values()) == doc["successes"]
    assert set(cells) <= {f"{i},{j}" for i in range(6) for j in range(4) if (i + 2 * j) % 5 == 0}, cells
    bad = subprocess.run([sys.executable, str(REPO / "bin" / "sft"), "policy.nope=1", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "policy.nope" in bad.stderr
    bad = subprocess.run([sys.executable, str(REPO / "bin" / "sft"), "--eval-splits", "val,heldout", "--out",
                          str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "--eval-splits" in bad.stderr and "heldout" in bad.stderr, bad.stderr


def test_bin_sft_evaluates_held_out_only_when_asked_and_shows_progress_lines_when_asked(tmp_path):
    out = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO / "bin" / "sft"), *SMALL, "env.task_ids=[4]", "--demos", "1", "--epochs", "2",
           "--eval-splits", "eval", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "ASYNC_VLA_PROGRESS": "lines:0"})
    assert proc.returncode == 0, proc.stderr
    assert "greedy success, held-out:" in proc.stdout and "val:" not in proc.stdout, proc.stdout
    # progress lines on stderr (every update with lines:0): the demo, each epoch with its loss, the held-out episodes
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[sft] ")]
    shapes = [re.sub(r"loss \d+\.\d{4}", "loss L", re.sub(r"\d+ successes", "N successes", re.sub(
        r"\d+(m\d\d)?s elapsed", "T elapsed", re.sub(r"ETA \d+(m\d\d)?s", "ETA T", line)))) for line in progress]
    assert shapes == ["[sft] expert demos: 1/1 demos, T elapsed",
                      "[sft] training: 1/2 epochs, loss L, T elapsed, ETA T",
                      "[sft] training: 2/2 epochs, loss L, T elapsed",
                      "[sft] greedy eval, held-out: 3/3 episodes, N successes, T elapsed"], proc.stderr  # one batch
    report = json.loads((out / "sft_metrics.json").read_text())
    assert 0.0 <= report["eval_success"] <= 1.0 and "val_success" not in report


def test_eval_videos_of_the_builtin_env_reach_tensorboard(tmp_path):
    """evaluate_greedy(videos=3) films 3 episodes, each task's first held-out init state first (round-robin), frame = the camera after the
    reset and every env step; the recorder writes each as an animated GIF under eval/video/... at the version."""
    from io import BytesIO

    from PIL import Image

    from async_vla.metrics import VIDEO_MIN_SIDE, Monitor
    from tests.tb_helpers import read_images
    from runner.report import RunRecorder, eval_videos

    cfg, _, policy = setup(tasks="[4,7]")
    envs = [make_env(cfg, s) for s in range(3)]
    res = evaluate_greedy(policy, envs, split="eval", videos=3)
    vids = res["videos"]
    ids = {t: list(envs[0].init_state_ids(t, "eval")) for t in (4, 7)}
    # chosen round-robin (4's first, 7's first, 4's second), listed in the eval's episode order
    assert [(v["task_id"], v["init_state_id"]) for v in vids] == [(4, ids[4][0]), (4, ids[4][1]), (7, ids[7][0])]
    for v in vids:
        assert v["frames"].dtype == np.uint8 and v["frames"].shape[1:] == (32, 32, 3) and len(v["frames"]) > 1
    assert "videos" not in evaluate_greedy(policy, envs, split="eval")   # 0 = off
    assert eval_videos(load_config(None, ["logging.tensorboard=false"])) == 0
    monitor = Monitor(tmp_path)
    RunRecorder(cfg, tmp_path, monitor).eval_result(5, res)
    monitor.close()
    [(step, gif)] = read_images(tmp_path / "tb", f"eval/video/task7_init{ids[7][0]}")
    img = Image.open(BytesIO(gif))
    assert step == 5 and img.format == "GIF" and img.size == (VIDEO_MIN_SIDE, VIDEO_MIN_SIDE)  # 32 px x 4
    # Pillow merges identical consecutive frames (a robot standing still) into one longer frame: the play time
    # is what stays, 1000 / fps ms per env step
    durations = []
    for i in range(img.n_frames):
        img.seek(i)
        durations.append(img.info["duration"])
    want_ms = len(vids[2]["frames"]) * 1000 / cfg.logging.eval_video_fps
    assert 1 < img.n_frames <= len(vids[2]["frames"]) and abs(sum(durations) - want_ms) <= 10 * img.n_frames  # 10 ms units
    last = np.asarray(img.convert("RGB"))[::4, ::4]
    np.testing.assert_allclose(last.astype(int), vids[2]["frames"][-1].astype(int), atol=24)  # GIF palette


def test_long_videos_keep_every_nth_frame_and_the_last():
    from async_vla.metrics import VIDEO_MAX_FRAMES, video_frames

    frames = np.zeros((451, 200, 200, 3), dtype=np.uint8)
    frames[:, 0, 0, 0] = np.arange(451) % 256
    shown, stride = video_frames(frames)
    assert stride == 4 and len(shown) <= VIDEO_MAX_FRAMES + 1 and shown.shape[1:] == (200, 200, 3)
    assert shown[-1, 0, 0, 0] == 450 % 256 and shown[1, 0, 0, 0] == 4
    with pytest.raises(ValueError, match="uint8"):
        video_frames(frames.astype(np.float32))


def test_cosine_schedule_scales_each_step_and_a_bad_schedule_is_named():
    """Two optimizer steps (one batch of every sample per epoch): the first at the full rate under both schedules,
    the second at half the rate under cosine (0.5 * (1 + cos(pi / 2))). Adam's step is proportional to the rate, so
    the second step moves the weights half as far as under a constant rate."""
    def trained(epochs: int, schedule: str):
        torch.manual_seed(0)
        cfg, env, policy = setup()
        demos, _ = collect_demos(env, env.task_ids, 1, 8, seed=0)
        sft_train(policy, demos, epochs=epochs, lr=1e-3, batch_size=len(demos), seed=0, lr_schedule=schedule)
        return torch.cat([p.detach().flatten() for p in policy.parameters()])

    after_one = trained(1, "constant")
    torch.testing.assert_close(trained(1, "cosine"), after_one)
    ratio = float((trained(2, "cosine") - after_one).norm() / (trained(2, "constant") - after_one).norm())
    assert 0.4 < ratio < 0.6
    cfg, env, policy = setup()
    demos, _ = collect_demos(env, env.task_ids, 1, 8, seed=0)
    with pytest.raises(ValueError, match="lr_schedule"):
        sft_train(policy, demos, epochs=1, lr_schedule="linear")


def test_after_epoch_stops_training_where_the_full_schedule_stood():
    """An epoch hook that evaluates greedily leaves training bit-identical, and stopping at epoch k keeps the
    weights the full cosine schedule had after epoch k (the rate is not re-planned)."""
    def flat(policy):
        return torch.cat([p.detach().flatten() for p in policy.parameters()])

    def run(hook_factory):
        torch.manual_seed(0)
        cfg, env, policy = setup()
        demos, _ = collect_demos(env, env.task_ids, 1, 8, seed=0)
        hook, seen = hook_factory(policy, env)
        m = sft_train(policy, demos, epochs=4, lr=1e-3, batch_size=4, seed=0, lr_schedule="cosine", after_epoch=hook)
        return m, flat(policy), seen

    def snapshots(policy, env):
        seen = {}

        def hook(epoch):
            evaluate_greedy(policy, env, split="val")  # what bin/sft does between epochs
            seen[epoch] = flat(policy)
            return False
        return hook, seen

    def stop_at_2(policy, env):
        calls = []

        def hook(epoch):
            calls.append(epoch)
            return epoch == 2
        return hook, calls

    full, full_weights, seen = run(snapshots)
    plain, plain_weights, _ = run(lambda policy, env: (None, None))
    torch.testing.assert_close(full_weights, plain_weights, rtol=0, atol=0)
    assert sorted(seen) == [1, 2, 3, 4] and full["epochs_run"] == 4 and full["stopped_at_epoch"] is None
    stopped, stopped_weights, calls = run(stop_at_2)
    assert calls == [1, 2] and stopped["epochs_run"] == 2 and stopped["stopped_at_epoch"] == 2
    assert len(stopped["loss_curve"]) == 2 and stopped["optimizer_steps"] == full["optimizer_steps"] // 2
    torch.testing.assert_close(stopped_weights, seen[2], rtol=0, atol=0)
    assert not torch.equal(stopped_weights, full_weights)


def test_bin_sft_stop_at_val_success_records_the_val_curve_and_names_bad_input(tmp_path):
    out = tmp_path / "ckpt"
    # a target no 3-epoch, one-demo policy reaches: it trains every epoch, says so, and keeps the checkpoint
    cmd = [sys.executable, str(REPO / "bin" / "sft"), *SMALL, "env.task_ids=[4]", "--demos", "1", "--epochs", "3",
           "--stop-at-val-success", "1.0", "--val-every", "2", "--eval-splits", "val", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "sft_metrics.json").read_text())
    assert [e for e, _ in report["val_curve"]] == [2, 3], report["val_curve"]  # every 2nd epoch, and the last
    assert report["val_curve"][-1][1] == report["val_success"] < 1.0
    assert report["val_target_reached"] is False and report["sft"]["epochs_run"] == 3
    assert "never reached 1.0" in proc.stderr and (out / "model.safetensors").exists()
    for bad, named in ((["--stop-at-val-success", "0"], "--stop-at-val-success"), (["--val-every", "0"], "--val-every"),
                       (["env.kind=libero", "--stop-at-val-success", "0.3"], "validation split")):
        res = subprocess.run([sys.executable, str(REPO / "bin" / "sft"), *bad, "--out", str(tmp_path / "bad")],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert res.returncode == 2 and named in res.stderr, res.stderr
        assert not (tmp_path / "bad").exists()


def test_sampled_evaluation_repeats_each_init_state_and_bin_eval_checks_its_options(tmp_path):
    """evaluate_greedy(temperature > 0, repeats=N): the rollout-temperature readout, N sampled episodes per init
    state; bin/eval --temperature/--repeats refuses what cannot be meant before loading anything."""
    import subprocess
    import sys
    from collections import Counter

    cfg, env, policy = setup()
    envs = [copy.deepcopy(env) for _ in range(4)]
    greedy = evaluate_greedy(policy, envs, split="eval")
    sampled = evaluate_greedy(policy, envs, split="eval", temperature=1.6, repeats=3,
                              generator=torch.Generator().manual_seed(0))
    assert sampled["episodes"] == 3 * greedy["episodes"] and sampled["temperature"] == 1.6
    counts = Counter((t, i) for t, i, _ in sampled["outcomes"])
    assert set(counts) == {(t, i) for t, i, _ in greedy["outcomes"]} and set(counts.values()) == {3}
    # actor.sampled_dims: every dimension listed is the plain sampled readout, episode for episode
    every = evaluate_greedy(policy, envs, split="eval", temperature=1.6, repeats=3,
                            generator=torch.Generator().manual_seed(0), sampled_dims=range(7))
    assert every["outcomes"] == sampled["outcomes"] and every["sampled_dims"] == list(range(7))
    assert sampled["sampled_dims"] is None
    with pytest.raises(ValueError, match="repeats"):
        evaluate_greedy(policy, envs, split="eval", repeats=0)
    repo = Path(__file__).resolve().parent.parent
    for bad in (["--repeats", "3"], ["--temperature", "-1"], ["--temperature", "1.6", "--versions", "1",
                                                               "--record"]):
        proc = subprocess.run([sys.executable, str(repo / "bin" / "eval"), str(tmp_path), *bad],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and ("--temperature" in proc.stderr or "--record" in proc.stderr), proc.stderr


@pytest.mark.parametrize("bin_sigma", [0.0, 4.0])   # the two losses feed the batch to the model on separate paths
def test_image_shift_trains_on_shifted_demo_images_and_scores_the_plain_ones(bin_sigma):
    """Every image a training step feeds the model is one demo image at one of the (2 * pad + 1)^2 edge-padded crops
    (some not the plain frame); the closing token-accuracy pass sees the demo images unshifted."""
    pad = 1
    cfg, env, policy = setup()
    demos, _ = collect_demos(env, env.task_ids, 1, 8, seed=0)
    seen = []
    model_logits = policy.action_logits

    def recording(images, *args):
        seen.append(torch.as_tensor(images).numpy().copy())
        return model_logits(images, *args)

    policy.action_logits = recording
    sft_train(policy, demos, epochs=2, batch_size=4, seed=0, bin_sigma=bin_sigma, image_shift=pad)
    *train, final = seen
    np.testing.assert_array_equal(final, demos.images)
    h, w = demos.images.shape[1:3]
    padded = np.pad(demos.images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
    crops = {padded[j, dy:dy + h, dx:dx + w].tobytes(): (dy, dx) for j in range(len(demos))
             for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)}
    offsets = [crops.get(img.tobytes()) for batch in train for img in batch]
    assert len(offsets) == 2 * len(demos) and None not in offsets
    assert set(offsets) - {(pad, pad)}


def test_bin_sft_image_shift_is_recorded_and_checked(tmp_path):
    out = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO / "bin" / "sft"), *SMALL, "env.task_ids=[4]", "--demos", "1", "--epochs", "2",
           "--image-shift", "1", "--no-eval", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "sft_metrics.json").read_text())
    assert report["image_shift"] == 1 and report["sft"]["epochs_run"] == 2
    for bad in ("-1", "32"):
        res = subprocess.run([sys.executable, str(REPO / "bin" / "sft"), "--image-shift", bad, "--out",
                              str(tmp_path / "bad")], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert res.returncode == 2 and "--image-shift" in res.stderr, res.stderr
        assert not (tmp_path / "bad").exists()
