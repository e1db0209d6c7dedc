"""``bin/buffer`` as its own process for the live fault tests (not a test module)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from test_buffer_service import stats

from async_vla.config import load_config
from async_vla.transport import ControlClient, endpoints
from runner.commands import component_argv

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def live_buffer(tmp_path: Path, run_name: str, overrides: list[str]):
    """``bin/buffer`` for run ``run_name`` with ``overrides`` in ``<tmp>/run``, up and answering: (cfg, run_dir,
    endpoints, control client, process). On exit it is stopped with SIGTERM, its log tail printed, and it must
    have exited 0."""
    run_dir = tmp_path / "run"
    yaml = tmp_path / f"{run_name}.yaml"
    yaml.write_text(f"run: {{name: {run_name}}}\nlogging: {{tensorboard: false}}\n")
    cfg = load_config(str(yaml), overrides)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = open(tmp_path / "buffer.log", "wb")
    proc = subprocess.Popen(component_argv("buffer", str(yaml), str(run_dir), overrides=overrides), env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    eps = endpoints(cfg.transport, run_dir, side="connect")
    client = ControlClient(eps["control"])
    try:
        deadline = time.monotonic() + 120     # the process imports and binds first
        while not (run_dir / "ledger.json").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        stats(client)
        yield cfg, run_dir, eps, client, proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        print((tmp_path / "buffer.log").read_text(errors="replace")[-5000:])
    assert proc.returncode == 0
