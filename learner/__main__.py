"""Learner process: ``bin/learner CONFIG [section.field=value ...] --run-dir DIR [--resume] [--ranks N]``.

One rank: build the policy -> ``DeepSpeedLearner`` (``TorchLearner`` with ``learner.backend=torch``) -> resume from
``DIR/checkpoints`` if asked -> publish the weights -> loop { this rank's share of a batch from the buffer ->
``train_step`` -> publish every ``weights.publish_every`` versions -> checkpoint every ``run.checkpoint_every`` }
until ``run.max_versions``, ``run.max_wall_s`` or SIGTERM/SIGINT, ranks in lock-step; then a final checkpoint and the
policy in ``DIR/policy``. ``--ranks N`` starts N local ranks; torchrun, deepspeed and multi-node launches:
docs/LEARNER.md "Launching". The config is checked before torch or DeepSpeed is imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("learner")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bin/learner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", metavar="CONFIG", help="YAML config file")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.zero_stage=2")
    ap.add_argument("--run-dir", required=True, help="run directory (checkpoints, tb, weights)")
    ap.add_argument("--resume", action="store_true", help="continue from DIR/checkpoints/latest if present")
    ap.add_argument("--ranks", type=int, default=None,
                    help="start this many local ranks as subprocesses (default learner.num_ranks)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    return ap.parse_intermixed_args(argv)  # overrides before or after the --options


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from async_vla.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.ranks is not None:
        overrides.append(f"learner.num_ranks={args.ranks}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level,
                        format=f"%(asctime)s learner[{os.environ.get('RANK', '-')}] %(levelname)s %(message)s")
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    in_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not in_launcher and cfg.learner.num_ranks > 1:
        return launch(cfg.learner.num_ranks, args, overrides)
    if in_launcher and int(os.environ["WORLD_SIZE"]) != cfg.learner.num_ranks:
        print(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but learner.num_ranks={cfg.learner.num_ranks}: pass "
              f"learner.num_ranks={os.environ['WORLD_SIZE']} (the buffer splits batches by it)", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.learner.torch_threads))
    return run_rank(cfg, Path(args.run_dir), args.resume)


# ------------------------------------------------------------------------------------------ launcher
def launch(n: int, args: argparse.Namespace, overrides: list[str]) -> int:
    """Start ranks 0..n-1 as subprocesses with torchrun-style variables; stop all if one fails."""
    from async_vla.child_process import die_with_parent
    from async_vla.hosts import free_port

    port = free_port()
    child_args = [args.config, *overrides, "--run-dir", args.run_dir] + (["--resume"] if args.resume else [])
    procs: list[subprocess.Popen] = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        env.setdefault("OMP_NUM_THREADS", "1")
        # A launcher killed outright takes its ranks along (SIGTERM: they stop and checkpoint as on Ctrl-C).
        procs.append(subprocess.Popen([sys.executable, "-m", "learner", *child_args], env=env, cwd=str(REPO),
                                      preexec_fn=die_with_parent))

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:   # a hang-up becomes SIGTERM: ranks stop (and checkpoint) on INT/TERM only
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    rc = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and rc == 0:
            rc = failed[0].returncode
            log.error("learner rank exited with %d: stopping the other ranks", rc)
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + 30
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    return rc or next((p.returncode for p in procs if p.returncode), 0)


# ----------------------------------------------------------------------------------------- one rank
def run_rank(cfg: Any, run_dir: Path, resume: bool) -> int:
    """One rank: build, resume, publish, then train batch after batch until a stop; checkpoint and export."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.learner.backend == "torch" and world != 1:
        log.error("learner.backend=torch runs one rank; use backend=deepspeed for %d ranks", world)
        return 2
    r = RankRun(cfg, run_dir, rank, world)
    phase = r.learner.phases.phase   # where the rank's time goes (async_vla/phases.py); train_step charges its own
    with phase("checkpoint"):
        r.resume(resume)
    r.stop_on_signals()
    with phase("startup"):
        r.connect()          # monitor, batch client, and (rank 0) the weight publisher
    with phase("publish"):
        r.publish_first()    # actors (and a resumed run's actors) get this version
    try:
        while r.learner.version < cfg.run.max_versions:
            with phase("wait_batch"):
                groups = r.wait_for_share()     # this rank's share, or None when the ranks agreed to stop
            if groups is None:
                break
            start_version = r.learner.version
            metrics = r.learner.train_step(groups)
            with phase("publish"):
                publish_s = r.publish_if_due()
            with phase("report"):
                r.record_lags(start_version)
                r.report_step(metrics, publish_s)
            with phase("checkpoint"):
                r.checkpoint_if_due()
    finally:
        r.batches.close()
        r.lag_log.close()
    r.finish()
    return 0


class RankRun:
    """The state of one rank's run: learner, batch client, publisher (rank 0), monitor, and the counters the loop
    keeps (last checkpoint, last publish, idle time). Every method is called by every rank unless it says so."""

    def __init__(self, cfg: Any, run_dir: Path, rank: int, world: int):
        import warnings

        import torch

        # DeepSpeed 0.19 calls c10d collectives torch 2.13 marks deprecated: one warning per call, every step.
        warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)

        from async_vla.policy import build_policy

        self.cfg, self.run_dir, self.rank, self.world = cfg, run_dir, rank, world
        if not torch.cuda.is_available():
            torch.set_num_threads(cfg.learner.torch_threads)
        run_dir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            from async_vla.config import write_resolved
            write_resolved(cfg, run_dir)
        from async_vla.placement import claim_learner_device

        from async_vla.phases import PhaseClock

        phases = PhaseClock()   # the rank's (Learner.phases): building the policy and the engine is its startup
        with phases.phase("startup"):
            load = {"device": claim_learner_device(os.environ)}   # this rank's GPU, current before anything is built
            if cfg.learner.backend == "deepspeed":
                from learner.deepspeed_engine import policy_load_kwargs
                load = policy_load_kwargs(cfg, load["device"])    # ZeRO-3: on the CPU, then partitioned onto the GPU
            policy = build_policy(cfg, **load)
            if cfg.learner.backend == "torch":
                from learner.torch_engine import TorchLearner
                self.learner = TorchLearner(cfg, policy, phases=phases)
            else:
                from learner.deepspeed_engine import DeepSpeedLearner
                self.learner = DeepSpeedLearner(cfg, policy, phases=phases)
        self.ckpt_dir = run_dir / "checkpoints"
        self.monitor: Any = None
        self.publisher: Any = None
        self.batches: Any = None
        self.stop = {"signal": False}
        self.t_start = time.monotonic()
        self.mark = self.learner.phases.seconds()   # at the last step's report: the next one's interval starts here
        self.last_ckpt = self.last_published = self.learner.version

    def connect(self) -> None:
        from async_vla.buffer.client import BatchClient
        from async_vla.metrics import Monitor
        from learner.publish import make_publisher

        self.monitor = Monitor(self.run_dir, enabled=self.cfg.logging.tensorboard and self.rank == 0,
                               flush_secs=self.cfg.logging.tensorboard_flush_s)
        # This start's lineage (the ranks agree on its id among themselves, an all-reduce, whoever started them).
        lineage = self.learner.start_lineage()
        self.publisher = make_publisher(self.cfg, self.run_dir, lineage.id) if self.rank == 0 else None
        self.batches = BatchClient(self.cfg, self.run_dir, self.rank, self.world, lineage=lineage,
                                   phases=self.learner.phases)
        # line-buffered: a kill -9 loses at most the line being written
        self.lag_log = open(self.run_dir / f"learner_lags_rank{self.rank}.jsonl", "a", buffering=1)
        self.t_start = time.monotonic()

    def digests(self) -> dict:
        """sha256 of the full parameters (rank 0) and of this rank's optimizer state ({} when not asked for)."""
        from learner.checkpoint_files import tensors_digest

        if not self.cfg.learner.checkpoint_digest:
            return {}
        return {"params": tensors_digest(self.learner.full_state_items()),
                "optimizer": self.learner.optimizer_digest()}

    def resume(self, resume: bool) -> None:
        from learner.checkpoint_names import latest_tag

        ckpt_dir = self.ckpt_dir
        if resume and self.world > 1:   # before any rank loads: a rank alone at v0 would hang the others
            check_ranks_agree_on_checkpoint(latest_tag(ckpt_dir), ckpt_dir, self._agree)
        if resume and latest_tag(ckpt_dir) is not None:
            tag = latest_tag(ckpt_dir)
            extra = self.learner.load_checkpoint(ckpt_dir)
            log.info("resumed at version %d (buffer ledger at the checkpoint: %s)", self.learner.version,
                     (extra.get("buffer_ledger") or {}).get("ledger", "n/a"))
            if self.cfg.learner.checkpoint_digest:
                write_resume_report(self.run_dir, ckpt_dir / tag, self.rank, self.learner.version, self.digests())
        elif resume and any(ckpt_dir.glob("v*")):
            # Checkpoints exist but none is usable: starting at 0 would roll the buffer (and the run) back silently.
            raise SystemExit(f"--resume: {ckpt_dir} holds checkpoint directories but no complete one that "
                             f"{ckpt_dir / 'latest'} points at; pass the run without --resume to start over, or fix "
                             "the 'latest' file to name a complete checkpoint")
        elif resume:
            log.warning("--resume: no checkpoint in %s, starting at version 0", ckpt_dir)
        self.last_ckpt = self.last_published = self.learner.version

    def stop_on_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # a closed terminal: a clean stop, checkpointed
            signal.signal(sig, lambda *_: self.stop.__setitem__("signal", True))

    def _agree(self, flags: list[float], op: str) -> list[float]:
        import torch

        return self.learner._all_reduce(torch.tensor(flags, dtype=torch.float64), op).tolist()

    def wait_for_share(self) -> Optional[list]:
        """Poll the buffer until every rank has its share (then this rank's groups), or None once any rank wants
        to stop (signal, wall-clock budget): the ranks all-reduce the flags after every poll, so they enter each
        step together and stop together (a rank stopping alone would hang the others' ZeRO-3 collectives)."""
        groups = None
        while True:
            if groups is None:
                groups = self.batches.poll(self.learner.version)
            out_of_time = time.monotonic() - self.t_start > self.cfg.run.max_wall_s
            have_none, stop_any = self._agree([float(groups is None), float(self.stop["signal"] or out_of_time)],
                                              "max")
            if stop_any or have_none == 0:
                break
        return None if stop_any else groups

    def publish(self) -> None:
        from learner.publish import publish_weights, weight_metrics

        stats = publish_weights(self.learner, self.publisher, self.cfg.weights.verify_ranks)
        if self.rank == 0:
            self.monitor.scalars(weight_metrics(stats, self.learner.version), self.learner.version)

    def publish_first(self) -> None:
        """Publish the starting version; the first step's throughput is counted from here."""
        self.publish()
        self.mark = self.learner.phases.seconds()

    def publish_if_due(self) -> float:
        """Publish when ``weights.publish_every`` versions have passed; returns the seconds it took (0 if not due).

        Counted from the last publish, not version % p (the version moves one per batch today, but a rule that
        cannot step over every multiple of p stays right if that changes)."""
        t_pub = time.monotonic()
        if self.learner.version - self.last_published >= self.cfg.weights.publish_every:
            self.last_published = self.learner.version
            self.publish()
        return time.monotonic() - t_pub

    def report_step(self, metrics: dict, publish_s: float) -> None:
        """Rank 0: the step's metrics, throughput over the interval since the last step, and a log line."""
        import numpy as np

        from async_vla.phases import since

        took = since(self.learner.phases.seconds(), self.mark)
        self.mark = self.learner.phases.seconds()
        if self.rank == 0:
            version = self.learner.version
            interval = max(sum(took.values()), 1e-9)
            metrics.update({
                "perf/learner_idle_frac": took.get("wait_batch", 0.0) / interval,
                "perf/trajectories_per_s": metrics["learner/trajectories"] / interval,
                "perf/env_steps_per_s": metrics["learner/env_steps"] / interval,
                "perf/tokens_per_s": metrics["learner/tokens"] / interval,
                "perf/publish_s": publish_s,
            })
            self.monitor.scalars(metrics, version)
            self.monitor.histogram("learner/lag", np.asarray(self.learner.last_lags, dtype=np.float64), version)
            log.info("v%d loss %.4f clip %.3f/%.3f is_w %.3f lag %.2f step %.2fs idle %.0f%%", version,
                     metrics["loss/policy"], metrics["loss/clip_frac_low"], metrics["loss/clip_frac_high"],
                     metrics["offpolicy/is_weight_mean"], metrics["learner/lag_mean"],
                     metrics["perf/learner_step_s"], 100 * metrics["perf/learner_idle_frac"])

    def record_lags(self, start_version: int) -> None:
        """This rank's lags as trained, one line per batch: an audit's second witness beside the buffer's ledger."""
        import collections

        import numpy as np

        lags = collections.Counter(int(x) for x in np.asarray(self.learner.last_lags).tolist())
        self.lag_log.write(json.dumps({"version": start_version, "lineage": self.learner.lineage.id,
                                       "lags": {str(k): n for k, n in sorted(lags.items())}}) + "\n")

    def checkpoint(self) -> None:
        from learner.checkpoint_names import checkpoint_tag

        t0 = time.perf_counter()
        extra = {"buffer_ledger": self.batches.buffer_stats() if self.rank == 0 else {}}
        saved = self.digests()
        self.learner.save_checkpoint(self.ckpt_dir, extra=extra)
        if saved:  # for the resume check (a kill between save and this leaves a checkpoint without it: unchecked)
            path = self.ckpt_dir / checkpoint_tag(self.learner.version) / f"digest_rank{self.rank:05d}.json"
            path.write_text(json.dumps(saved))
        if self.rank == 0:
            self.monitor.scalar("learner/checkpoint_s", time.perf_counter() - t0, self.learner.version)

    def checkpoint_if_due(self) -> None:
        every, version = self.cfg.run.checkpoint_every, self.learner.version
        if every and version // every > self.last_ckpt // every:
            self.checkpoint()
            self.last_ckpt = version

    def finish(self) -> None:
        """A final checkpoint (unless the last one is current), the exported policy, and the publisher closed."""
        from async_vla.policy.build import write_policy_version
        from learner.publish import close_publisher

        if self.learner.version != self.last_ckpt or not (self.ckpt_dir / "latest").is_file():
            self.checkpoint()
        self.learner.export_policy(self.run_dir / "policy")
        if self.rank == 0:   # which version <run>/policy holds (bin/train evaluates it when weights.export is off)
            write_policy_version(self.run_dir / "policy", self.learner.version)
        close_publisher(self.publisher)
        self.monitor.close()
        log.info("stopped at version %d (%d skipped steps)", self.learner.version, self.learner.skipped_steps)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Its threads joined now: a group left to the interpreter's exit aborted a rank that had stopped cleanly
            # ("terminate called without an active exception", exit -6), once in a loaded two-rank test.
            dist.destroy_process_group()


def check_ranks_agree_on_checkpoint(tag: Optional[str], ckpt_dir: Path, agree: Any) -> None:
    """Every rank must resume from the same checkpoint. Ranks on several nodes each read ``ckpt_dir`` on their own
    node: without a shared run directory they see different ones (or none). ``agree(flags, "max")`` is the ranks'
    all-reduce; SystemExit on every rank alike (none is left waiting in a collective) when they differ."""
    version = float(tag[1:]) if tag and tag[1:].isdigit() else -1.0
    newest, minus_oldest = agree([version, -version], "max")
    if newest != -minus_oldest:
        def name(v: float) -> str:
            return f"v{int(v)}" if v >= 0 else "none"
        raise SystemExit(
            f"--resume: the learner ranks find different checkpoints in {ckpt_dir} (newest {name(newest)}, oldest "
            f"{name(-minus_oldest)}; this rank {name(version)}): ranks on several nodes read the run directory on "
            "their own node, so resuming needs it on a shared filesystem, or each rank's checkpoint files copied back "
            "to that path on its node")


def write_resume_report(run_dir: Path, ckpt: Path, rank: int, version: int, loaded: dict) -> None:
    """``<run>/learner_resume_rank<r>.json``: the digests after loading vs. those recorded at save time."""
    try:
        saved = json.loads((ckpt / f"digest_rank{rank:05d}.json").read_text())
    except (OSError, ValueError):
        saved = {}
    report = {"checkpoint": ckpt.name, "version": version, "pid": os.getpid(), "t": time.time(), "loaded": loaded,
              "saved": saved, "bit_equal": bool(saved) and saved == loaded}
    (run_dir / f"learner_resume_rank{rank:05d}.json").write_text(json.dumps(report, indent=1))
    if saved and saved != loaded:
        log.error("resumed state differs from the checkpoint's recorded digests: %s vs %s", loaded, saved)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
