"""run.serial_lag: serial mode whose actor samples with the weights of k versions ago (deterministic staleness)."""

import json

import pytest

from async_vla.config import ConfigError, load_config
from runner.serial import run_serial

SMALL = ["run.mode=serial", "env.num_train_init_states=4", "env.num_eval_init_states=1", "env.task_ids=[0,3]",
         "buffer.groups_per_batch=2", "actor.group_size=4", "buffer.dynamic_sampling=false",
         "learner.micro_batch_trajectories=8", "policy.hidden_size=64", "policy.num_heads=2", "policy.num_layers=1",
         "policy.intermediate_size=128", "run.eval_every=0", "logging.tensorboard=false"]


def test_lag_beyond_eta_is_a_config_error():
    with pytest.raises(ConfigError, match="run.serial_lag"):
        load_config(None, SMALL + ["run.serial_lag=3", "buffer.max_staleness=2"])
    with pytest.raises(ConfigError, match="only applies to run.mode=serial"):
        load_config(None, SMALL + ["run.serial_lag=1", "buffer.max_staleness=2", "run.mode=async"])


@pytest.mark.parametrize("lag", [0, 2])
def test_trained_data_is_exactly_lag_versions_old(tmp_path, lag):
    cfg = load_config(None, SMALL + [f"run.serial_lag={lag}", "buffer.max_staleness=2", "run.max_versions=6",
                                     f"run.out_dir={tmp_path}"])
    summary = run_serial(cfg, tmp_path / "run")
    assert summary["final_version"] == 6
    hist = json.loads((tmp_path / "run" / "ledger.json").read_text())["lag_histogram"]
    # versions 1 .. lag are trained on data from v0 (lag grows 0, 1, .. up to `lag`), then always exactly `lag`
    expected = {str(k): 2 * 4 for k in range(lag)}
    expected[str(lag)] = (6 - lag) * 2 * 4
    assert hist == expected
