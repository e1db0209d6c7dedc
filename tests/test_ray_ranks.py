"""Per-rank learner placement on Ray (runner/ray_ranks.py), the parts that need no cluster: each rank's torchrun-style
variables, its resource request, the placement check against the cluster's nodes, what a rank off the driver's
node is shipped, how the rank group reports a failed or lost rank, and whether a failed group starts again
(ray.learner_restarts). The run itself: tests/test_ray_launcher.py."""

from __future__ import annotations

import pytest
import yaml

from async_vla.config import ConfigError, load_config
from runner.ray_ranks import (RankFailure, RankGroup, check_rank_placement, rank_env, rank_files, rank_request,
                              ranks_that_fit, restart_decision)

GIB = 1024**3


def per_rank(*overrides: str):
    return load_config(None, ["run.launcher=ray", "ray.learner_placement=per_rank", "learner.num_ranks=2",
                              "buffer.groups_per_batch=2", *overrides])


def node(node_id: str, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": resources}


def test_rank_env_is_torchrun_style_for_rank_k():
    assert rank_env(1, 4, "10.0.0.7", 29512) == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",   # its own GPU is device 0
        "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29512"}


def test_default_is_one_learner_actor():
    assert load_config(None, []).ray.learner_placement == "one_actor"


def test_rank_request_leaves_out_what_is_not_asked_for():
    cfg = per_rank("ray.learner_cpus=2", "ray.learner_gpus=1", "ray.learner_memory_gb=1.5",
                   "ray.learner_resources={learner_node: 1}")
    assert rank_request(cfg) == {"CPU": 2, "GPU": 1, "memory": 1.5 * GIB, "learner_node": 1}
    assert rank_request(per_rank()) == {"CPU": 1.0}   # Ray refuses zero amounts in a placement-group bundle


def test_per_rank_with_more_than_one_gpu_per_rank_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"ray.learner_gpus=2.*ray.learner_gpus=1"):
        per_rank("ray.learner_gpus=2")
    with pytest.raises(ConfigError, match="ray.learner_gpus"):   # half a GPU: two ranks could share one
        per_rank("ray.learner_gpus=0.5")
    assert load_config(None, ["ray.learner_gpus=4"]).ray.learner_gpus == 4   # one actor for all ranks: fine


def test_ranks_that_fit_a_node():
    assert ranks_that_fit({"CPU": 1, "GPU": 1}, {"CPU": 16, "GPU": 8}) == 8
    assert ranks_that_fit({"CPU": 1, "learner_node": 1}, {"CPU": 16}) == 0
    assert ranks_that_fit({"CPU": 0.5}, {"CPU": 1.5}) == 3


def test_placement_fits_one_rank_per_node():
    cfg = per_rank("ray.learner_resources={learner_node: 1}")
    check_rank_placement(cfg, [node("head", CPU=3, learner_node=1), node("b", CPU=2, learner_node=1)], "head")


def test_placement_needs_rank_0_on_the_drivers_node():
    cfg = per_rank("ray.learner_gpus=1")
    nodes = [node("cpuhead", CPU=8), node("gpu1", CPU=8, GPU=8)]
    with pytest.raises(ValueError, match=r"rank 0 on the driver's node.*GPU=1.*run bin/train on a node"):
        check_rank_placement(cfg, nodes, "cpuhead")
    check_rank_placement(cfg, nodes, "gpu1")


def test_placement_that_the_cluster_cannot_hold_names_the_fields_and_the_fix():
    cfg = per_rank("learner.num_ranks=4", "buffer.groups_per_batch=4", "ray.learner_gpus=1")
    nodes = [node("head", CPU=8, GPU=1), node("b", CPU=8, GPU=2)]
    with pytest.raises(ValueError, match=r"learner.num_ranks=4.*ray.learner_gpus.*hold 3.*lower learner.num_ranks"):
        check_rank_placement(cfg, nodes, "head")
    dead = dict(node("c", CPU=8, GPU=4), Alive=False)   # a dead node holds nothing
    with pytest.raises(ValueError, match="hold 3"):
        check_rank_placement(cfg, nodes + [dead], "head")
    check_rank_placement(cfg, nodes + [node("c", CPU=8, GPU=1)], "head")


def test_a_rank_elsewhere_gets_its_config_keys_and_deepspeed_json_in_its_own_directory(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    cfg = per_rank("transport.curve=true", f"transport.curve_dir={keys}", f"learner.deepspeed_config={ds}")
    remote = cfg.model_copy(deep=True)
    remote.transport.connect_host = "10.0.0.7"   # what fleet_transport makes of it
    key_files = {"keys/client.key": b"c", "keys/server.key": b"s", "keys/client.key_secret": b"x"}
    files, rank_cfg = rank_files(cfg, remote, "/tmp/w-rank1", key_files, b"s3cret")
    assert set(files) == {"config.yaml", "deepspeed.json", "learner.secret", *key_files}
    assert files["learner.secret"] == b"s3cret"
    shipped = yaml.safe_load(files["config.yaml"])
    assert shipped["transport"]["learner_secret_file"] == "/tmp/w-rank1/learner.secret"
    assert shipped["transport"]["curve_dir"] == "/tmp/w-rank1/keys"
    assert shipped["transport"]["connect_host"] == "10.0.0.7"
    assert shipped["learner"]["deepspeed_config"] == "/tmp/w-rank1/deepspeed.json"
    assert shipped["learner"]["num_ranks"] == 2
    assert cfg.transport.curve_dir == str(keys)   # the launcher's own config is untouched


class FakeRank:
    """A RayProcess as RankGroup sees it."""

    def __init__(self, name: str, state: str = "running", code=None):
        self.name, self._state, self.nodes, self.host = name, state, ["node" + name[-1] * 11], "hostx"
        self.proc = type("P", (), {"returncode": code})()

    def state(self) -> str:
        return self._state

    def tail(self, n: int = 20) -> str:
        return f"log of {self.name}"


def group(*ranks: FakeRank) -> RankGroup:
    g = RankGroup(list(ranks), None, {})
    g.stopped_with: list = []
    g.stop = lambda timeout_s=30.0: g.stopped_with.append(timeout_s)   # no Ray here
    return g


def test_rank_group_runs_until_every_rank_exited_0():
    r0, r1 = FakeRank("rank0"), FakeRank("rank1", "exited", 0)
    g = group(r0, r1)
    assert g.alive()                          # rank 1 finished first: rank 0 is still writing the export
    r0._state, r0.proc.returncode = "exited", 0
    assert not g.alive() and g.proc.returncode == 0 and g.stopped_with == [] and g.failure is None


def test_a_lost_rank_ends_the_run_naming_the_rank_and_its_node(capsys):
    g = group(FakeRank("rank0"), FakeRank("rank1", "dead"))
    assert not g.alive()
    assert g.proc.returncode == 1 and g.stopped_with   # the other ranks are stopped
    out = capsys.readouterr().out
    assert "learner rank 1 on node node11111111 (hostx) was lost" in out
    assert g.tail().startswith("--- rank 1 on node")   # the failed rank's log first
    assert g.failure == RankFailure(1, "node11111111 (hostx)", "was lost (its actor or node died)")


def test_a_rank_exiting_with_an_error_ends_the_run_with_its_code(capsys):
    g = group(FakeRank("rank0", "exited", 0), FakeRank("rank1", "exited", 3))
    assert not g.alive() and g.proc.returncode == 3
    assert "learner rank 1 on node node11111111 (hostx) exited with code 3" in capsys.readouterr().out


def test_a_lost_rank_is_named_before_the_errors_it_caused(capsys):
    g = group(FakeRank("rank0", "exited", 1), FakeRank("rank1", "dead"))   # rank 0's collective with rank 1 broke
    assert not g.alive() and g.proc.returncode == 1
    out = capsys.readouterr().out
    assert "learner rank 1 on node node11111111 (hostx) was lost" in out
    assert "rank 0 on node node00000000 (hostx): exited with code 1" in out


LOST = RankFailure(1, "node11111111 (hostx)", "was lost (its actor or node died)")


def test_learner_restarts_default_to_none_and_need_per_rank_placement():
    assert per_rank().ray.learner_restarts == 0   # a failed rank ends the run unless restarts are asked for
    assert per_rank("ray.learner_restarts=2").ray.learner_restarts == 2
    with pytest.raises(ConfigError, match=r"ray.learner_restarts=1 .*set ray.learner_placement=per_rank"):
        load_config(None, ["ray.learner_restarts=1"])   # one actor starts all ranks itself: nothing restarts them


def test_a_failed_group_restarts_from_the_latest_checkpoint_while_restarts_remain():
    restart, line = restart_decision(LOST, 0, 2, 4)
    assert restart
    assert line.startswith("[train] learner rank 1 on node node11111111 (hostx) was lost (its actor or node died)")
    assert "restart 1 of 2" in line and "from checkpoint v4" in line
    restart, line = restart_decision(LOST, 1, 2, 6)
    assert restart and "restart 2 of 2" in line and "from checkpoint v6" in line


def test_a_group_that_failed_before_any_checkpoint_restarts_from_version_0():
    restart, line = restart_decision(RankFailure(0, "head00000000", "exited with code 3"), 0, 1, None)
    assert restart and "learner rank 0 on node head00000000 exited with code 3" in line
    assert "from the start, version 0 (no checkpoint written yet)" in line


def test_when_restarts_are_used_up_the_run_ends_naming_the_rank_and_its_node():
    restart, line = restart_decision(LOST, 2, 2, 4)
    assert not restart
    assert "learner rank 1 on node node11111111 (hostx) was lost" in line and "the run ends" in line
    assert "ray.learner_restarts=2 used up" in line and "restarting" not in line


def test_without_restarts_a_failed_rank_ends_the_run_as_before():
    restart, line = restart_decision(LOST, 0, 0, 4)
    assert not restart and "the run ends (ray.learner_restarts=0: Ray restarts no learner rank)" in line


def test_a_restart_rewinds_the_run_record_and_the_milestones_to_the_checkpoint(tmp_path):
    """What died with the failed ranks - updates past the checkpoint - leaves the record and the evaluator's queue;
    the next milestone past the checkpoint is scored even where a dropped one had been."""
    from runner.ray_launch import RayRun

    run = RayRun(per_rank("run.eval_every=2", "logging.tensorboard=false", "run.eval_envs=1"), tmp_path, False)
    try:
        for v in (0, 2, 4, 6):
            run.recorder.eval_result(v, {"success_rate": 0.5, "successes": 1, "episodes": 2})
        run.evaluator.version = 6
        milestones = tmp_path / "weights" / "milestones"
        milestones.mkdir(parents=True)
        for v in (4, 8):
            (milestones / f"v{v}.safetensors").write_bytes(b"")
        run.rewind(4)
        assert [p["version"] for p in run.recorder.eval_points] == [0, 2, 4]
        assert run.recorder.resumed_at == [4]
        assert sorted(p.name for p in milestones.iterdir()) == ["v4.safetensors"]   # v8: a dead learner's
        (milestones / "v6.safetensors").write_bytes(b"")   # the restarted learner's v6 is scored again
        assert run.evaluator.next_milestone() == milestones / "v6.safetensors"
    finally:
        run.evaluator.close()
        run.monitor.close()


def test_a_rank_lost_between_two_health_checks_restarts_the_group_not_ends_the_run(tmp_path):
    """The launcher looks at the rank group once per round: a group still running at that look goes on, and the
    round in which a rank is found lost starts the group again, even when the loss shows up right after a look
    that found every rank running (before, a second look in the same round ended the run on it)."""
    from runner.ray_launch import RayRun

    class LostOnSecondLook(RankGroup):
        looks = 0

        def alive(self) -> bool:
            self.looks += 1
            if self.looks == 1:
                return True
            self.failure, self.proc.returncode = LOST, 1
            return False

    run = RayRun(per_rank("logging.tensorboard=false", "run.eval_envs=1"), tmp_path, False)
    try:
        group = LostOnSecondLook([], None, {})
        run.children = {"learner": group}
        restarted = []
        run.restart_ranks = lambda failed: (restarted.append(failed),
                                            run.children.__setitem__("learner", RunningGroup()))
        assert run.learner_stopped() is False and group.looks == 1 and not restarted
        assert run.learner_stopped() is False and restarted == [group] and not run.failed
    finally:
        run.evaluator.close()
        run.monitor.close()


class RunningGroup:
    """The group a restart started: running."""

    def alive(self) -> bool:
        return True
