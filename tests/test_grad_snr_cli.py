"""bin/grad-snr end to end on the built-in env: record groups with a saved policy, then measure them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = ["env.kind=builtin", "env.task_ids=[0,1]", "actor.group_size=4", "actor.temperature=1.6",
             "policy.hidden_size=32", "policy.num_layers=1", "policy.patch_size=8"]


def _bin(*args, check=True):
    proc = subprocess.run([sys.executable, str(REPO / "bin" / "grad-snr"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    from async_vla.config import load_config
    from async_vla.policy import build_policy, save_policy

    tmp = tmp_path_factory.mktemp("snr")
    save_policy(build_policy(load_config(None, OVERRIDES)), tmp / "policy")
    out = tmp / "rec"
    proc = _bin("record", *OVERRIDES, f"policy.path={tmp / 'policy'}", "--groups", 3, "--init-states", "0-1",
                "--envs", 2, "--out", out)
    return out, proc.stdout


def test_record_writes_every_group_round_robin_with_its_outcome(recording):
    out, stdout = recording
    lines = [json.loads(x) for x in (out / "groups.jsonl").read_text().splitlines()]
    assert [(g["task_id"], g["init_state_id"]) for g in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)] * 3
    from async_vla.buffer.recording import iter_recording
    from async_vla.messages import decode

    trajs = [decode(f) for f in iter_recording(out / "recording")]
    assert len(trajs) == 12 * 4
    for g in lines:
        members = [t for t in trajs if t.group_id == g["group_id"]]
        assert len(members) == 4 and sum(t.success for t in members) == g["successes"]
        assert {t.init_state_id for t in members} == {g["init_state_id"]}
    assert "sampled success" in stdout and "groups mixed" in stdout


def test_record_refuses_an_existing_recording_and_a_missing_policy(recording, tmp_path):
    out, _ = recording
    again = _bin("record", *OVERRIDES, f"policy.path={out}", "--groups", 1, "--out", out, check=False)
    assert again.returncode == 2 and "holds a recording already" in again.stderr
    nopolicy = _bin("record", *OVERRIDES, "--groups", 1, "--out", tmp_path / "x", check=False)
    assert nopolicy.returncode == 2 and "policy.path" in nopolicy.stderr


@pytest.fixture(scope="module")
def mixed(recording, tmp_path_factory):
    """The recording with outcomes set so that every group is mixed (members 0 and 1 succeed: the random policy
    rarely succeeds); the tokens, images and log-probs stay those the policy sampled."""
    import shutil

    from async_vla.buffer.recording import Recorder, iter_recording
    from async_vla.messages import decode, encode

    src, _ = recording
    dst = tmp_path_factory.mktemp("mixed")
    for name in ("config.yaml", "meta.json", "groups.jsonl"):
        shutil.copy(src / name, dst / name)
    rec = Recorder(dst / "recording", file_bytes=1 << 30, max_files=10)
    for frames in iter_recording(src / "recording"):
        t = decode(frames)
        win = t.traj_id.endswith(("/m0", "/m1"))
        rec.write(0.0, encode(dataclasses.replace(t, success=win, reward=float(win))))
    rec.close()
    wins = [decode(f).success for f in iter_recording(dst / "recording")]
    assert 0 < sum(wins) < len(wins)
    return dst


def test_measure_reports_every_problem_and_aggregation(mixed):
    _bin("measure", mixed, "--batch-sizes", "1,2", "--permutations", 20, "--threads", 1)
    report = json.loads((mixed / "snr.json").read_text())
    names = {r["problem"] for r in report["problems"]}
    assert {"all", "task0", "task1", "all_s1", "task0_s1", "task1_s1"} <= names
    full = [r for r in report["problems"] if r["problem"] == "all"]
    assert {r["aggregation"] for r in full} == {"token_mean", "seq_mean_token_mean"}
    for r in full:
        assert r["mixed_groups"] == 12 and np.isfinite(r["rho"]) and 0 < r["p_value"] <= 1
        assert [c["k"] for c in r["by_batch_size"]] == [1, 2]
    assert "| all | token_mean | 12 / 12 |" in (mixed / "snr.md").read_text()
    for agg in ("token_mean", "seq_mean_token_mean"):   # 12 groups over 4 cells: 12 same-state pairs
        p = report["projections"][agg]
        assert p["relations"]["same_state"]["pairs"] == 12 and p["relations"]["other_task"]["pairs"] == 36
        assert {(x["tasks"], x["states"]) for x in p["projected"]} >= {(1, 1), (5, 40)}


def test_control_trains_both_arms_the_same_steps_and_saves_their_policies(mixed, tmp_path):
    from async_vla.policy import load_policy

    out = tmp_path / "control"
    _bin("control", mixed, "--steps", 3, "--groups-per-step", 2, "--out", out, "--threads", 1)
    report = json.loads((out / "control.json").read_text())
    assert report["steps"] == 3 and report["groups_per_step"] == 2
    for arm in ("real", "permuted"):
        assert [c["version"] for c in report["arms"][arm]["curve"]] == [1, 2, 3]
        load_policy(out / arm / "policy")
    # the arms start from one policy and see the same groups: only the outcomes' order differs, so they end apart
    a, b = (load_policy(out / arm / "policy").state_dict() for arm in ("real", "permuted"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    # one arm alone is that arm as trained beside the other (bin/libero-cpu trains only the permuted one)
    _bin("control", mixed, "--steps", 3, "--groups-per-step", 2, "--out", tmp_path / "alone", "--threads", 1,
         "--arms", "permuted")
    assert not (tmp_path / "alone" / "real").exists()
    assert list(json.loads((tmp_path / "alone" / "control.json").read_text())["arms"]) == ["permuted"]
    c = load_policy(tmp_path / "alone" / "permuted" / "policy").state_dict()
    assert all(torch.equal(b[k], c[k]) for k in b)
    bad = _bin("control", mixed, "--arms", "fake", "--out", tmp_path / "z", check=False)
    assert bad.returncode == 2 and "--arms" in bad.stderr
    too_many = _bin("control", mixed, "--steps", 7, "--groups-per-step", 2, "--out", tmp_path / "x", check=False)
    assert too_many.returncode == 2 and "need 14 mixed groups" in too_many.stderr
    no_summary = _bin("control", mixed, "--out", tmp_path / "y", check=False)
    assert no_summary.returncode == 2 and "--steps" in no_summary.stderr


def test_action_logprobs_are_the_learners_at_the_recorded_tokens_and_keep_only_the_asked_dimensions(recording):
    from async_vla.buffer.recording import iter_recording
    from async_vla.config import load_config
    from async_vla.gradsnr import trajectory_action_logprobs
    from async_vla.messages import decode
    from async_vla.policy import load_policy

    out, _ = recording
    policy = load_policy(load_config(out / "config.yaml").policy.path)
    policy.eval()
    traj = decode(next(iter(iter_recording(out / "recording"))))
    logp, dim_of = trajectory_action_logprobs(policy, traj, 1.6)
    mask = np.asarray(traj.token_mask, dtype=bool)
    assert logp.shape[0] == dim_of.shape[0] == mask.sum() and set(dim_of.tolist()) == set(range(7))
    with torch.no_grad():   # at the recorded tokens: the learner's token log-probs
        learner = policy.token_logprobs(torch.tensor(traj.images), torch.tensor(traj.proprio, dtype=torch.float32),
                                        [traj.instruction] * traj.num_calls, torch.tensor(traj.action_tokens), 1.6)
    taken = policy.tokenizer.token_to_index(np.asarray(traj.action_tokens))[mask]
    np.testing.assert_allclose(logp[np.arange(len(taken)), taken], learner.numpy()[mask], rtol=1e-5, atol=1e-6)
    some, some_dims = trajectory_action_logprobs(policy, traj, 1.6, dims=[1, 6])
    np.testing.assert_array_equal(some, logp[np.isin(dim_of, [1, 6])])
    assert set(some_dims.tolist()) == {1, 6}


def test_sharpness_compares_policies_with_the_start_on_the_recorded_observations(mixed, tmp_path):
    from async_vla.buffer.recording import iter_recording
    from async_vla.config import load_config
    from async_vla.messages import decode

    start = load_config(mixed / "config.yaml").policy.path
    _bin("control", mixed, "--steps", 2, "--groups-per-step", 2, "--out", tmp_path / "ctl", "--threads", 1)
    _bin("sharpness", mixed, "--policy", f"again={start}", "--policy", f"real={tmp_path / 'ctl' / 'real' / 'policy'}",
         "--threads", 1)
    report = json.loads((mixed / "sharpness.json").read_text())
    positions = sum(int(np.asarray(decode(f).token_mask).sum()) for f in iter_recording(mixed / "recording"))
    by = report["policies"]
    assert list(by) == ["start", "again", "real"] and report["trajectories"] == 48
    assert by["start"]["all"]["positions"] == positions and by["start"]["all"]["mode_agreement"] == 1.0
    assert by["again"]["all"] == by["start"]["all"]              # the start saved under another name
    assert by["real"]["all"]["abs_mean_shift"] > 0 == by["again"]["all"]["abs_mean_shift"]   # two updates moved it
    assert sorted(map(int, by["real"]["by_dim"])) == list(range(7))        # no actor.sampled_dims: every dimension
    assert sum(d["positions"] for d in by["real"]["by_dim"].values()) == positions
    bad = _bin("sharpness", mixed, "--policy", f"x={tmp_path / 'nowhere'}", check=False)
    assert bad.returncode == 2 and "not a saved policy directory" in bad.stderr
    for args, why in ((["--policy", f"start={start}"], "not 'start'"), ([], "--policy NAME=POLICY_DIR"),
                      (["--policy", f"a={start}", "--policy", f"a={start}"], "distinct")):
        proc = _bin("sharpness", mixed, *args, check=False)
        assert proc.returncode == 2 and why in proc.stderr
