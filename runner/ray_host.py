"""The Ray actor that runs one of our commands on the node Ray placed it (``ProcessHost``), and the launcher's
handle on it (``RayProcess``; runner/ray_launch.py, runner/ray_ranks.py). Standard library and runner.commands only
at import: a Ray worker imports this module to build the actor."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from runner.commands import REPO

log = logging.getLogger("runner.ray_host")
PYTHON = "{python}"   # in a command line: the interpreter of the node it runs on (this ProcessHost's)
CALL_TIMEOUT_S = 10.0   # a ProcessHost that does not answer a poll within this is being restarted (or gone)


class ProcessHost:
    """Runs one command as a child process on the node Ray placed it and exits with it, so Ray restarts a child that
    died with an error (``restart_on_error``). ``files`` (relative path -> bytes) are written into ``workdir`` first and
    removed by ``stop`` (the client CURVE secret must not outlive the run); the logs stay."""

    def __init__(self, name: str, argv: list[str], workdir: str, files: dict[str, bytes], env: dict[str, str],
                 restart_on_error: bool):
        self.name, self.workdir = name, Path(workdir)
        self.shipped: list[Path] = []
        for rel, data in files.items():
            path = self.workdir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o600)
            self.shipped.append(path)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "logs" / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n==== ray: starting {name} on {socket.gethostname()} at {time.ctime()}\n".encode())
        self._log.flush()
        full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env)
        from async_vla.child_process import die_with_parent

        argv = [sys.executable if a == PYTHON else a for a in argv]
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
        self.remove_shipped()
        return self.proc.returncode

    def remove_shipped(self) -> None:
        """Delete the files written at start (config, client keys) once the command has ended, and their folders
        if that leaves them empty."""
        for path in self.shipped:
            path.unlink(missing_ok=True)
        for folder in sorted({p.parent for p in self.shipped}, key=lambda d: len(d.parts), reverse=True):
            if folder != self.workdir and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


class ReturnCode:
    def __init__(self) -> None:
        self.returncode: Optional[int] = None


class RayProcess:
    """The launcher's handle on a ProcessHost, with the interface of runner.launch.Child (alive, stop, tail,
    proc.returncode). ``alive()`` is True while Ray restarts it; False once it exited (learner) or Ray gave up."""

    def __init__(self, name: str, handle: Any):
        self.name, self.handle = name, handle
        self.proc = ReturnCode()
        self.dead = False
        self.nodes: list[str] = []   # the nodes it has run on, in order (a restart elsewhere adds one)
        self.host = ""               # the host name of the last one
        self.workdir = ""

    def state(self) -> str:
        """running | restarting | exited | dead."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.dead:
            return "dead"
        if self.proc.returncode is not None:
            return "exited"
        try:
            code, where = ray.get([self.handle.poll.remote(), self.handle.where.remote()], timeout=CALL_TIMEOUT_S)
        except GetTimeoutError:
            return "restarting"
        except RayActorError as exc:
            if type(exc).__name__ == "ActorUnavailableError":
                return "restarting"
            self.dead = True
            return "dead"
        if not self.nodes or self.nodes[-1] != where["node_id"]:
            if self.nodes:
                print(f"[train] {self.name} restarted by Ray on node {where['node_id'][:12]} ({where['host']})",
                      flush=True)
            self.nodes.append(where["node_id"])
            self.host, self.workdir = where["host"], where["workdir"]
        if code is not None:
            self.proc.returncode = code
            return "exited"
        return "running"

    def alive(self) -> bool:
        return self.state() in ("running", "restarting")

    def tail(self, n: int = 20) -> str:
        import ray

        try:
            return ray.get(self.handle.tail.remote(n), timeout=CALL_TIMEOUT_S)
        except Exception as exc:   # noqa: BLE001 - a lost actor's log is gone with it: say so, do not raise
            return f"(no log: {type(exc).__name__})"

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        import ray

        try:
            code = ray.get(self.handle.stop.remote(timeout_s), timeout=timeout_s + CALL_TIMEOUT_S)
            self.proc.returncode = code if self.proc.returncode is None else self.proc.returncode
        except Exception as exc:   # noqa: BLE001 - stopping what is already gone is not an error
            log.info("%s: stop found it gone (%s)", self.name, type(exc).__name__)
        ray.kill(self.handle, no_restart=True)
        return self.proc.returncode
