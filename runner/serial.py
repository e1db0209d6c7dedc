"""Serial mode (``run.mode=serial``): actor, buffer and learner in one process and one thread: ``SerialActor``,
``GroupBuffer`` and ``TorchLearner`` wired by direct calls, trajectories still through the wire encoding
(``LocalPipe``), the actor sharing the learner's policy object (a weight swap is a version bump).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from async_vla.config import Config, write_resolved
from async_vla.messages import PolicyTag
from async_vla.metrics import Monitor
from async_vla.phases import PhaseClock, phase_scalars, phase_table
from async_vla.transport import LocalPipe
from runner.evaluator import HeldOut
from runner.report import RunRecorder

log = logging.getLogger("runner.serial")


def run_serial(cfg: Config, run_dir: Path, *, resume: bool = False) -> dict:
    """Train until ``run.max_versions``, ``run.max_wall_s``, ``run.target_success`` or SIGINT / SIGTERM / SIGHUP;
    returns the summary. A signal ends the run as the budget does, between two groups or two versions: a final
    evaluation, checkpoint, policy and summary (``stopped_on: signal``), as in async mode. Signal handlers can only
    be set from the main thread; called from another thread, signals keep their default actions."""
    from runner.launch import stop_on_signals

    run = SerialRun(cfg, run_dir, resume)
    stop, restore_signals = stop_on_signals() if threading.current_thread() is threading.main_thread() \
        else ({"flag": False}, lambda: None)
    run.stop_requested = lambda: stop["flag"]
    try:
        run.evaluate_start()
        while run.learner.version < cfg.run.max_versions:
            if run.stopping():
                break
            groups = run.next_batch()        # roll out groups until the buffer forms a batch
            if groups is None:               # the budget ran out or a signal came while rolling out
                run.stopping()
                break
            metrics = run.train(groups)      # one learner step; the actor gets the weights it should sample with
            with run.learners_turn("report"):
                run.recorder.learner_step(run.learner.version, metrics, run.buffer)
            if run.evaluate_if_due():        # True: run.target_success reached
                break
            with run.learners_turn("checkpoint"):
                run.checkpoint_if_due()
            with run.learners_turn("report"):
                run.status_if_due()
        return run.finish()
    finally:
        restore_signals()
        run.close()


class SerialRun:
    """The pieces of a serial run and the loop's counters. Built in the order that fixes the random streams (the
    seed, the policy, the envs, the learner, the actor), so a serial run of a seed repeats exactly. Actor, learner
    and buffer each keep a PhaseClock over the one thread (docs/BENCHMARKS.md "Where each process's time
    goes")."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool):
        import torch

        from actors.actor import SerialActor
        from async_vla.buffer import GroupBuffer
        from async_vla.envs import make_env
        from async_vla.policy import build_policy
        from learner.torch_engine import TorchLearner

        learner_phases, actor_phases = PhaseClock(), PhaseClock()
        self.buffer_phases = PhaseClock(rest="idle")
        with learner_phases.phase("startup"), actor_phases.phase("startup"), self.buffer_phases.phase("startup"):
            self.cfg, self.run_dir = cfg, run_dir
            torch.set_num_threads(max(1, cfg.actor.torch_threads))
            write_resolved(cfg, run_dir)
            torch.manual_seed(cfg.run.seed)   # the same start for every run of this seed (random init, sampling)
            self.policy = build_policy(cfg)
            self.envs = [make_env(cfg, seed=cfg.run.seed * 1000 + i) for i in range(cfg.actor.group_size)]
            self.task_ids = list(cfg.env.task_ids if cfg.env.task_ids is not None else self.envs[0].task_ids)
            self.learner = TorchLearner(cfg, self.policy, phases=learner_phases)
            self.ckpt_dir = run_dir / "checkpoints"
            self.extra: dict = {}
            if resume and self.ckpt_dir.exists():
                with learner_phases.phase("checkpoint"):
                    self.extra = self.learner.load_checkpoint(self.ckpt_dir)
                log.info("resumed at version %d", self.learner.version)
            self.lag = cfg.run.serial_lag
            # serial_lag > 0: the actor gets its own copy of the policy and the weights of `lag` versions ago.
            actor_policy = copy.deepcopy(self.policy) if self.lag else self.policy
            self.snapshots: collections.deque = collections.deque(maxlen=self.lag + 1)
            if self.lag:
                self._snapshot()
            self.actor = SerialActor(cfg, 0, actor_policy, self.envs, tag=self.policy_tag(self.learner.version),
                                     phases=actor_phases)
            self.buffer = GroupBuffer.from_config(cfg, run_id=cfg.run.name, valid_task_ids=self.task_ids)
            self.buffer.set_learner_version(self.learner.version)
            self.pipe = LocalPipe(capacity=cfg.actor.group_size * 4)
            self.monitor = Monitor(run_dir, enabled=cfg.logging.tensorboard)
            self.recorder = RunRecorder(cfg, run_dir, self.monitor, resume=resume)
            self.held_out = HeldOut(cfg, self.policy, self.envs, self.task_ids)
            if resume:
                self.recorder.mark_resumed(self.learner.version)
        self.t_start = time.perf_counter()
        self.last_status = time.perf_counter()
        self.stop_requested: Callable[[], bool] = lambda: False   # run_serial sets the signal flag's reader

    def policy_tag(self, version: int) -> PolicyTag:
        return PolicyTag(self.learner.lineage.id, version)

    def phase_tables(self) -> dict[str, dict]:
        """Seconds by phase of actor, learner and buffer so far (``phases.phase_table``, one process each)."""
        return {"actor": phase_table([self.actor.phases.seconds()]),
                "learner": phase_table([self.learner.phases.seconds()]),
                "buffer": phase_table([self.buffer_phases.seconds()])}

    @contextlib.contextmanager
    def evaluating(self):
        """The time inside is every clock's ``eval``."""
        with self.actor.phases.phase("eval"), self.learner.phases.phase("eval"), self.buffer_phases.phase("eval"):
            yield

    @contextlib.contextmanager
    def learners_turn(self, name: str):
        """The time inside is the learner's ``name`` and the actor's ``weights`` (it waits for the learner)."""
        with self.learner.phases.phase(name), self.actor.phases.phase("weights"):
            yield

    def _snapshot(self) -> None:
        self.snapshots.append((self.learner.version,
                               {k: v.detach().clone() for k, v in self.policy.state_dict().items()}))

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t_start > self.cfg.run.max_wall_s

    def stopping(self) -> bool:
        """True (and the summary's reason noted) once a stop signal came or the wall-time budget is spent."""
        if self.stop_requested():
            log.info("stop signal: finishing at version %d", self.learner.version)
            self.recorder.stopped_on = "signal"
            return True
        if self.out_of_time():
            log.info("wall-time budget reached at version %d", self.learner.version)
            return True
        return False

    def evaluate_start(self) -> None:
        resumed = self.recorder.last_eval_version() == self.learner.version   # the last part ended with this eval
        if not resumed and (self.cfg.run.eval_at_start or self.learner.version > 0):
            with self.evaluating():
                self.recorder.eval_result(self.learner.version, self.held_out.score())
        self.last_status = time.perf_counter()

    def next_batch(self) -> Optional[list]:
        """Grant, roll out and feed groups to the buffer (through the wire encoding) until it forms a batch; None
        once ``run.max_wall_s`` is over or a stop signal came first. A collapsed policy under dynamic sampling fills
        almost no group, so one batch can take thousands of rollouts: the budget must hold inside it too."""
        with self.learner.phases.phase("wait_batch"):
            return self._next_batch()

    def _next_batch(self) -> Optional[list]:
        actor, buffer = self.actor.phases.phase, self.buffer_phases.phase
        while True:
            if self.stop_requested() or self.out_of_time():
                return None
            with actor("wait_grant"), buffer("deliver"):
                self.buffer.expire()
                got = self.buffer.take_batch(self.learner.version)
            if got is not None:
                return got[1]
            with actor("wait_grant"), buffer("control"):
                ids = self.buffer.grant(0, want=1)
            if not ids:
                raise RuntimeError("serial mode: buffer granted nothing and has no batch (check buffer.max_groups "
                                   "and buffer.groups_per_batch)")
            for traj in self.actor.run_one_group(ids[0]):
                with actor("send"):
                    self.pipe.send(traj)
                    self.recorder.rollout(traj)
                    while True:
                        with buffer("receive"):
                            msg = self.pipe.recv()
                        if msg is None:
                            break
                        with buffer("admit"):
                            self.buffer.add(msg)

    def train(self, groups: list) -> dict:
        """One learner step, then the actor's weights: the shared policy (already updated in place), or with
        ``run.serial_lag`` = k the snapshot of k versions ago."""
        with self.actor.phases.phase("weights"):   # the learner's train_step charges its own phases
            metrics = self.learner.train_step(groups)
            self.buffer.set_learner_version(self.learner.version)
            if self.lag:
                self._snapshot()
                version, state = self.snapshots[0]  # the oldest kept: `lag` versions ago once the deque is full
                self.actor.set_weights(self.policy_tag(version), state)
            else:
                self.actor.set_weights(self.policy_tag(self.learner.version))
        wall = time.perf_counter() - self.t_start
        tables = self.phase_tables()
        metrics.update(phase_scalars(tables))
        metrics.update({
            "perf/learner_idle_frac": tables["learner"]["frac"].get("wait_batch", 0.0),  # waiting for rollouts
            "weights/sync_s": 0.0, "weights/bytes": 0.0, "weights/version": float(self.learner.version),
            "perf/env_steps_per_s": self.actor.totals.env_steps / max(wall, 1e-9),
            "perf/trajectories_per_s": self.buffer.received / max(wall, 1e-9),
            "perf/tokens_per_s": metrics.get("perf/learner_tokens_per_s", 0.0),
        })
        return metrics

    def evaluate_if_due(self) -> bool:
        """Evaluate at every ``run.eval_every``-th version; True once ``run.target_success`` is reached."""
        every, version = self.cfg.run.eval_every, self.learner.version
        if not every or version % every:
            return False
        with self.evaluating():
            return self.held_out.record(self.recorder, version, self.held_out.score())

    def checkpoint_if_due(self) -> None:
        every = self.cfg.run.checkpoint_every
        if every and self.learner.version % every == 0:
            self.learner.save_checkpoint(self.ckpt_dir, extra={"ledger": self.buffer.ledger})

    def status_if_due(self) -> None:
        if time.perf_counter() - self.last_status > self.cfg.logging.status_every_s:
            self.last_status = time.perf_counter()
            print(self.recorder.status_line(self.learner.version, self.buffer), flush=True)

    def finish(self) -> dict:
        """A last evaluation (unless this version was just evaluated), checkpoint, policy, ledger, summary."""
        version = self.learner.version
        if self.recorder.last_eval_version() != version:
            with self.evaluating():
                self.recorder.eval_result(version, self.held_out.score())
        with self.learners_turn("checkpoint"):
            self.learner.save_checkpoint(self.ckpt_dir, extra={"ledger": self.buffer.ledger, **self.extra})
            self.learner.export_policy(self.run_dir / "policy")
        self.buffer.write_ledger(self.run_dir)
        return self.recorder.finish(version, self.buffer.ledger_snapshot(), extra={"mode": "serial"},
                                    phases=self.phase_tables())

    def close(self) -> None:
        self.monitor.close()
        self.actor.close()


def main_serial(cfg: Config, run_dir: Path, resume: bool = False) -> Optional[dict]:
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tensorboard = None
    if cfg.logging.serve_tensorboard:   # the one process besides this one that serial mode starts
        from runner.launch import start_tensorboard

        tensorboard = start_tensorboard(cfg, run_dir)
    try:
        return run_serial(cfg, run_dir, resume=resume)
    finally:
        if tensorboard is not None:
            tensorboard.stop(timeout_s=10)
