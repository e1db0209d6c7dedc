"""Env-worker isolation: ``SubprocessEnv`` runs any ``Env`` in a "spawn" child over a Pipe, so a simulator crash or
hang costs one env. A dead child, a step past ``env.step_timeout_s`` (a reset past ``env.worker_start_timeout_s``)
or an error inside ``reset`` / ``step`` kills the child, starts a fresh one at once and raises ``EnvCrashed`` (each
counted); query-method errors are ``RemoteEnvError`` and keep the child. Details: docs/CONTRACTS.md."""

from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from async_vla.envs import make_env
from async_vla.envs.base import Env, Observation, Split

if TYPE_CHECKING:
    from async_vla.config import Config

EnvFactory = Callable[["Config", int], Env]


class EnvCrashed(RuntimeError):
    """An env worker crashed, hung or raised during reset/step; it has been killed and restarted."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"env worker {reason}: {detail}".rstrip(": "))
        self.reason = reason  # crash | timeout | error | start
        self.detail = detail


class RemoteEnvError(RuntimeError):
    """A query method (instruction, init_state_ids, max_steps) raised inside the worker; carries its traceback."""


def _worker_main(conn, factory: EnvFactory, cfg: "Config", seed: int) -> None:
    """Child process: build the env, then serve (method, args) requests until told to close or the pipe ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the parent shuts us down
    try:
        env = factory(cfg, seed)
        conn.send(("ready", {"task_ids": list(env.task_ids), "obs_image_size": int(env.obs_image_size),
                             "proprio_dim": int(env.proprio_dim)}))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        conn.send(("start_error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if method == "close":
                break
            try:
                conn.send(("ok", getattr(env, method)(*args)))
            except Exception:  # noqa: BLE001
                conn.send(("error", traceback.format_exc()))
    finally:
        env.close()
        conn.close()


def _kill(proc) -> None:
    """Finalizer: make sure no worker outlives its SubprocessEnv (also runs at interpreter exit)."""
    if proc.is_alive():
        proc.kill()
        proc.join(5)


class SubprocessEnv(Env):
    """An ``Env`` whose simulator lives in a restartable child process (see the module docstring)."""

    def __init__(self, cfg: "Config", seed: int = 0, factory: Optional[EnvFactory] = None,
                 step_timeout_s: Optional[float] = None, start_timeout_s: Optional[float] = None):
        self.cfg = cfg
        self.seed = seed
        self.factory = factory or make_env
        self.step_timeout_s = float(step_timeout_s or cfg.env.step_timeout_s)
        self.start_timeout_s = float(start_timeout_s or cfg.env.worker_start_timeout_s)
        self.crashes = self.timeouts = self.errors = self.start_failures = self.restarts = 0
        self.last_exitcode: Optional[int] = None
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self._ready = False
        self._pending: Optional[tuple[str, float]] = None  # (method, timeout) sent but not yet received
        self._finalizer: Optional[weakref.finalize] = None
        self._start()
        # The first start is not retried: a broken config or install fails here, once, with the child's traceback.
        try:
            ok = self._conn.poll(self.start_timeout_s)
            status, info = self._conn.recv() if ok else ("start_error", f"no answer in {self.start_timeout_s:g} s")
        except (EOFError, OSError):
            status, info = "start_error", "the worker died while starting"
        if status != "ready":
            self._stop()
            raise RuntimeError(f"env worker could not start: {info}")
        self._ready = True
        self.task_ids = info["task_ids"]
        self.obs_image_size = info["obs_image_size"]
        self.proprio_dim = info["proprio_dim"]

    # ---- interface --------------------------------------------------------------------------------
    def instruction(self, task_id: int) -> str:
        return self.call("instruction", task_id)

    def init_state_ids(self, task_id: int, split: Split) -> list[int]:
        return self.call("init_state_ids", task_id, split)

    def max_steps(self, task_id: int) -> int:
        return self.call("max_steps", task_id)

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        self.reset_async(task_id, init_state_id)
        return self.wait()

    def step(self, action: np.ndarray) -> tuple[Observation, bool, bool]:
        self.step_async(action)
        return self.wait()

    def step_chunk(self, actions: np.ndarray) -> tuple[Observation, bool, bool, int]:
        self.step_chunk_async(actions)
        return self.wait()

    # Split calls: start several workers, then collect (``step_many``), so N simulators step in parallel.
    def reset_async(self, task_id: int, init_state_id: int) -> None:
        # A reset may build a new simulator (another task), so it gets the start-up budget.
        self._send("reset", (task_id, init_state_id), self.start_timeout_s)

    def step_async(self, action: np.ndarray) -> None:
        self._send("step", (np.asarray(action, dtype=np.float32),), self.step_timeout_s)

    def step_chunk_async(self, actions: np.ndarray) -> None:
        actions = np.asarray(actions, dtype=np.float32)
        self._send("step_chunk", (actions,), self.step_timeout_s * max(1, len(actions)))

    def call_async(self, method: str, *args, timeout: Optional[float] = None) -> None:
        """Start a call of any other method of the wrapped env (e.g. LiberoEnv.num_init_states)."""
        self._send(method, args, timeout or self.start_timeout_s)

    def call(self, method: str, *args, timeout: Optional[float] = None) -> Any:
        self.call_async(method, *args, timeout=timeout)
        return self.wait()

    def wait(self) -> Any:
        """Result of the pending *_async call. Crashes and hangs raise EnvCrashed; an exception raises
        EnvCrashed (worker restarted) for reset/step and RemoteEnvError (worker kept) for other methods."""
        if self._pending is None:
            raise RuntimeError("wait() without a pending reset_async/step_async/call_async")
        method, timeout = self._pending
        self._pending = None
        status, payload = self._recv(timeout, method)
        if status == "error":
            if method in ("reset", "step", "step_chunk"):
                raise self._fail("error", payload)
            raise RemoteEnvError(f"{method} failed in the env worker:\n{payload}")
        return payload

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("close", ()))
        except (OSError, ValueError):
            pass
        self._proc.join(10)  # the child closes its simulator (GL context) before exiting
        self._stop()

    # ---- process management -----------------------------------------------------------------------
    @property
    def pid(self) -> Optional[int]:
        """Process id of the current worker (changes on every restart)."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        # A daemonic process may not start children; a worker of one is non-daemonic and killed by the finalizer.
        proc = self._ctx.Process(target=_worker_main, args=(child, self.factory, self.cfg, self.seed),
                                 name=f"env-worker-{self.seed}", daemon=not mp.current_process().daemon)
        proc.start()
        child.close()  # only the child holds this end now, so its death shows as EOF here
        self._proc, self._conn, self._ready = proc, parent, False
        self._finalizer = weakref.finalize(self, _kill, proc)

    def _stop(self) -> None:
        if self._proc is None:
            return
        _kill(self._proc)
        self.last_exitcode = self._proc.exitcode
        if self._finalizer is not None:
            self._finalizer.detach()
        self._conn.close()
        self._proc.close()
        self._proc = self._conn = self._finalizer = None
        self._ready = False
        self._pending = None

    def _restart(self) -> None:
        self._stop()
        self.restarts += 1
        self._start()

    def _fail(self, reason: str, detail: str) -> EnvCrashed:
        """Kill + restart the worker, count the failure, and return the exception to raise."""
        if reason == "crash":
            self._proc.join(1)
            code = self._proc.exitcode
            how = f"exit code {code}"
            if code is not None and code < 0:
                try:
                    how = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    how = f"killed by signal {-code}"
            detail = f"{detail} ({how})"
        counter = {"crash": "crashes", "timeout": "timeouts", "error": "errors", "start": "start_failures"}[reason]
        setattr(self, counter, getattr(self, counter) + 1)
        self._restart()
        return EnvCrashed(reason, detail)

    def _recv(self, timeout: float, what: str) -> tuple[str, Any]:
        try:
            if not self._conn.poll(timeout):
                raise self._fail("timeout", f"{what} took more than {timeout:g} s")
            return self._conn.recv()
        except (EOFError, OSError, ConnectionResetError):
            raise self._fail("crash", f"worker died during {what}") from None

    def _wait_ready(self) -> dict:
        status, payload = self._recv(self.start_timeout_s, "start-up")
        if status != "ready":
            raise self._fail("start", str(payload))
        self._ready = True
        return payload

    def _send(self, method: str, args: tuple, timeout: float) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{method} while {self._pending[0]} is still pending: call wait() first")
        if self._proc is None:
            self._start()
        if not self._ready:
            self._wait_ready()
        try:
            self._conn.send((method, args))
        except (OSError, ValueError):
            raise self._fail("crash", f"worker gone before {method}") from None
        self._pending = (method, timeout)


def step_many(envs: list[Env], actions) -> list:
    """Step envs together: SubprocessEnvs run in parallel. Returns per env ``(obs, done, success)`` or the
    ``EnvCrashed`` it raised (that env was restarted; the others are unaffected)."""
    results: list = [None] * len(envs)
    for i, (env, action) in enumerate(zip(envs, actions)):
        if isinstance(env, SubprocessEnv):
            try:
                env.step_async(action)
            except EnvCrashed as exc:
                results[i] = exc
    for i, (env, action) in enumerate(zip(envs, actions)):
        if results[i] is not None:
            continue
        try:
            results[i] = env.wait() if isinstance(env, SubprocessEnv) else env.step(action)
        except EnvCrashed as exc:
            results[i] = exc
    return results


def make_isolated_env(cfg: "Config", seed: int) -> Env:
    """The env an actor should use: ``SubprocessEnv`` or inline, per ``cfg.env.worker`` (auto: subprocess
    for LIBERO, whose C simulator can segfault or hang; inline for the pure-numpy builtin family)."""
    mode = cfg.env.worker
    if mode == "auto":
        mode = "subprocess" if cfg.env.kind == "libero" else "inline"
    return SubprocessEnv(cfg, seed) if mode == "subprocess" else make_env(cfg, seed)


__all__ = ["EnvCrashed", "RemoteEnvError", "SubprocessEnv", "make_isolated_env", "step_many"]
