"""Device placement (the `placement` section): what CUDA_VISIBLE_DEVICES / device bin/train gives the learner, each
actor and the evaluator, checked on CPU in the commands the launcher and the fleet record and in what the child
processes actually see."""

import io
import sys
import time
from pathlib import Path

import pytest

from async_vla.config import ConfigError, load_config, write_resolved
from async_vla.placement import actor_env, evaluator_device, learner_env

PLACED = ["learner.num_ranks=2", "placement.gpus_learner=[0,1]", "placement.gpus_actors=[2,3]",
          "placement.gpu_evaluator=3"]


def test_each_role_gets_its_devices_renumbered_through_the_launchers_own_view():
    cfg = load_config(None, PLACED)
    assert learner_env(cfg, {}) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert [actor_env(cfg, i, {})["CUDA_VISIBLE_DEVICES"] for i in range(5)] == ["2", "3", "2", "3", "2"]
    assert evaluator_device(cfg) == "cuda:3"
    parent = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}                    # the launcher itself sees GPUs 4-7 only
    assert learner_env(cfg, parent) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert actor_env(cfg, 1, parent) == {"CUDA_VISIBLE_DEVICES": "7"}
    with pytest.raises(ValueError, match="placement.gpus_actors names GPU 3 but this process sees only 2"):
        actor_env(cfg, 1, {"CUDA_VISIBLE_DEVICES": "4,5"})
    unplaced = load_config(None, [])
    assert learner_env(unplaced, parent) == {} and actor_env(unplaced, 0, parent) == {}
    assert evaluator_device(unplaced) is None


@pytest.mark.parametrize("overrides,match", [
    (["learner.num_ranks=2", "placement.gpus_learner=[0]"], "one GPU per rank"),
    (["learner.num_ranks=2", "placement.gpus_learner=[1,1]"], "names a GPU twice"),
    (["placement.gpus_actors=[]"], "non-empty list"),
    (["placement.gpus_actors=[-1]"], "non-empty list"),
])
def test_bad_placements_fail_at_load_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_preflight_refuses_a_placement_the_host_cannot_hold(tmp_path, monkeypatch):
    from runner.preflight import _placement

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config(None, PLACED)
    assert "has none" in _placement(cfg, tmp_path / "absent")[0]
    gpus = tmp_path / "gpus"
    for i in range(4):
        (gpus / f"0000:0{i}:00.0").mkdir(parents=True)
    assert _placement(cfg, gpus) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "sees 2 GPU(s)" in _placement(cfg, gpus)[0]
    assert _placement(load_config(None, []), tmp_path / "absent") == []      # nothing placed: nothing needed


def test_the_launcher_starts_the_learner_with_its_ranks_gpus(tmp_path, monkeypatch):
    """runner.launch's real start-up sequence with the processes recorded instead of started."""
    import runner.launch as launch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    started = {}

    class Recorded:
        def __init__(self, name, argv, run_dir, env=None, cores=None):
            started[name] = (argv, dict(env or {}))

    monkeypatch.setattr(launch, "Child", Recorded)
    monkeypatch.setattr(launch, "buffer_stats", lambda *a, **k: {})
    cfg = load_config(None, PLACED + ["transport.trajectory_port=0", "transport.control_port=0",
                                      "transport.batch_port=0"])
    launch._start_children({}, cfg, tmp_path, tmp_path / "config.yaml", False, lambda: False)
    assert started["learner"][1] == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert "CUDA_VISIBLE_DEVICES" not in started["buffer"][1] and "CUDA_VISIBLE_DEVICES" not in started["actors"][1]


def test_a_child_records_and_gets_its_devices(tmp_path):
    from runner.launch import Child

    child = Child("learner", [sys.executable, "-c", "import os; print('sees', os.environ['CUDA_VISIBLE_DEVICES'])"],
                  tmp_path, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    child.proc.wait(60)
    child.stop()
    assert "learner: CUDA_VISIBLE_DEVICES=0,1 " in (tmp_path / "commands.txt").read_text()
    assert "sees 0,1" in child.tail()


def test_the_fleet_gives_each_actor_one_gpu_round_robin(tmp_path, monkeypatch):
    from tests.test_fleet import ScriptFleet

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    cfg = load_config(None, ["placement.gpus_actors=[1,2]", "actor.stop_timeout_s=2"])
    cfile = write_resolved(cfg, tmp_path)
    script = ("import os, sys, time; open(os.path.join(sys.argv[1], 'gpu%s' % sys.argv[2]), 'w')"
              ".write(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(60)")
    fleet = ScriptFleet(cfg, cfile, 3, tmp_path, out=io.StringIO(), script=script)
    fleet.start()
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"gpu{i}").exists() for i in range(3)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [(tmp_path / f"gpu{i}").read_text() for i in range(3)] == ["5", "6", "5"]
    finally:
        fleet.stop()
    lines = [ln for ln in (tmp_path / "commands.txt").read_text().splitlines() if " actor" in ln]
    assert [ln.split(": ", 1)[1].split(" ")[0] for ln in lines] == ["CUDA_VISIBLE_DEVICES=5", "CUDA_VISIBLE_DEVICES=6",
                                                                    "CUDA_VISIBLE_DEVICES=5"]


@pytest.mark.parametrize("overrides,shared", [
    ([], "every actor uses GPU 0"),
    (["placement.gpus_learner=[0]", "placement.gpus_actors=[0,1]", "actor.num_actors=2"], "learner rank 0's GPU 0"),
    (["placement.gpus_learner=[0]", "placement.gpus_actors=[1]", "actor.num_actors=2"], "2 actors"),
    (["placement.gpus_learner=[0,1]", "learner.num_ranks=2", "placement.gpus_actors=[2,3]", "actor.num_actors=2"], None),
    (["placement.gpus_actors=[1]", "run.launcher=ray"], None),                 # Ray places actors itself
    (["transport.host=10.0.0.5", "transport.curve=true", "transport.curve_dir=keys",
      "transport.weights_allowed_peers=[10.0.0.0/24]"], None),              # multi-host (the Slurm script)
])
def test_weights_auto_broadcasts_over_gloo_when_two_members_share_a_gpu(overrides, shared):
    """NCCL refuses two ranks on one device ("invalid usage" on a one-GPU H200 host, learner and actor on GPU 0):
    weights.backend=auto then takes gloo, nccl only when every member has a GPU of its own."""
    from async_vla.placement import shared_weight_gpu
    from async_vla.weights.wire import resolve_backend

    cfg = load_config(None, overrides)
    reason = shared_weight_gpu(cfg)
    assert (reason is None) if shared is None else (shared in reason)
    assert resolve_backend(cfg, cuda_available=True) == ("nccl" if shared is None else "gloo")
    assert resolve_backend(cfg, cuda_available=False) == "gloo"
    pinned = load_config(None, overrides + ["weights.backend=nccl"])
    assert resolve_backend(pinned, cuda_available=True) == "nccl"        # what the user asked for, checked below


def test_preflight_refuses_nccl_weights_on_a_shared_gpu(tmp_path):
    from runner.preflight import preflight

    cfg = load_config(None, ["weights.backend=nccl", "transport.trajectory_port=0", "transport.control_port=0",
                             "transport.batch_port=0", "transport.weights_port=0"])
    errors, _ = preflight(cfg, tmp_path / "run", False)
    assert any("weights.backend=nccl" in e and "placement.gpus_actors" in e for e in errors), errors
    ok = load_config(None, ["transport.trajectory_port=0", "transport.control_port=0", "transport.batch_port=0",
                            "transport.weights_port=0"])
    assert not any("weights.backend" in e for e in preflight(ok, tmp_path / "run", False)[0])


def test_a_learner_rank_gets_its_own_gpu_or_the_cpu():
    from async_vla.placement import learner_rank_device

    assert [learner_rank_device(r, 4) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert learner_rank_device(3, 0) == "cpu"
    with pytest.raises(ValueError, match="LOCAL_RANK=2 sees 2 GPU.*placement.gpus_learner"):
        learner_rank_device(2, 2)


RANK_CHILD = """
import json, sys
from pathlib import Path
from async_vla.config import load_config
from learner.__main__ import RankRun
r = RankRun(load_config(None, json.loads(sys.argv[1])), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
print("PLACEMENT " + json.dumps(r.learner.placement), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [3, 0])
def test_each_rank_builds_the_policy_where_it_should_and_holds_its_share(tmp_path, stage):
    """Three learner ranks (bin/learner's RankRun, gloo on CPU) start from an OpenVLA-OFT checkpoint directory. Each
    records the device it claimed (its LOCAL_RANK's; the CPU here), where it built the policy and the parameter bytes
    it holds: under ZeRO-3 the policy is built on the CPU and each rank then holds a third of it (no device ever
    holds it whole); under ZeRO-0 each rank builds it on its own device and holds it whole."""
    import json
    import os
    import socket
    import subprocess

    from tests.openvla_standin import write_standin_checkpoint

    write_standin_checkpoint(tmp_path / "ckpt", oft=True, norm_stats={"builtin": {
        "action": {"q01": [-1.0] * 7, "q99": [1.0] * 7}}})
    world = 3
    overrides = ["policy.arch=openvla_oft", f"policy.path={tmp_path / 'ckpt'}", "policy.decoding=parallel",
                 f"learner.num_ranks={world}", f"learner.zero_stage={stage}", "learner.zero3_persistence_threshold=0",
                 "logging.tensorboard=false", "buffer.groups_per_batch=3"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_CHILD, json.dumps(overrides), str(tmp_path / "run"),
                                       str(r), str(world)], env=env, cwd=root, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    records = []
    for p in procs:
        out, err = p.communicate(timeout=540)
        assert p.returncode == 0, err[-3000:]
        records.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("PLACEMENT "))[10:]))
    assert [rec["local_rank"] for rec in records] == [0, 1, 2]
    assert all(rec["device"] == "cpu" for rec in records)             # what each rank claimed: no CUDA here
    full = records[0]["param_bytes"]
    assert full > 4_000_000 and all(rec["param_bytes"] == full for rec in records)   # the same model everywhere
    if stage == 3:
        assert all(rec["built_on"] == "cpu" for rec in records)
        for rec in records:   # a third each, up to ZeRO's padding of each parameter to a multiple of the world
            assert full / world <= rec["param_bytes_here"] <= full / world * 1.02, rec
    else:
        assert all(rec["built_on"] == rec["device"] and rec["param_bytes_here"] == full for rec in records)
