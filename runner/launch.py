"""One-host launcher for ``run.mode=async`` and ``sync``: buffer + learner ranks + actor fleet (+ TensorBoard), each
started from ``<run>/config.yaml`` with runner/commands.py's command line (logged to ``<run>/commands.txt``). It
watches the children, evaluates milestones (runner/evaluator.py), prints a status line, and stops actors, then
learner, then buffer: each signalled, waited for, then killed."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from async_vla.child_process import die_with_parent
from async_vla.config import Config, load_config, write_resolved
from async_vla.hosts import free_port
from async_vla.metrics import Monitor
from async_vla.placement import learner_env
from async_vla.transport import endpoints
from runner.commands import REPO, component_argv
from runner.evaluator import Evaluator
from runner.report import RunRecorder, fmt_rate

log = logging.getLogger("runner.launch")


def resolve_ports(cfg: Config) -> Config:
    """Port 0 in the config means "pick a free one now", so several runs can share a host (tests do)."""
    t = cfg.transport
    overrides = {}
    for name in ("trajectory_port", "control_port", "batch_port", "weights_port", "weights_fetch_port"):
        if getattr(t, name) == 0:
            overrides[name] = free_port(t.host if t.host != "0.0.0.0" else "127.0.0.1")
    if cfg.logging.serve_tensorboard and cfg.logging.tensorboard_port == 0:
        cfg.logging.tensorboard_port = free_port(cfg.logging.tensorboard_host)
    for k, v in overrides.items():
        setattr(t, k, v)
    return cfg


class Child:
    """A child process with its own log file; stop() never leaves a zombie."""

    def __init__(self, name: str, argv: list[str], run_dir: Path, env: Optional[dict] = None,
                 cores: Optional[set[int]] = None):
        self.name, self.argv = name, argv
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{name}.log"
        with open(run_dir / "commands.txt", "a") as f:   # with the environment it is given (its devices)
            given = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted((env or {}).items()))
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {name}: {given}{shlex.join(argv)}\n")
        self._log = open(self.log_path, "ab")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        # A new session: Ctrl-C in the terminal reaches only the launcher, which stops children in order; and a
        # launcher that dies without doing so (kill -9, OOM) takes them along (SIGTERM: each stops cleanly).
        def setup() -> None:
            die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)   # its own children inherit the affinity

        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(REPO), env=full_env,
                                     start_new_session=True, preexec_fn=setup)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killing", self.name, timeout_s)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def buffer_stats(endpoint: str, timeout_s: float = 1.0, keys: Any = None) -> Optional[dict]:
    """Ask the buffer for its ledger and metrics (None if it does not answer). ``keys``: CURVE client keys."""
    from async_vla.messages import ControlCommand
    from async_vla.transport import ControlClient, ControlTimeout

    client = ControlClient(endpoint, keys=keys)
    try:
        reply = client.call(ControlCommand("stats"), timeout_s=timeout_s)
        if isinstance(reply, ControlCommand) and isinstance(reply.value, str):
            return json.loads(reply.value)
        return None
    except ControlTimeout:
        return None
    finally:
        client.close()


def wait_for_buffer(control: str, keys: Any, buffer: Any, timeout_s: float,
                    should_stop: Callable[[], bool] = lambda: False) -> bool:
    """Until the buffer answers on ``control``: True; False once ``should_stop()`` (a Ctrl-C); RuntimeError with its
    log's tail if ``buffer`` (a child: alive, tail) dies or does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while buffer_stats(control, 0.5, keys) is None:
        if should_stop():
            return False
        if not buffer.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"buffer did not start:\n{buffer.tail()}")
    return True


def client_keys(cfg: Config) -> Any:
    """CURVE client keys when transport.curve is on (the launcher talks to the buffer like an actor does)."""
    from async_vla.transport import CurveKeys

    return CurveKeys.load(cfg.transport.curve_dir, "client") if cfg.transport.curve else None


def core_sets(cfg: Config) -> tuple[Optional[set[int]], Optional[set[int]]]:
    """(learner+buffer cores, actor cores) for run.pin_cores, else (None, None)."""
    cores = sorted(os.sched_getaffinity(0))
    if not cfg.run.pin_cores or len(cores) < 2:
        return None, None
    return {cores[0]}, set(cores[1:])


def start_children(cfg: Config, run_dir: Path, cfg_path: Path, resume: bool,
                   should_stop: Callable[[], bool] = lambda: False) -> dict[str, Child]:
    """Buffer (waited for), learner, actor fleet (+ TensorBoard). If any start fails, those already started are
    stopped before the error propagates: the caller never saw them, so nobody else would. ``should_stop`` (a
    Ctrl-C while the buffer starts) returns early with what has been started."""
    children: dict[str, Child] = {}
    try:
        _start_children(children, cfg, run_dir, cfg_path, resume, should_stop)
    except BaseException:
        for child in reversed(list(children.values())):
            child.stop(timeout_s=10)
        raise
    return children


def _start_children(children: dict[str, Child], cfg: Config, run_dir: Path, cfg_path: Path, resume: bool,
                    should_stop: Callable[[], bool]) -> None:
    learner_cores, actor_cores = core_sets(cfg)
    config, rd = str(cfg_path), str(run_dir)
    children["buffer"] = Child("buffer", component_argv("buffer", config, rd), run_dir, cores=learner_cores)
    eps = endpoints(cfg.transport, run_dir, side="connect")   # tcp, or ipc socket files (transport.use_ipc)
    if not wait_for_buffer(eps["control"], client_keys(cfg), children["buffer"], 60, should_stop):
        return
    children["learner"] = Child("learner", component_argv("learner", config, rd, resume=resume), run_dir,
                                env=learner_env(cfg, os.environ), cores=learner_cores)
    children["actors"] = Child("actors", component_argv("actors", config, rd, num=cfg.actor.num_actors,
                                                        connect=f"{eps['trajectory']},{eps['control']}"),
                               run_dir, cores=actor_cores)
    if cfg.logging.serve_tensorboard:
        children["tensorboard"] = start_tensorboard(cfg, run_dir)


BUFFER_RESTARTS = 3   # a buffer that dies is started again this many times in one run, then the run fails


def restart_buffer(cfg: Config, run_dir: Path, dead: Child, attempt: int) -> Child:
    """Start a dead buffer again on the same ports: actors and learner ranks reconnect by themselves (ZeroMQ, with
    their grant / batch-request retries), the new buffer moves the old ledger aside (``ledger-<n>.json``) and group
    ids never repeat; what the dead one held in memory (its pending trajectories) is lost (docs/RELIABILITY.md)."""
    code = dead.stop(timeout_s=1)
    print(f"[train] buffer exited with code {code}: starting it again ({attempt}/{BUFFER_RESTARTS}; actors and "
          f"learner reconnect, the trajectories it held are lost):\n{dead.tail(5)}", flush=True)
    return Child("buffer", dead.argv, run_dir, cores=core_sets(cfg)[0])


def start_tensorboard(cfg: Config, run_dir: Path) -> Child:
    """A TensorBoard server on the run's tb/ for as long as the training runs (logging.serve_tensorboard)."""
    lc = cfg.logging
    child = Child("tensorboard", [sys.executable, "-m", "tensorboard.main", "--logdir", str(run_dir / "tb"),
                                  "--host", lc.tensorboard_host, "--port", str(lc.tensorboard_port)], run_dir)
    print(f"[train] TensorBoard: http://{lc.tensorboard_host}:{lc.tensorboard_port}/ (while training runs)",
          flush=True)
    return child


def main_launch(cfg: Config, run_dir: Path, resume: bool = False) -> Optional[dict]:
    """Async / sync run on this host: buffer, learner and actors as child processes, evaluated from here."""
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = resolve_ports(cfg)
    cfg_path = write_resolved(cfg, run_dir)
    load_config(cfg_path)  # the children will parse exactly this file: fail here, not in three places
    stop, restore_signals = stop_on_signals()
    run = LaunchedRun(cfg, run_dir, resume)
    try:
        run.evaluate_start()
        run.children = start_children(cfg, run_dir, cfg_path, resume, should_stop=lambda: stop["flag"])
        run.supervise(stop)
    finally:
        run.stop_children()
        restore_signals()
    return run.finish()


def stop_on_signals() -> tuple[dict, Callable[[], None]]:
    """A flag that SIGINT, SIGTERM and SIGHUP set, and the function that puts the previous handlers back. After the first
    signal a second Ctrl-C raises ``KeyboardInterrupt``: out at once, without the final evaluation and summary."""
    stop = {"flag": False}

    def on_signal(signum, _frame) -> None:
        first = not stop["flag"]
        stop["flag"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if first:
            # os.write, not print: a handler that prints while the main thread is printing raises a reentrant
            # call; and after a hang-up or with `| tee` gone the write itself fails, which must not undo the stop
            with contextlib.suppress(OSError):
                os.write(2, (f"\n[train] {signal.Signals(signum).name}: stopping cleanly (final evaluation, "
                             "checkpoint, summary); Ctrl-C again to stop without them\n").encode())

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return stop, restore


class LaunchedRun:
    """The launcher's side of an async / sync run: its children, the evaluator, the run record, and the buffer's
    last stats."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool):
        self.cfg, self.run_dir, self.resume = cfg, run_dir, resume
        self.monitor = Monitor(run_dir, enabled=cfg.logging.tensorboard)
        self.recorder = RunRecorder(cfg, run_dir, self.monitor, resume=resume)
        self.evaluator = Evaluator(cfg, run_dir)
        self.children: dict[str, Child] = {}
        self.control = endpoints(cfg.transport, run_dir, side="connect")["control"]
        self.keys = client_keys(cfg)
        self.stats: Optional[dict] = None
        self.failed = False
        self.hinted = False
        self.buffer_restarts = 0
        self.last_status = self.next_eval_check = time.time()

    def evaluate_start(self) -> None:
        if self.resume:
            # The learner continues from its checkpoint, which a kill -9 can leave behind the last export.
            from learner.checkpoint_names import latest_version

            start = latest_version(self.run_dir / "checkpoints") or 0
            self.recorder.mark_resumed(start)
            # Its weights were evaluated when the last part ended there; otherwise the first eval of this part
            # is the next periodic one (the exports on disk may be of updates the checkpoint does not have).
            self.evaluator.version = start
        elif self.cfg.run.eval_at_start:
            _, res = self.evaluator.evaluate(use_latest=False)
            self.recorder.eval_result(self.evaluator.version, res)
        else:
            print("[train] run.eval_at_start=false: training starts without evaluating the initial policy; score "
                  f"it afterwards with bin/eval {self.run_dir} --versions 0 --record", flush=True)
        self.evaluator.ask_for_milestones()
        if not self.cfg.weights.export:
            print("[train] weights.export=false: no evaluation during the run (it loads the exported versions); "
                  "the learner's final policy is evaluated when it stops", flush=True)

    def learner_stopped(self) -> bool:
        """True once the learner process exited; the run has ``failed`` unless it exited with 0."""
        learner = self.children["learner"]
        if learner.alive():
            return False
        code = learner.proc.returncode
        self.failed = code != 0
        if self.failed:
            print(f"[train] learner exited with code {code}:\n{learner.tail()}", flush=True)
        return True

    def children_healthy(self) -> bool:
        """False when the run is over: the learner exited (``failed`` unless with 0), or the buffer (past its
        restarts) or the actors died. A dead buffer is restarted up to ``BUFFER_RESTARTS`` times."""
        children = self.children
        if self.learner_stopped():
            return False
        if not children["buffer"].alive() and self.buffer_restarts < BUFFER_RESTARTS:
            self.buffer_restarts += 1
            children["buffer"] = restart_buffer(self.cfg, self.run_dir, children["buffer"], self.buffer_restarts)
        for name in ("buffer", "actors"):
            if not children[name].alive():
                print(f"[train] {name} exited unexpectedly:\n{children[name].tail()}", flush=True)
                self.failed = True
        return not self.failed

    def supervise(self, stop: dict, tick: Optional[Callable[[], None]] = None) -> None:
        """Until the learner stops, a child dies for good, the target is reached or ``stop["flag"]`` is set:
        watch the children (a dead buffer is restarted), evaluate milestones, print status lines; ``tick`` runs
        once a round after the health check."""
        self.last_status = self.next_eval_check = time.time()
        while not stop["flag"]:
            time.sleep(0.5)
            if not self.children_healthy():     # the learner stopped, or a child died (a buffer is restarted)
                break
            if tick is not None:
                tick()
            if self.evaluate_if_due():          # True: run.target_success reached
                break
            self.status_if_due()
        self.note_stop(signalled=stop["flag"])

    def note_stop(self, signalled: bool) -> None:
        """Why the loop ended, for the summary's ``stopped_on`` (budget and target are noted where they happen)."""
        if signalled:
            self.recorder.stopped_on = "signal"
        if self.failed:
            self.recorder.stopped_on = "failed"

    def evaluate_if_due(self) -> bool:
        """Evaluate the newest milestone export, if any (checked once a second); True once ``run.target_success``
        is reached."""
        cfg, now = self.cfg, time.time()
        if not cfg.run.eval_every or now < self.next_eval_check:
            return False
        self.next_eval_check = now + 1.0
        milestone = self.evaluator.next_milestone()
        if milestone is None:
            return False
        return self.evaluator.record(self.recorder, *self.evaluator.evaluate(path=milestone))

    def status_if_due(self) -> None:
        """Every ``logging.status_every_s``: the buffer's stats into the run record, a status line, a stall hint."""
        now = time.time()
        if now - self.last_status < self.cfg.logging.status_every_s:
            return
        self.last_status = now
        self.stats = buffer_stats(self.control, keys=self.keys) or self.stats
        if not self.stats:
            return
        stats, recorder = self.stats, self.recorder
        recorder.observe_service(stats)
        rate = stats.get("metrics", {}).get("rollout/success_rate")
        if rate is not None and rate == rate:  # the plot's train-rollout line (NaN = no stats yet)
            recorder.train_points.append({"version": int(stats.get("learner_version", 0)),
                                          "wall_s": recorder.wall(), "success_rate": rate})
            recorder.save_progress()
        print(status_line(recorder, stats), flush=True)
        if not self.hinted and (hint := stall_hint(self.cfg, stats)):
            self.hinted = True
            print(hint, flush=True)

    def stop_children(self) -> None:
        """Each child in order, given its time to stop cleanly (the learner its final checkpoint). A Ctrl-C while
        this waits (the second of a stop, ``stop_on_signals``) kills every child still running at once, and then
        goes on: nothing is left writing into the run directory or holding its ports after bin/train exits."""
        try:
            self._stop_children_in_order()
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # a third Ctrl-C must not interrupt the kill either
            for child in self.children.values():
                with contextlib.suppress(Exception):   # noqa: BLE001 - one child's error must not spare the rest
                    child.stop(timeout_s=0)            # SIGTERM, no wait, SIGKILL to its process group
            raise

    def _stop_children_in_order(self) -> None:
        children = self.children
        if "actors" in children:
            children["actors"].stop(timeout_s=30)   # first: their last ActorStats reach the buffer as they stop
        if children.get("buffer") and children["buffer"].alive():
            self.stats = buffer_stats(self.control, keys=self.keys) or self.stats
            if self.stats:
                self.recorder.observe_service(self.stats)
        for name in ("learner", "tensorboard", "buffer"):
            if name in children:
                children[name].stop(timeout_s=60 if name == "learner" else 30)

    def finish(self, extra: Optional[dict] = None) -> Optional[dict]:
        """Evaluate the final weights (unless the last evaluation was of them), write the summary; None if failed."""
        evaluator, recorder, stats = self.evaluator, self.recorder, self.stats
        v = evaluator.final_version()
        if recorder.last_eval_version() != v:   # not when the last eval was of the final weights already
            v, res = evaluator.evaluate()
            recorder.eval_result(v, res)
        evaluator.close_milestones()
        evaluator.close()
        ledger = _read_json(self.run_dir / "ledger.json") or (stats or {}).get("ledger", {})
        summary = recorder.finish(v, ledger, extra={"mode": self.cfg.run.mode, "failed": self.failed,
                                                    "buffer_metrics": (stats or {}).get("metrics", {}),
                                                    **(extra or {})},
                                  phases=(stats or {}).get("phases"))   # as the buffer heard them, actors stopped
        self.monitor.close()
        return None if self.failed else summary


STALL_GROUPS = 20   # groups filtered for one outcome, with none trained yet, before bin/train says why it waits


def stall_hint(cfg: Config, stats: dict) -> Optional[str]:
    """Why nothing trains, once it is clear: dynamic sampling has dropped many groups, all of one outcome."""
    led = stats.get("ledger", {})
    if led.get("trained", 0) or led.get("filtered_uniform", 0) < STALL_GROUPS * cfg.actor.group_size:
        return None
    rate = stats.get("metrics", {}).get("rollout/success_rate")
    if rate is None or rate != rate:
        which = "each had a single outcome"
    elif rate < 0.05:
        which = "all failed: the policy never succeeds (start from an SFT checkpoint: policy.path)"
    elif rate > 0.95:
        which = "all succeeded: the tasks are already solved by this policy"
    else:
        which = "each had a single outcome (some init states always succeed, the others always fail)"
    return (f"[train] nothing trained yet: buffer.dynamic_sampling dropped {led['filtered_uniform']} trajectories "
            f"whose groups {which}; the learner waits for mixed-outcome groups (or set buffer.dynamic_sampling=false)")


def status_line(recorder: RunRecorder, stats: dict) -> str:
    m = stats.get("metrics", {})
    led = stats.get("ledger", {})
    best = max((p["success_rate"] for p in recorder.eval_points), default=None)
    steps = m.get("perf/env_steps_per_s")
    lag = m.get("buffer/lag_mean")
    # "--": the actors' first stats are not in yet (they report every actor.stats_every_s)
    # The buffer says 0 until the learner's first request; a resumed part's learner starts at its checkpoint.
    version = max(int(stats.get("learner_version", 0) or 0), recorder.resumed_at[-1] if recorder.resumed_at else 0)
    # The actors' latest stats windows (actor.stats_every_s) hold a handful of episodes on a slow simulator:
    # say how many, so 1.00 over 2 episodes does not read like a run-level figure.
    episodes = m.get("rollout/episodes")
    over = f" ({episodes:.0f} ep)" if episodes else ""
    return (f"[{recorder.wall():6.0f}s] learner v{version}"
            f" | rollout success {fmt_rate(m.get('rollout/success_rate'))}{over} | best eval {fmt_rate(best)}"
            f" | received {stats.get('received', '?')} trained {led.get('trained', '?')}"
            f" uniform {led.get('filtered_uniform', '?')} stale {led.get('stale', '?')}"
            f" | lag {'--' if lag is None or lag != lag else f'{lag:.2f}'}"
            f" | env steps/s {'--' if not steps else f'{steps:.0f}'}")


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
