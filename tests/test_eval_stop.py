"""The run's evaluation record: the final evaluation with its episodes and interval, and a stop on
run.target_success only once a second, disjoint held-out set confirms it (serial mode, scripted evaluations)."""

import os
import signal

import pytest

import async_vla.sft
from async_vla.config import ConfigError, load_config
from runner.serial import run_serial

SMALL = ["run.mode=serial", "env.num_train_init_states=4", "env.num_eval_init_states=3", "env.task_ids=[0,3]",
         "buffer.groups_per_batch=1", "actor.group_size=2", "buffer.dynamic_sampling=false",
         "learner.micro_batch_trajectories=8", "policy.hidden_size=32", "policy.num_heads=2", "policy.num_layers=1",
         "policy.intermediate_size=64", "run.eval_every=1", "logging.tensorboard=false", "run.max_versions=6"]


def scripted(eval_rates, confirm_rates, calls):
    """An evaluate_greedy that returns the next scripted rate of its split (6 episodes each) and logs the call."""
    rates = {"eval": list(eval_rates), "confirm": list(confirm_rates)}

    def evaluate_greedy(policy, envs, task_ids=None, split="eval", **_):
        calls.append(split)
        rate = rates[split].pop(0)
        return {"success_rate": rate, "successes": round(6 * rate), "episodes": 6, "split": split,
                "by_task": {0: rate, 3: rate}, "env_steps": 0, "wall_s": 0.0}
    return evaluate_greedy


def test_target_stops_only_when_the_confirmation_holds(tmp_path, monkeypatch):
    calls = []
    # v0 .. v3 on the eval split; v1 and v3 reach the target; the confirmation of v1 fails, that of v3 holds
    monkeypatch.setattr(async_vla.sft, "evaluate_greedy",
                        scripted([0.0, 1.0, 0.5, 1.0], [0.5, 5 / 6], calls))
    cfg = load_config(None, SMALL + ["run.target_success=0.8", "run.seed=7", f"run.out_dir={tmp_path}"])
    s = run_serial(cfg, tmp_path / "run")
    assert calls == ["eval", "eval", "confirm", "eval", "eval", "confirm"]
    assert s["final_version"] == 3 and s["stopped_on"] == "target"
    assert [p["version"] for p in s["confirm_evals"]] == [1, 3] and s["version_at_target"] == 3
    fe = s["final_eval"]
    assert (fe["version"], fe["split"], fe["successes"], fe["episodes"]) == (3, "eval", 6, 6)
    assert fe["interval95"][0] == pytest.approx(0.6097, abs=1e-3) and fe["interval95"][1] == 1.0
    assert s["seed"] == 7 and s["budget"] == {"max_wall_s": 600.0, "max_versions": 6, "target_success": 0.8}


def test_without_a_target_the_run_uses_its_budget_and_reports_the_last_eval(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(async_vla.sft, "evaluate_greedy", scripted([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5], [], calls))
    cfg = load_config(None, SMALL + [f"run.out_dir={tmp_path}"])
    s = run_serial(cfg, tmp_path / "run")
    assert calls == ["eval"] * 7 and s["stopped_on"] == "budget" and s["final_version"] == 6
    assert s["final_eval"]["success"] == 0.5 and s["best_eval_success"] == 1.0  # final, not best


def test_eval_split_val_and_target_rules():
    assert load_config(None, ["run.eval_split=val"]).run.eval_split == "val"
    with pytest.raises(ConfigError, match="run.target_success"):
        load_config(None, ["run.eval_split=val", "run.target_success=0.9"])
    with pytest.raises(ConfigError, match="run.eval_split=val needs"):
        load_config(None, ["env.kind=libero", "run.eval_split=val"])


def test_the_wall_budget_ends_a_run_whose_batch_never_forms(tmp_path, monkeypatch):
    """A collapsed policy under dynamic sampling can need thousands of rollouts per batch: run.max_wall_s must end
    the run inside next_batch too. Here no group can ever be admitted (success rates of 2 rollouts are 0, 0.5 or 1,
    none strictly inside the difficulty mask), so without that check the run would roll out forever."""
    calls = []
    monkeypatch.setattr(async_vla.sft, "evaluate_greedy", scripted([0.0, 0.0], [], calls))
    cfg = load_config(None, SMALL + [f"run.out_dir={tmp_path}", "buffer.difficulty_mask=[0.6,0.9]",
                                     "run.max_wall_s=2"])
    s = run_serial(cfg, tmp_path / "run")
    assert s["final_version"] == 0 and s["stopped_on"] == "budget"
    ledger = s["ledger"]
    # rollouts went on until the budget, every complete group was filtered by the mask, no batch was formed
    assert ledger["received"] > 0 and ledger["batches_formed"] == 0, ledger
    assert ledger["ledger"]["trained"] == 0 and ledger["ledger"]["filtered_difficulty"] > 0, ledger


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_a_serial_run_with_its_final_record(tmp_path, monkeypatch, signum):
    """Ctrl-C or a scheduler's SIGTERM ends a serial run as the budget does (final checkpoint, policy, summary),
    not with a traceback and nothing since the last checkpoint; the previous handlers are back afterwards."""
    calls = []
    evaluate = scripted([0.0, 0.5, 1.0], [], calls)

    def signalled_at_version_2(policy, envs, task_ids=None, split="eval", **kw):
        result = evaluate(policy, envs, task_ids, split, **kw)
        if len(calls) == 3:     # evaluations of v0, v1, v2
            os.kill(os.getpid(), signum)
        return result
    monkeypatch.setattr(async_vla.sft, "evaluate_greedy", signalled_at_version_2)
    before = signal.getsignal(signum)
    cfg = load_config(None, SMALL + [f"run.out_dir={tmp_path}", "run.max_versions=100"])
    s = run_serial(cfg, tmp_path / "run")
    assert s["stopped_on"] == "signal" and s["final_version"] == 2 and calls == ["eval"] * 3
    assert s["final_eval"]["version"] == 2 and s["final_eval"]["success"] == 1.0
    assert (tmp_path / "run" / "policy" / "async_vla_policy.json").is_file()
    assert any((tmp_path / "run" / "checkpoints").iterdir())
    assert signal.getsignal(signum) is before


def test_a_stop_signal_ends_rollouts_whose_batch_never_forms(tmp_path, monkeypatch):
    """The signal is seen between two groups too: here no batch can form (as in the wall-budget test above), and a
    SIGINT during the third group's rollouts ends the run with no version trained and the run's record written."""
    from actors.actor import SerialActor

    calls, groups = [], []
    monkeypatch.setattr(async_vla.sft, "evaluate_greedy", scripted([0.0, 0.0], [], calls))
    run_one_group = SerialActor.run_one_group

    def signalled_at_group_3(self, *args, **kw):
        groups.append(1)
        if len(groups) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return run_one_group(self, *args, **kw)
    monkeypatch.setattr(SerialActor, "run_one_group", signalled_at_group_3)
    cfg = load_config(None, SMALL + [f"run.out_dir={tmp_path}", "buffer.difficulty_mask=[0.6,0.9]"])
    s = run_serial(cfg, tmp_path / "run")
    assert s["stopped_on"] == "signal" and s["final_version"] == 0 and len(groups) == 3
    assert s["ledger"]["batches_formed"] == 0 and s["ledger"]["received"] == 3 * 2


def test_a_second_ctrl_c_ends_the_clean_stop_at_once(tmp_path, monkeypatch, capfd):
    """The first Ctrl-C asks for a clean stop (and says how to skip it); a second one during that stop's
    checkpoint raises KeyboardInterrupt there: no summary is written, and the previous handler is back."""
    from learner.torch_engine import TorchLearner

    calls, saves = [], []
    evaluate = scripted([0.0, 0.5, 1.0], [], calls)

    def signalled_at_version_2(policy, envs, task_ids=None, split="eval", **kw):
        result = evaluate(policy, envs, task_ids, split, **kw)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return result
    save = TorchLearner.save_checkpoint

    def impatient_save(self, *args, **kw):
        saves.append(self.version)
        os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C again while the clean stop writes its checkpoint
        return save(self, *args, **kw)
    monkeypatch.setattr(async_vla.sft, "evaluate_greedy", signalled_at_version_2)
    monkeypatch.setattr(TorchLearner, "save_checkpoint", impatient_save)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    cfg = load_config(None, SMALL + [f"run.out_dir={tmp_path}", "run.max_versions=100", "run.checkpoint_every=0"])
    with pytest.raises(KeyboardInterrupt):
        run_serial(cfg, tmp_path / "run")
    assert calls == ["eval"] * 3 and saves == [2]
    assert not (tmp_path / "run" / "summary.json").exists()
    assert {s: signal.getsignal(s) for s in before} == before
    assert "SIGINT: stopping cleanly" in capfd.readouterr().err
