"""The buffer process never imports torch: a BufferService started in a fresh interpreter assembles, filters and
batches groups over real sockets and logs its metrics to TensorBoard (as ``bin/buffer`` does with
``logging.tensorboard`` on), and afterwards no ``torch`` module is loaded; the events read back with TensorBoard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from async_vla.metrics import read_scalars, read_tags

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
from test_buffer_service import as_run_actor, learner_request, running, send_group, service_cfg, wait_stats
from async_vla.messages import GrantRequest
from async_vla.metrics import Monitor
from async_vla.transport import ControlClient, TrajectorySender

tb_dir = sys.argv[1]
with running(tb_dir, service_cfg(groups_per_batch=1, record=True)) as svc, Monitor(tb_dir) as monitor:
    sender = TrajectorySender(svc.trajectory_endpoint)
    learner, control = ControlClient(svc.batch_endpoint, identity=b"rank-0"), ControlClient(svc.control_endpoint)
    mixed, uniform = control.call(as_run_actor(tb_dir, GrantRequest(actor_id=0, want=2)), 10).group_ids
    send_group(sender, mixed, (1, 0, 1, 0))              # admitted (the outcome filter ran)
    send_group(sender, uniform, (1, 1, 1, 1))            # dropped by dynamic sampling
    learner.send(learner_request(tb_dir, rank=0, world=1, version=0, timeout_s=10))
    batch = learner.recv_bundle(10)
    reply = wait_stats(control, lambda s: s["ledger"]["filtered_uniform"] == 4)
    ledger, metrics = reply["ledger"], reply["metrics"]
    sender.close(); learner.close(); control.close()
    monitor.scalars(metrics, 3)
    monitor.histogram("buffer/trained_lag", [0, 0, 1], 3)
print(json.dumps({"batch": batch is not None and batch[0].ready, "ledger": ledger, "metrics": metrics,
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_a_started_buffer_service_logging_to_tensorboard_leaves_no_torch_in_sys_modules(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["batch"] and got["ledger"]["trained"] == 4 and got["ledger"]["filtered_uniform"] == 4, got
    assert got["torch"] == [], f"the buffer process imported torch: {got['torch'][:5]}"
    logged = {tag: v for tag, v in got["metrics"].items() if isinstance(v, (int, float))}
    assert logged["buffer/trained"] == 4
    # TensorBoard stores scalars as float32
    assert {tag: read_scalars(tmp_path / "tb", tag) for tag in logged} == {tag: [(3, float(np.float32(v)))]
                                                                          for tag, v in logged.items()}
    assert "buffer/trained_lag" in read_tags(tmp_path / "tb")
