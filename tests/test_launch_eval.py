"""bin/train's evaluator (runner.evaluator.Evaluator): which weights it scores - a milestone export, the latest
export, or with weights.export=false the learner's final <run>/policy - and that it really loaded them."""

import pytest
import torch

from async_vla.config import load_config
from async_vla.policy import build_policy, save_policy
from async_vla.policy.build import read_policy_version, write_policy_version
from async_vla.weights.export import MILESTONES, export_weights, milestones
from runner.evaluator import Evaluator
from timing import slack

SMALL = ["env.num_train_init_states=2", "env.num_eval_init_states=1", "env.task_ids=[0]", "actor.group_size=2",
         "policy.hidden_size=32", "policy.num_heads=2", "policy.num_layers=1", "policy.intermediate_size=64",
         "run.eval_every=2"]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in build_policy(load_config(None, SMALL)).state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_milestone_then_latest_then_final_policy(tmp_path):
    cfg = load_config(None, SMALL)
    ev = Evaluator(cfg, tmp_path)
    try:
        (tmp_path / "weights" / MILESTONES).mkdir(parents=True)
        (tmp_path / "weights" / MILESTONES / "v9.safetensors").write_bytes(b"left by an earlier part")
        ev.ask_for_milestones()                     # a resumed part: what came after its checkpoint is gone
        assert milestones(tmp_path / "weights") == []

        assert ev.next_milestone() is None
        export_weights(tmp_path / "weights", 2, _weights(2), 0.0, milestone=True)
        export_weights(tmp_path / "weights", 3, _weights(3), 0.0)
        path = ev.next_milestone()
        version, res = ev.evaluate(path=path)
        assert version == 2 and res["episodes"] == 1 and not path.exists()
        assert _same(ev.policy.state_dict(), _weights(2))

        assert ev.final_version() == 3                       # what the final evaluation would score
        assert ev.evaluate()[0] == 3 and _same(ev.policy.state_dict(), _weights(3))
        ev.close_milestones()
        assert not (tmp_path / "weights" / MILESTONES).exists()
    finally:
        ev.close()


def test_without_exports_the_final_policy_is_scored_as_its_version(tmp_path):
    cfg = load_config(None, SMALL + ["weights.export=false"])
    ev = Evaluator(cfg, tmp_path)
    try:
        (tmp_path / "weights").mkdir()              # the publisher makes it, exports or not
        assert ev.evaluate()[0] == 0                # nothing written yet: the initial weights
        assert ev.final_version() == 0              # so a run stopped now does not score v0 twice
        policy = build_policy(cfg)
        policy.load_state_dict(_weights(5))
        save_policy(policy, tmp_path / "policy")
        write_policy_version(tmp_path / "policy", 5)
        assert read_policy_version(tmp_path / "policy") == 5 and ev.final_version() == 5
        assert ev.evaluate()[0] == 5 and _same(ev.policy.state_dict(), _weights(5))
    finally:
        ev.close()


def test_a_failed_start_stops_the_children_already_started(tmp_path, monkeypatch):
    """start_children raising (here: the learner cannot be started) must not leave the buffer running: the
    launcher never got the dict of children, so nothing else would stop it (an orphaned buffer held its ports)."""
    import runner.launch as launch

    started, stopped = [], []

    class FakeChild:
        def __init__(self, name, argv, run_dir, env=None, cores=None):
            if name == "learner":
                raise OSError("cannot start the learner")
            self.name = name
            started.append(name)

        def alive(self):
            return True

        def stop(self, timeout_s=30.0):
            stopped.append(self.name)

    monkeypatch.setattr(launch, "Child", FakeChild)
    monkeypatch.setattr(launch, "buffer_stats", lambda *a, **k: {"received": 0})
    cfg = load_config(None, SMALL)
    with pytest.raises(OSError, match="learner"):
        launch.start_children(cfg, tmp_path, tmp_path / "config.yaml", resume=False)
    assert started == ["buffer"] and stopped == ["buffer"]


def test_a_stalled_run_says_why_once_it_is_clear():
    from runner.launch import STALL_GROUPS, stall_hint

    cfg = load_config(None, SMALL)
    g = cfg.actor.group_size

    def stats(trained, uniform, rate):
        return {"ledger": {"trained": trained, "filtered_uniform": uniform},
                "metrics": {"rollout/success_rate": rate}}

    assert stall_hint(cfg, stats(0, STALL_GROUPS * g - 1, 0.0)) is None          # too early to tell
    assert stall_hint(cfg, stats(8, 10 * STALL_GROUPS * g, 0.0)) is None         # it trains: no hint
    hint = stall_hint(cfg, stats(0, STALL_GROUPS * g, 0.0))
    assert "all failed" in hint and "policy.path" in hint and "buffer.dynamic_sampling" in hint
    assert "all succeeded" in stall_hint(cfg, stats(0, STALL_GROUPS * g, 1.0))
    assert "single outcome" in stall_hint(cfg, stats(0, STALL_GROUPS * g, float("nan")))


def test_the_status_line_says_how_many_episodes_the_rollout_rate_is_over(tmp_path):
    from runner.launch import status_line
    from runner.report import RunRecorder
    from async_vla.metrics import Monitor

    recorder = RunRecorder(load_config(None, SMALL), tmp_path, Monitor(tmp_path, enabled=False))
    line = status_line(recorder, {"metrics": {"rollout/success_rate": 1.0, "rollout/episodes": 2.0}, "ledger": {}})
    assert "rollout success 1.00 (2 ep)" in line
    assert "rollout success -- |" in status_line(recorder, {"metrics": {}, "ledger": {}})   # no stats yet


def test_ctrl_c_while_the_buffer_starts_returns_at_once_with_what_was_started(tmp_path, monkeypatch):
    import time

    import runner.launch as launch

    started = []

    class FakeChild:
        def __init__(self, name, argv, run_dir, env=None, cores=None):
            started.append(name)

        def alive(self):
            return True

    monkeypatch.setattr(launch, "Child", FakeChild)
    monkeypatch.setattr(launch, "buffer_stats", lambda *a, **k: None)     # the buffer never answers
    t0 = time.monotonic()
    children = launch.start_children(load_config(None, SMALL), tmp_path, tmp_path / "config.yaml", resume=False,
                                     should_stop=lambda: True)
    assert list(children) == ["buffer"] and started == ["buffer"] and time.monotonic() - t0 < min(slack(5), 55)   # not the 60 s wait


def test_the_eval_line_says_how_long_the_evaluation_took_and_when_in_the_run(tmp_path, capsys):
    """An H100 run's async evaluations were read as taking 45-52 s beside the learner (docs/GPU.md): that was the
    run's clock when each was recorded; each took a few seconds. The line now says both."""
    from async_vla.metrics import Monitor
    from runner.report import RunRecorder

    recorder = RunRecorder(load_config(None, SMALL), tmp_path, Monitor(tmp_path, enabled=False))
    recorder.wall_offset = 41.0
    recorder.eval_result(10, {"success_rate": 0.52, "successes": 104, "episodes": 200, "wall_s": 3.24, "by_task": {}})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[eval] version 10: greedy eval success 0.520 (200 episodes in 3.2s; run at 41s)"), line
