"""Two CPU ranks, ZeRO-3 over gloo, as real processes (tests/learner_helpers.py ``worker``):

train 2 steps on identical synthetic batches -> every rank's gathered full weights are equal (checksums) ->
save -> one more step -> SIGKILL; then fresh processes resume: same version, bit-equal parameters and
optimizer partitions, and the same third step gives bit-equal weights again. The third batch differs in
size per rank: its loss and gradient norm must equal a single process's on the union of both.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timing import slack

from async_vla.messages import ROOT, Lineage, PolicyTag

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run_ranks(phase: str, ckpt: Path, out: Path, stage: int, world: int = 2, timeout: float = 80) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "learner_helpers.py"), phase, str(ckpt),
                                       str(out), str(stage)], env=env, cwd=str(REPO),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    timeout = min(slack(timeout), 270)   # a hang bound, scaled for a loaded machine (pytest's own limit is 300 s)
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{phase}: ranks did not finish in {timeout} s")
    expected_rc = -9 if phase == "train" else 0
    for p, log in zip(procs, logs):
        assert p.returncode == expected_rc, log[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def test_two_rank_zero3_equal_weights_and_bit_equal_resume(tmp_path):
    t0 = time.monotonic()
    ckpt = tmp_path / "ckpt"
    a = _run_ranks("train", ckpt, tmp_path / "train", stage=3)
    b = _run_ranks("resume", ckpt, tmp_path / "resume", stage=3)
    assert [r["stage"] for r in a] == [3, 3] and [r["world"] for r in a] == [2, 2]
    # The lineage: one per learner start, the same on both ranks; the resumed one descends from the checkpoint's
    first, resumed = Lineage.parse(a[0]["lineage"]), Lineage.parse(b[0]["lineage"])
    assert a[0]["lineage"] == a[1]["lineage"] and b[0]["lineage"] == b[1]["lineage"]
    assert len(first.id) == 26 and first.forks == (PolicyTag(ROOT, 0),)
    assert resumed.id != first.id and resumed.forks == (PolicyTag(first.id, 2), PolicyTag(ROOT, 0))
    # gathered full weights identical on every rank, finite, and only rank 0 receives items by default
    assert a[0]["before_save_params"] == a[1]["before_save_params"]
    assert a[0]["after_step3_params"] == a[1]["after_step3_params"]
    assert all(r["before_save_finite"] and r["after_step3_finite"] for r in a)
    assert a[0]["before_save_rank0_items"] > 0 and a[1]["before_save_rank0_items"] == 0
    assert a[0]["before_save_version"] == 2 and a[0]["after_step3_version"] == 3
    # the ZeRO-3 partitions differ per rank (each rank holds its own shard of the optimizer state)
    assert a[0]["before_save_opt"] != a[1]["before_save_opt"]
    assert hashlib.sha256().hexdigest() not in (a[0]["before_save_opt"], a[1]["before_save_opt"])
    for r in range(2):
        assert b[r]["after_load_version"] == 2
        assert b[r]["after_load_params"] == a[r]["before_save_params"]   # bit-equal parameters
        assert b[r]["after_load_opt"] == a[r]["before_save_opt"]         # bit-equal optimizer partition
        assert b[r]["after_step3_params"] == a[r]["after_step3_params"]  # and the same next step
        assert b[r]["extra"] == {"ledger": {"trained": 4}}
        # ranks with 2 and 3 trajectories (rank 0 pads to 3 micro-batches): the loss and the averaged
        # gradient are those of the union batch in one process (micro-batch weights W * U_m / U_global)
        s3, ref = b[r]["step3"], b[r]["step3_ref"]
        assert s3["learner/micro_batches"] == 3 and s3["learner/trajectories"] == ref["learner/trajectories"] == 5
        assert s3["learner/tokens"] == ref["learner/tokens"]
        assert s3["loss/policy"] == pytest.approx(ref["loss/policy"], rel=1e-4, abs=1e-7)
        assert s3["learner/grad_norm"] == pytest.approx(ref["learner/grad_norm"], rel=1e-4)
    # Budget: < 90 s in all (about 30 s on an idle 2-core machine; each phase is capped at 80 s above).
    print(f"two-rank ZeRO-3 train + resume: {time.monotonic() - t0:.1f} s")


def test_two_rank_zero3_minibatches_and_batch_adv_norm_equal_one_process(tmp_path):
    """learner.minibatches=2 under ZeRO-3 on 2 gloo ranks (micro-batches of one trajectory: gradient accumulation
    inside each mini-batch) with loss.adv_norm=batch: the weights after the batch equal one process's
    TorchLearner on the union (the ranks' mini-batch j = the union's mini-batch j; batch statistics over both
    ranks: the ranks' reward means differ, so per-rank statistics would give other weights)."""
    import torch

    from learner.torch_engine import TorchLearner
    from tests.learner_helpers import StandInPolicy, minibatch_groups, small_cfg

    a = _run_ranks("minibatch", tmp_path, tmp_path / "mb", stage=3)
    cfg = small_cfg("learner.micro_batch_trajectories=1", "learner.minibatches=2", "buffer.groups_per_batch=4",
                    "loss.adv_norm=batch", "loss.correction=tis")
    g0, g1 = minibatch_groups(0), minibatch_groups(1)
    ref = TorchLearner(cfg, StandInPolicy(seed=1))
    m = ref.train_step([g0[0], g1[0], g0[1], g1[1]])
    assert a[0]["params"] == a[1]["params"] and a[0]["version"] == a[1]["version"] == 1
    for name, want in ref.full_state_items():
        torch.testing.assert_close(torch.tensor(a[0]["params"][name]), want, rtol=1e-4, atol=1e-6, msg=name)
    got = a[0]["metrics"]
    assert got["learner/steps_applied"] == 2 and got["learner/minibatches"] == 2
    for k in ("loss/policy", "learner/adv_abs_mean", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert got[k] == pytest.approx(m[k], rel=1e-4, abs=1e-7), k
