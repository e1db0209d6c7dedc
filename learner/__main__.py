"""Learner process: ``bin/learner CONFIG [section.field=value ...] --run-dir DIR [--resume] [--ranks N]``.

What one rank does: build the policy (same seed on every rank) -> ``DeepSpeedLearner`` (or ``TorchLearner``
with ``learner.backend=torch``, one rank) -> optionally resume from ``DIR/checkpoints`` -> publish the current
weights -> loop { ``BatchRequest(rank, world, version)`` to the buffer's control endpoint -> this rank's share
of the batch -> ``train_step`` -> (rank 0) publish weights via ``async_vla.weights.WeightPublisher`` every
``weights.publish_every`` versions (all ranks join the ZeRO-3 gathers) -> metrics to TensorBoard (rank 0) ->
checkpoint every ``run.checkpoint_every`` versions } until ``run.max_versions`` or ``run.max_wall_s`` or
SIGTERM/SIGINT, then a final checkpoint and an exported policy in ``DIR/policy``.

Ranks stay in lock-step: after every poll of the buffer they all-reduce (have-my-share, stop) flags, so
they enter each step together and stop together (a rank stopping alone would hang the others' ZeRO-3
collectives).

Launching N ranks (all equivalent; each rank reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT):

    bin/learner CONFIG --run-dir DIR --ranks 2                       # this script starts the ranks itself
    torchrun --nproc_per_node 2 bin/learner CONFIG learner.num_ranks=2 --run-dir DIR
    deepspeed --num_gpus 8 bin/learner CONFIG learner.num_ranks=8 --run-dir DIR
    # multi-node: the same launcher's hostfile / rendezvous, e.g.
    deepspeed --hostfile hosts.txt bin/learner CONFIG learner.num_ranks=16 --run-dir DIR   # "host slots=8" lines
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29500 \\
        bin/learner CONFIG learner.num_ranks=16 --run-dir DIR

Without launcher variables and without ``--ranks`` (or ``learner.num_ranks``) > 1, this is a world of one.
The config is parsed (and rejected with a readable message) before torch or DeepSpeed is imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
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
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(n: int, args: argparse.Namespace, overrides: list[str]) -> int:
    """Start ranks 0..n-1 as subprocesses with torchrun-style variables; stop all if one fails."""
    from async_vla.child_process import die_with_parent

    port = _free_port()
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
class _Batches:
    """This rank's side of the control channel: one outstanding BatchRequest at a time."""

    def __init__(self, cfg: Any, run_dir: Path, rank: int, world: int):
        from async_vla.transport import CurveKeys, endpoints

        self.cfg, self.rank, self.world = cfg, rank, world
        self.endpoint = endpoints(cfg.transport, run_dir, side="connect")["control"]
        self.keys = CurveKeys.load(cfg.transport.curve_dir, "client") if cfg.transport.curve else None
        self.client = self._connect()
        self.pending = False
        self.sent_at = 0.0
        self.reconnects = 0

    def _connect(self) -> Any:
        from async_vla.transport import ControlClient

        ident = f"learner-{self.rank}-{os.getpid()}-{time.monotonic_ns()}".encode()
        return ControlClient(self.endpoint, identity=ident, keys=self.keys)

    def poll(self, version: int) -> Optional[list[list[Any]]]:
        """Ask for (or keep waiting on) this rank's share; a list of groups, or None if not ready yet."""
        from async_vla.messages import BatchRequest
        from async_vla.transport import ControlTimeout

        timeout = self.cfg.learner.batch_timeout_s
        if not self.pending:
            try:
                self.client.request(BatchRequest(rank=self.rank, world=self.world, version=version,
                                                 timeout_s=timeout), timeout_s=timeout)
            except ControlTimeout as exc:  # never block in a send: the buffer is gone for long
                log.warning("%s: reconnecting", exc)
                self._reconnect()
                return None
            self.pending, self.sent_at = True, time.monotonic()
        bad_before = self.client.malformed.total
        got = self.client.recv_bundle(timeout_s=timeout + 0.5)
        if got is None:
            if self.client.malformed.total > bad_before:
                self.pending = False  # a reply we could not read (e.g. a refused request): ask again
            elif time.monotonic() - self.sent_at > timeout + self.cfg.learner.reply_grace_s:
                # No reply at all: the buffer restarted (our request died with it) or is gone.
                log.warning("no reply from the buffer at %s for %.0f s: reconnecting", self.endpoint,
                            time.monotonic() - self.sent_at)
                self._reconnect()
            return None
        self.pending = False
        header, members = got
        if not getattr(header, "ready", False):
            return None
        sizes = list(header.group_sizes)
        if sum(sizes) != len(members) or not sizes:
            log.warning("batch %s: %d members for group sizes %s: dropped", header.batch_id, len(members), sizes)
            return None
        groups, pos = [], 0
        for s in sizes:
            groups.append(members[pos:pos + s])
            pos += s
        return groups

    def _reconnect(self) -> None:
        """A fresh socket (new identity): any late reply to the old one is dropped, never mistaken for ours."""
        self.client.close()
        self.client = self._connect()
        self.pending = False
        self.reconnects += 1

    def buffer_stats(self, timeout_s: float = 2.0) -> dict:
        """The buffer's ledger and counters (for the checkpoint), {} if it does not answer."""
        from async_vla.messages import ControlCommand
        from async_vla.transport import ControlClient

        from async_vla.transport import ControlTimeout

        client = ControlClient(self.endpoint, identity=f"learner-stats-{os.getpid()}".encode(), keys=self.keys)
        try:
            reply = client.call(ControlCommand("stats"), timeout_s=timeout_s)
            if getattr(reply, "command", "") == "stats" and isinstance(reply.value, str):
                return json.loads(reply.value)
        except (ValueError, json.JSONDecodeError, ControlTimeout):
            pass
        finally:
            client.close()
        return {}

    def close(self) -> None:
        self.client.close()


def _make_publisher(cfg: Any, run_dir: Path) -> Any:
    try:
        from async_vla.weights import WeightPublisher
    except ImportError as exc:
        log.warning("async_vla.weights unavailable (%s): weights are not broadcast", exc)
        return None
    return WeightPublisher(cfg, run_dir)


def publish_weights(learner: Any, publisher: Any, verify_ranks: bool = False) -> dict:
    """Every rank calls: rank 0 hands the gathered weights to the publisher; all ranks finish the gathers.

    ``verify_ranks``: then every rank gathers the full weights again and the ranks agree (all-reduce of
    min / max) that their checksums equal the one rank 0's publisher computed from the buckets it sent, which
    is also what each receiver checks before it acknowledges (``confirmed``): rank r == broadcast == actor.
    """
    import torch

    # No clone: the publisher copies each tensor into its bucket at once, inside the ZeRO-3 gather (so never
    # publish(..., zero_copy=True) here: that would keep references to parameters the gather releases).
    items = learner.full_state_items(copy=False)
    stats: dict = {}
    t0 = time.perf_counter()
    try:
        if publisher is not None:
            stats = dict(publisher.publish(learner.version, items) or {})
    except Exception:  # noqa: BLE001 - a broken broadcast must not stop training (actors fall back)
        log.exception("weight publish of v%d failed", learner.version)
    finally:
        for _ in items:  # a publisher that stopped early must not leave the other ranks in a gather
            pass
    stats.setdefault("sync_s", time.perf_counter() - t0)
    if verify_ranks:
        from async_vla.weight_buckets import checksum

        mine = checksum(list(learner.full_state_items(all_ranks=True)))
        sent = float(stats.get("checksum", mine)) if publisher is not None else mine
        t = torch.tensor([mine, -mine, sent, -sent], dtype=torch.float64)
        hi_mine, neg_lo_mine, hi_sent, neg_lo_sent = learner._all_reduce(t, "max").tolist()
        ok = hi_mine == -neg_lo_mine == hi_sent == -neg_lo_sent  # every rank's gather == the broadcast checksum
        stats["rank_checksum_ok"] = float(ok)
        if not ok:
            log.error("v%d: learner ranks' gathered weights differ from the broadcast (checksums %s..%s vs %s)",
                      learner.version, -neg_lo_mine, hi_mine, hi_sent)
    return stats


def run_rank(cfg: Any, run_dir: Path, resume: bool) -> int:
    import warnings

    import numpy as np
    import torch

    # DeepSpeed 0.19 calls c10d collectives torch 2.13 marks deprecated: one warning per call, every step.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    from async_vla.metrics import Monitor
    from async_vla.policy import build_policy
    from async_vla.policy.interface import write_policy_version
    from learner.core import TorchLearner, checkpoint_tag, latest_tag, tensors_digest

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.learner.torch_threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        from async_vla.config import write_resolved
        write_resolved(cfg, run_dir)
    policy = build_policy(cfg)
    if cfg.learner.backend == "torch":
        if world != 1:
            log.error("learner.backend=torch runs one rank; use backend=deepspeed for %d ranks", world)
            return 2
        learner = TorchLearner(cfg, policy)
    else:
        from learner.deepspeed_engine import DeepSpeedLearner
        learner = DeepSpeedLearner(cfg, policy)
    ckpt_dir = run_dir / "checkpoints"

    def digests() -> dict:
        """Every rank calls: sha256 of the full parameters (rank 0) and of this rank's optimizer state."""
        if not cfg.learner.checkpoint_digest:
            return {}
        return {"params": tensors_digest(learner.full_state_items()), "optimizer": learner.optimizer_digest()}

    if resume and latest_tag(ckpt_dir) is not None:
        tag = latest_tag(ckpt_dir)
        extra = learner.load_checkpoint(ckpt_dir)
        log.info("resumed at version %d (buffer ledger at the checkpoint: %s)", learner.version,
                 (extra.get("buffer_ledger") or {}).get("ledger", "n/a"))
        if cfg.learner.checkpoint_digest:
            write_resume_report(run_dir, ckpt_dir / tag, rank, learner.version, digests())
    elif resume and any(ckpt_dir.glob("v*")):
        # Checkpoints exist but none is usable: starting at 0 would roll the buffer (and the run) back silently.
        raise SystemExit(f"--resume: {ckpt_dir} holds checkpoint directories but no complete one that "
                         f"{ckpt_dir / 'latest'} points at; pass the run without --resume to start over, or fix "
                         "the 'latest' file to name a complete checkpoint")
    elif resume:
        log.warning("--resume: no checkpoint in %s, starting at version 0", ckpt_dir)

    stop = {"signal": False}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # a closed terminal: a clean stop, checkpointed
        signal.signal(sig, lambda *_: stop.__setitem__("signal", True))
    monitor = Monitor(run_dir, enabled=cfg.logging.tensorboard and rank == 0,
                      flush_secs=cfg.logging.tensorboard_flush_s)
    publisher = _make_publisher(cfg, run_dir) if rank == 0 else None
    batches = _Batches(cfg, run_dir, rank, world)
    t_start = time.monotonic()

    def agree(flags: list[float], op: str) -> list[float]:
        return learner._all_reduce(torch.tensor(flags, dtype=torch.float64), op).tolist()

    def checkpoint() -> None:
        t0 = time.perf_counter()
        extra = {"buffer_ledger": batches.buffer_stats() if rank == 0 else {}}
        saved = digests()
        learner.save_checkpoint(ckpt_dir, extra=extra)
        if saved:  # for the resume check (a kill between save and this leaves a checkpoint without it: unchecked)
            (ckpt_dir / checkpoint_tag(learner.version) / f"digest_rank{rank:05d}.json").write_text(json.dumps(saved))
        if rank == 0:
            monitor.scalar("learner/checkpoint_s", time.perf_counter() - t0, learner.version)

    def log_weights(stats: dict) -> None:
        values = {"weights/sync_s": float(stats.get("sync_s", 0.0)), "weights/bytes": float(stats.get("bytes", 0)),
                  "weights/receivers": float(stats.get("receivers", 0)),
                  "weights/confirmed": float(stats.get("confirmed", 0)),
                  "weights/shared_memory": float(stats.get("transport") == "shm"),
                  "weights/doorbell": float(bool(stats.get("doorbell"))),
                  "weights/shm_pinned_remakes": float(stats.get("shm_remade", 0)),
                  "weights/version": float(learner.version)}
        if "rank_checksum_ok" in stats:
            values["weights/rank_checksum_ok"] = stats["rank_checksum_ok"]
        monitor.scalars(values, learner.version)

    # actors (and a resumed run's actors) get this version
    log_weights(publish_weights(learner, publisher, cfg.weights.verify_ranks))
    last_ckpt = last_published = learner.version
    t_mark, idle = time.monotonic(), 0.0
    groups = None
    try:
        while learner.version < cfg.run.max_versions:
            # ---- wait for every rank's share, or a stop decided together
            t_wait = time.monotonic()
            while True:
                if groups is None:
                    groups = batches.poll(learner.version)
                out_of_time = time.monotonic() - t_start > cfg.run.max_wall_s
                have_none, stop_any = agree([float(groups is None), float(stop["signal"] or out_of_time)], "max")
                if stop_any or have_none == 0:
                    break
            idle += time.monotonic() - t_wait
            if stop_any:
                break
            metrics = learner.train_step(groups)
            groups = None
            version = learner.version
            t_pub = time.monotonic()
            # Counted from the last publish, not version % p (the version moves one per batch today, but a
            # rule that cannot step over every multiple of p stays right if that changes).
            if version - last_published >= cfg.weights.publish_every:
                last_published = version
                wstats = publish_weights(learner, publisher, cfg.weights.verify_ranks)
                if rank == 0:
                    log_weights(wstats)
            if rank == 0:
                now = time.monotonic()
                interval = max(now - t_mark, 1e-9)
                metrics.update({
                    "perf/learner_idle_frac": idle / interval,
                    "perf/trajectories_per_s": metrics["learner/trajectories"] / interval,
                    "perf/env_steps_per_s": metrics["learner/env_steps"] / interval,
                    "perf/tokens_per_s": metrics["learner/tokens"] / interval,
                    "perf/publish_s": now - t_pub,
                })
                monitor.scalars(metrics, version)
                monitor.histogram("learner/lag", np.asarray(learner.last_lags, dtype=np.float64), version)
                log.info("v%d loss %.4f clip %.3f/%.3f is_w %.3f lag %.2f step %.2fs idle %.0f%%", version,
                         metrics["loss/policy"], metrics["loss/clip_frac_low"], metrics["loss/clip_frac_high"],
                         metrics["offpolicy/is_weight_mean"], metrics["learner/lag_mean"],
                         metrics["perf/learner_step_s"], 100 * metrics["perf/learner_idle_frac"])
            t_mark, idle = time.monotonic(), 0.0
            every = cfg.run.checkpoint_every
            if every and version // every > last_ckpt // every:
                checkpoint()
                last_ckpt = version
    finally:
        batches.close()
    if learner.version != last_ckpt or not (ckpt_dir / "latest").is_file():
        checkpoint()
    learner.export_policy(run_dir / "policy")
    if rank == 0:   # which version <run>/policy holds (bin/train evaluates it when weights.export is off)
        write_policy_version(run_dir / "policy", learner.version)
    if publisher is not None:
        for fn in ("wait_export", "close"):
            if hasattr(publisher, fn):
                getattr(publisher, fn)()
    monitor.close()
    log.info("stopped at version %d (%d skipped steps)", learner.version, learner.skipped_steps)
    return 0


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
