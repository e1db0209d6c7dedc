"""bin/slurm: the heterogeneous-job script rendered for a shipped config is valid bash, passes shellcheck, and runs
the same commands as by hand with the config inside it (no shared filesystem)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from async_vla.config import load_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("slurm") / "libero_spatial.sbatch"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, str(REPO / "bin" / "slurm"), str(REPO / "configs" / "libero_spatial.yaml"),
                    "--actor-nodes", "4", "--actors-per-node", "6", "--learner-gpus", "8", "-o", str(out)],
                   check=True, env=env, capture_output=True, text=True)
    return out, out.read_text()


def test_rendered_script_passes_shellcheck(script):
    path, _ = script
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing: bin/test installs it (apt-get install shellcheck)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck; bin/test does)")
    res = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_rendered_script_is_a_heterogeneous_job_of_the_configs_run(script):
    _, text = script
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    split = directives.index("#SBATCH hetjob")
    learner_part, actor_part = directives[:split], directives[split + 1:]
    assert "#SBATCH --gpus-per-node=8" in learner_part and "#SBATCH --nodes=1" in learner_part
    assert "#SBATCH --nodes=4" in actor_part
    assert "#SBATCH --time=2-01:00:00" in directives          # run.max_wall_s (48 h) + 1 h for the ending
    # The config travels inside the script, as the resolved config with the learner ranks set.
    body = text.split("<<'ASYNC_VLA_CONFIG'\n", 1)[1].split("\nASYNC_VLA_CONFIG\n", 1)[0]
    inside = yaml.safe_load(body)
    # Slurm hands out the devices: the one-host placement section is cleared.
    cfg = load_config(REPO / "configs" / "libero_spatial.yaml",
                      ["placement.gpus_learner=null", "placement.gpus_actors=null", "placement.gpu_evaluator=null",
                       "learner.num_ranks=8", "transport.weights_fetch_port=5558"])   # the buffer serves exports
    assert inside == cfg.model_dump(mode="json")
    assert inside["placement"] == {"gpus_learner": None, "gpus_actors": None, "gpu_evaluator": None}
    # The weight store's allow-list comes from the actor nodes of this job (required beyond loopback).
    assert '"transport.weights_allowed_peers=[$ACTOR_PEERS]"' in text
    assert '"$SLURM_JOB_NODELIST_HET_GROUP_1"' in text.split("ACTOR_PEERS=", 1)[1].split("\n", 1)[0]
    for command in ('"$REPO/bin/buffer" "$CONFIG"', '"$REPO/bin/learner" "$CONFIG"', "--ranks 8",
                    '"$0/bin/actors" "$1/config.yaml" "transport.connect_host=$2"', "--num 6", "--het-group=1",
                    '--first-id "$((SLURM_PROCID * 6))"', "weights.fetch=true", '"$REPO" "$ACTOR_DIR" "$LEARNER_HOST"'):
        assert command in text, command
    # Only the actor side of the keys leaves the learner node.
    bundle = next(line for line in text.splitlines() if "actor-bundle.tar" in line and "tar -C" in line)
    assert "keys/client.key_secret" in bundle and "server.key_secret" not in bundle
    assert "secrets/actors" in bundle and "secrets/learner" not in bundle   # the actors' credential, never the learner's
    assert '"transport.actor_secret_file=$1/secrets/actors"' in text


def test_a_learner_count_that_does_not_divide_the_batch_is_refused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, str(REPO / "bin" / "slurm"), str(REPO / "configs" / "libero_spatial.yaml"),
                          "--learner-gpus", "3", "-o", str(tmp_path / "x.sbatch")], env=env, capture_output=True,
                         text=True)
    assert res.returncode == 2 and "learner.num_ranks (3)" in res.stderr
    assert not (tmp_path / "x.sbatch").exists()
