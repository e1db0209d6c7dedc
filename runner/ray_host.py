"""The Ray actor that runs one of our commands on the node Ray placed it (runner/ray_launch.py). Standard library
only at import: a Ray worker imports this module to build the actor."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent


class ProcessHost:
    """Runs one command as a child process on the node Ray placed it, and exits with it: a child that dies with an
    error (``restart_on_error``) takes this actor down, so Ray restarts it (its constructor runs again and starts
    the command again). ``files`` (path relative to ``workdir`` -> bytes) are written first: how a node without the
    run directory gets the config and keys."""

    def __init__(self, name: str, argv: list[str], workdir: str, files: dict[str, bytes], env: dict[str, str],
                 restart_on_error: bool):
        self.name, self.workdir = name, Path(workdir)
        for rel, data in files.items():
            path = self.workdir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o600)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "logs" / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n==== ray: starting {name} on {socket.gethostname()} at {time.ctime()}\n".encode())
        self._log.flush()
        full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env)
        from async_vla.child_process import die_with_parent

        argv = [sys.executable if a == "{python}" else a for a in argv]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(REPO), env=full_env,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.stopping = False
        if restart_on_error:
            threading.Thread(target=self._exit_with_child, daemon=True).start()

    def _exit_with_child(self) -> None:
        code = self.proc.wait()
        if code != 0 and not self.stopping:
            self._log.write(f"==== ray: {self.name} exited with {code}: restarting this actor\n".encode())
            self._log.flush()
            os._exit(1)   # Ray sees the actor die and restarts it (up to max_restarts)

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "pid": self.proc.pid, "workdir": str(self.workdir)}

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float) -> Optional[int]:
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
