"""The actor fleet: N actor processes on this host (``python -m actors``, each in its own session with a
parent-death signal, logs in ``<run>/logs/actor_<i>.log``), supervised every ``POLL_S``: exit 0 = told to shut
down; any other exit or a stale heartbeat = crash, restarted after a back-off doubling per fast crash up to 30 s,
given up after ``actor.max_fast_crashes`` in a row. Stop: SIGTERM, ``actor.stop_timeout_s``, SIGKILL; all reaped."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from actors.status import log_path, read_status, status_path
from async_vla.child_process import die_with_parent
from async_vla.placement import actor_env

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.2
MAX_BACKOFF_S = 30.0


@dataclass
class Slot:
    """One actor id and the process currently playing it."""

    actor_id: int
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    starts: int = 0
    fast_crashes: int = 0
    restart_at: Optional[float] = None
    done: bool = False
    gave_up: bool = False
    last_exit: Optional[int] = None
    last_status: dict = field(default_factory=dict)
    counters_pid: Optional[int] = None
    """Pid whose cumulative counters ``counters_last`` holds; earlier processes' totals are in ``counters_base``."""
    counters_base: dict = field(default_factory=dict)
    counters_last: dict = field(default_factory=dict)


class Fleet:
    """Starts and supervises ``num`` actors; ``run()`` blocks until stopped and returns the exit code. ``config_file``:
    the resolved config every actor loads; ``connect``: the actors' ``--connect`` (None = endpoints from the config)."""

    def __init__(self, cfg: Any, config_file: Path, num: int, run_dir: Path, connect: Optional[str] = None,
                 python: str = sys.executable, out: TextIO = sys.stdout,
                 clock: Callable[[], float] = time.monotonic, first_id: int = 0):
        self.cfg, self.config_file, self.run_dir = cfg, Path(config_file), Path(run_dir)
        self.connect, self.python, self.out, self.clock = connect, python, out, clock
        # Actor ids first_id .. first_id + num - 1: fleets on several hosts (or Ray nodes) must not share ids.
        self.slots = [Slot(first_id + i) for i in range(num)]
        self.stop_requested = False
        self.stop_reason = ""
        self.restarts = 0
        self._rate_mark: Optional[tuple[float, dict]] = None
        self._next_status = 0.0

    # ---- processes ----------------------------------------------------------------------------------
    def _command(self, slot: Slot) -> list[str]:
        cmd = [self.python, "-m", "actors", "--actor-id", str(slot.actor_id), "--config", str(self.config_file),
               "--run-dir", str(self.run_dir), "--parent-pid", str(os.getpid())]
        if self.connect:
            cmd += ["--connect", self.connect]
        return cmd

    def _spawn(self, slot: Slot) -> None:
        env = dict(os.environ)
        threads = str(self.cfg.actor.torch_threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        placement = actor_env(self.cfg, slot.actor_id, os.environ)   # its GPU (placement.gpus_actors)
        env.update(placement)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "commands.txt", "a") as f:          # as runner/launch.py records its children
            given = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(placement.items()))
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  actor{slot.actor_id}: {given}"
                    f"{shlex.join(self._command(slot))}\n")
        logfile = log_path(self.run_dir, slot.actor_id)
        logfile.parent.mkdir(parents=True, exist_ok=True)
        status_path(self.run_dir, slot.actor_id).unlink(missing_ok=True)  # a stale file would look alive
        with open(logfile, "ab") as fh:
            fh.write(f"\n==== fleet: starting actor {slot.actor_id} (start #{slot.starts + 1}) at "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
            fh.flush()
            slot.proc = subprocess.Popen(self._command(slot), stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=str(REPO),
                                         start_new_session=True, preexec_fn=die_with_parent)
        slot.started, slot.restart_at = self.clock(), None
        slot.starts += 1
        slot.last_status = {}
        log.info("actor %d started (pid %d)", slot.actor_id, slot.proc.pid)

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    # ---- supervision --------------------------------------------------------------------------------
    def _hung(self, slot: Slot, now: float) -> Optional[str]:
        """Why a running actor counts as hung, or None. Heartbeats are wall-clock times in the status file."""
        st = read_status(status_path(self.run_dir, slot.actor_id))
        if st is not None and st.get("pid") == slot.proc.pid:
            slot.last_status = st
        st = slot.last_status
        age_since_start = now - slot.started
        if not st or st.get("state") == "starting":
            limit = self.cfg.actor.startup_timeout_s
            return f"no heartbeat {age_since_start:.0f} s after start" if age_since_start > limit else None
        age = time.time() - float(st.get("t", 0.0))
        if age > self.cfg.actor.hung_after_s:
            return f"last heartbeat {age:.0f} s ago"
        return None

    def _on_exit(self, slot: Slot, code: int, why: str, now: float) -> None:
        slot.last_exit, slot.proc = code, None
        if code == 0 and not why:
            slot.done = True
            self._say(f"actor {slot.actor_id} exited cleanly (shut down by the buffer); not restarting")
            return
        lived = now - slot.started
        fast = lived < self.cfg.actor.fast_crash_s
        slot.fast_crashes = slot.fast_crashes + 1 if fast else 0
        if slot.fast_crashes >= self.cfg.actor.max_fast_crashes:
            slot.gave_up = True
            self._say(f"GIVING UP on actor {slot.actor_id}: it crashed {slot.fast_crashes} times in a row within "
                      f"{self.cfg.actor.fast_crash_s:.0f} s of starting (last exit code {code}). "
                      f"Fix the cause and restart the fleet. Last lines of {log_path(self.run_dir, slot.actor_id)}:\n"
                      + self._log_tail(slot.actor_id))
            return
        delay = min(self.cfg.actor.restart_backoff_s * 2 ** max(slot.fast_crashes - 1, 0), MAX_BACKOFF_S)
        slot.restart_at = now + delay
        self._say(f"actor {slot.actor_id} {why or f'died (exit code {code})'} after {lived:.1f} s; "
                  f"restarting in {delay:.1f} s")

    def poll(self) -> None:
        """One supervision pass: reap, detect hung actors, restart due ones, print status when due."""
        now = self.clock()
        for slot in self.slots:
            if slot.proc is not None:
                code = slot.proc.poll()
                if code is not None:
                    self._on_exit(slot, code, "", now)
                    continue
                why = self._hung(slot, now)
                if why is not None:
                    slot.proc.kill()  # a hung simulator will not answer SIGTERM
                    code = slot.proc.wait()
                    self._on_exit(slot, code, f"hung ({why}), killed", now)
            elif slot.restart_at is not None and now >= slot.restart_at and not self.stop_requested:
                self.restarts += 1
                self._spawn(slot)
        if now >= self._next_status:
            self._next_status = now + self.cfg.logging.status_every_s
            self._say(self.status_line(now))

    def finished(self) -> bool:
        """True when no actor runs or will be restarted (all shut down by the buffer or given up on)."""
        return all(s.done or s.gave_up for s in self.slots)

    def run(self, install_signals: bool = True) -> int:
        """Start, supervise until stopped or every actor is done, stop. Exit code 1 if any actor was given up."""
        if install_signals:
            self._install_signals()
        self.start()
        try:
            while not self.stop_requested and not self.finished():
                self.poll()
                time.sleep(POLL_S)
        finally:
            self.stop()
        return 1 if any(s.gave_up for s in self.slots) else 0

    def request_stop(self, reason: str = "stop requested") -> None:
        self.stop_reason = self.stop_reason or reason
        self.stop_requested = True

    def _install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self.stop_requested:  # a second Ctrl-C: do not wait for stragglers
                for s in self.slots:
                    if s.proc is not None and s.proc.poll() is None:
                        s.proc.kill()
            self.request_stop(f"signal {signal.Signals(signum).name}")

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # a closed terminal stops it cleanly too
            signal.signal(sig, handler)

    def stop(self) -> None:
        """SIGTERM every actor, wait up to actor.stop_timeout_s, SIGKILL the rest, reap all of them."""
        self.stop_requested = True
        running = [s for s in self.slots if s.proc is not None]
        for s in running:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.actor.stop_timeout_s
        for s in running:
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"actor {s.actor_id} did not stop within {self.cfg.actor.stop_timeout_s:.0f} s; killing it")
                s.proc.kill()
                s.proc.wait()
            s.last_exit, s.proc = s.proc.returncode, None
        self._say(f"fleet stopped ({self.stop_reason or 'all actors done'}); {self.restarts} restarts; "
                  f"exit codes {[s.last_exit for s in self.slots]}")

    # ---- reporting ----------------------------------------------------------------------------------
    def _totals(self) -> dict:
        """Sum of actors' cumulative counters, counting a restarted actor's new counters on top of the old."""
        keys = ("groups", "env_steps", "trajectories")
        total = dict.fromkeys(keys, 0)
        for s in self.slots:
            st = read_status(status_path(self.run_dir, s.actor_id)) or {}
            if st.get("pid") is not None and st["pid"] != s.counters_pid:  # a new process counts from 0
                s.counters_base = {k: s.counters_base.get(k, 0) + s.counters_last.get(k, 0) for k in keys}
                s.counters_pid, s.counters_last = st["pid"], {}
            if st:
                s.counters_last = {k: int(st.get(k, 0)) for k in keys}
            for k in keys:
                total[k] += s.counters_base.get(k, 0) + s.counters_last.get(k, 0)
        return total

    def status_line(self, now: Optional[float] = None) -> str:
        now = self.clock() if now is None else now
        totals = self._totals()
        rates = {k: 0.0 for k in totals}
        if self._rate_mark is not None and now > self._rate_mark[0]:
            dt = now - self._rate_mark[0]
            rates = {k: (totals[k] - self._rate_mark[1][k]) / dt for k in totals}
        self._rate_mark = (now, totals)
        alive = sum(1 for s in self.slots if s.proc is not None and s.proc.poll() is None)
        sts = [s.last_status or read_status(status_path(self.run_dir, s.actor_id)) or {} for s in self.slots]
        # A starting actor has no weights yet: its version 0 would show as a bogus lag.
        versions = [int(st["version"]) for st in sts if "version" in st and st.get("state") != "starting"]
        # The buffer's view of the learner (its last batch request) can trail the version the learner broadcast
        # last: the learner is at least as new as any actor's weights.
        learner = max([int(st.get("learner_version", 0)) for st in sts] + versions + [0])
        version = f"{min(versions)}..{max(versions)}" if versions and min(versions) != max(versions) else \
            (str(versions[0]) if versions else "-")
        lag = learner - min(versions) if versions else 0
        return (f"[fleet] actors {alive}/{len(self.slots)} alive | groups/s {rates['groups']:.2f} | "
                f"env steps/s {rates['env_steps']:.0f} | version {version} | learner {learner} | lag {lag} | "
                f"trajectories {totals['trajectories']} | restarts {self.restarts}")

    def _log_tail(self, actor_id: int, lines: int = 15) -> str:
        try:
            text = log_path(self.run_dir, actor_id).read_text(errors="replace").splitlines()
        except OSError:
            return "  (no log)"
        return "\n".join("  | " + line for line in text[-lines:])

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)
