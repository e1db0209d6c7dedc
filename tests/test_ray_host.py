"""runner/ray_host.ProcessHost outside Ray (the class Ray wraps as an actor): the files it ships to a node-local
workdir (config, client CURVE keys) exist while its command runs and are gone once it is stopped; its log stays."""

import stat
import sys

from runner.ray_host import ProcessHost


def test_stop_removes_the_shipped_keys_and_config_but_keeps_the_log(tmp_path):
    workdir = tmp_path / "async_vla-run-fleet0"
    files = {"config.yaml": b"run: {}\n", "keys/client.key_secret": b"secret", "keys/server.key": b"public"}
    host = ProcessHost("fleet0", [sys.executable, "-c", "import time; time.sleep(60)"], str(workdir), files, {},
                       restart_on_error=False)
    try:
        for rel in files:
            path = workdir / rel
            assert path.read_bytes() == files[rel]
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert host.poll() is None
    finally:
        code = host.stop(timeout_s=10)
    assert code is not None                                   # the command was ended by the stop
    assert not (workdir / "keys").exists() and not (workdir / "config.yaml").exists()
    assert "starting fleet0" in (workdir / "logs" / "fleet0.log").read_text()
