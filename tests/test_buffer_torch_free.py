"""The buffer process never imports torch: a BufferService started in a fresh interpreter assembles, filters and
batches groups over real sockets, and afterwards no ``torch`` module is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys, tempfile
from test_buffer_service import running, send_group, service_cfg, wait_stats
from async_vla.messages import BatchRequest
from async_vla.transport import ControlClient, TrajectorySender

with tempfile.TemporaryDirectory() as tmp, running(tmp, service_cfg(groups_per_batch=1, record=True)) as svc:
    sender = TrajectorySender(svc.trajectory_endpoint)
    send_group(sender, "mixed", (1, 0, 1, 0))            # admitted (the outcome filter ran)
    send_group(sender, "uniform", (1, 1, 1, 1))          # dropped by dynamic sampling
    learner = ControlClient(svc.control_endpoint, identity=b"rank-0")
    learner.send(BatchRequest(rank=0, world=1, version=0, timeout_s=10))
    batch = learner.recv_bundle(10)
    ledger = wait_stats(learner, lambda s: s["ledger"]["filtered_uniform"] == 4)["ledger"]
    sender.close(); learner.close()
print(json.dumps({"batch": batch is not None and batch[0].ready, "ledger": ledger,
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_a_started_buffer_service_leaves_no_torch_in_sys_modules():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["batch"] and got["ledger"]["trained"] == 4 and got["ledger"]["filtered_uniform"] == 4, got
    assert got["torch"] == [], f"the buffer process imported torch: {got['torch'][:5]}"
