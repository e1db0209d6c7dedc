"""Ray launcher (``run.launcher=ray``): the async / sync run of runner/launch.py on an existing Ray cluster, each
component a Ray actor (``ProcessHost``) running the same command (runner/commands.py). Buffer and learner rank 0
on the driver's node, fleets wherever their resources are; Ray restarts a failed buffer or fleet, a per-rank
learner group restarts from its checkpoint. Placement and failures: docs/ARCHITECTURE.md "Ray launcher"."""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from async_vla.config import Config, dump_config, load_config, write_resolved
from async_vla.learner_secret import actor_secret, actor_secret_path
from async_vla.transport import endpoints
from async_vla.placement import placed
from runner.commands import REPO, component_argv
from runner.launch import LaunchedRun, resolve_ports, start_tensorboard, stop_on_signals
from runner.preflight import CannotStart
from runner.ray_host import PYTHON, ProcessHost, RayProcess, ReturnCode
from runner.ray_ranks import RankGroup, check_rank_placement, restart_decision, start_ranks

log = logging.getLogger("runner.ray_launch")


class Fleets:
    """All actor fleets as one child: alive while any is; stop() stops them all."""

    def __init__(self, fleets: list[RayProcess]):
        self.fleets = fleets
        self.name = "actors"
        self.proc = ReturnCode()

    def alive(self) -> bool:
        return any([f.alive() for f in self.fleets])   # a list: poll every fleet (restart notices)

    def tail(self, n: int = 20) -> str:
        return "\n".join(f"--- {f.name}\n{f.tail(n)}" for f in self.fleets)

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        for f in self.fleets:
            f.stop(timeout_s)
        return 0

    def restarts(self) -> int:
        return sum(max(0, len(f.nodes) - 1) for f in self.fleets)


def join_cluster(cfg: Config) -> Any:
    import ray

    try:
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
                 log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise RuntimeError(f"ray.address={cfg.ray.address}: no Ray cluster to join ({exc}); start one with "
                           "`ray start --head` (and `ray start --address HEAD:6379` on the other nodes) or set "
                           "ray.address=HOST:PORT") from exc
    return ray


def fleet_transport(cfg: Config, driver_ip: str, node_ips: set[str]) -> Config:
    """The config the fleets (and ranks off the driver's node) run: connect to the driver's node. A loopback buffer with
    nodes elsewhere is an error naming the fix."""
    from async_vla.hosts import is_loopback

    t = cfg.transport
    if is_loopback(t.host):
        elsewhere = sorted(ip for ip in node_ips if ip != driver_ip)
        if elsewhere:
            raise RuntimeError(
                f"transport.host={t.host} is reachable from this host only, but the Ray cluster has nodes on "
                f"{', '.join(elsewhere)}: set transport.host=0.0.0.0 transport.curve=true transport.curve_dir=DIR "
                "(bin/keys DIR) and transport.weights_allowed_peers=[the actor nodes' addresses or network]")
        return cfg
    if t.use_ipc:
        raise RuntimeError("transport.use_ipc=true works on one host only: set transport.use_ipc=false")
    fleet_cfg = cfg.model_copy(deep=True)
    fleet_cfg.transport.connect_host = driver_ip
    return fleet_cfg


def with_fetch(cfg: Config) -> Config:
    """The fleets' config: weights.fetch on (they have no access to the learner's run directory)."""
    out = cfg.model_copy(deep=True)
    out.weights.fetch = True
    return out


def driver_address() -> tuple[str, str]:
    """(node id, address) of the driver's node: where the buffer and the learner (rank 0) run."""
    import ray

    driver_node = ray.get_runtime_context().get_node_id()
    return driver_node, next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == driver_node)


def client_key_files(cfg: Config) -> dict[str, bytes]:
    """The client side of the CURVE keys, for a node-local keys/ directory (never server.key_secret)."""
    if not cfg.transport.curve:
        return {}
    keys = Path(cfg.transport.curve_dir)
    return {f"keys/{name}": (keys / name).read_bytes() for name in ("server.key", "client.key", "client.key_secret")}


def start_ray_children(cfg: Config, run_dir: Path, cfg_path: Path, resume: bool) -> dict[str, Any]:
    """Buffer and learner (rank 0) on the driver's node, fleets (and other ranks) where their resources are; the
    buffer is waited for."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from runner.launch import client_keys, wait_for_buffer

    rc = cfg.ray
    driver_node, driver_ip = driver_address()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    remote_cfg = fleet_transport(cfg, driver_ip, {n["NodeManagerAddress"] for n in nodes})
    fleet_cfg = with_fetch(remote_cfg)
    here = NodeAffinitySchedulingStrategy(node_id=driver_node, soft=False)
    host_cls = ray.remote(ProcessHost)
    gib = 1024**3

    def on_driver(name: str, argv: list[str], cpus: float, gpus: float, memory_gb: Optional[float],
                  restarts: int, resources: Optional[dict] = None) -> RayProcess:
        opts: dict = dict(num_cpus=cpus, num_gpus=gpus, resources=dict(resources or {}), scheduling_strategy=here,
                          max_restarts=restarts, max_task_retries=-1)
        if memory_gb:
            opts["memory"] = int(memory_gb * gib)
        handle = host_cls.options(**opts).remote(name, argv, str(run_dir), {}, {}, restarts > 0)
        return RayProcess(name, handle)

    children: dict[str, Any] = {}
    try:
        buffer_mem = rc.buffer_memory_gb or (cfg.buffer.max_bytes + gib) / gib
        children["buffer"] = on_driver("buffer", component_argv("buffer", str(cfg_path), str(run_dir), python=PYTHON),
                                       rc.buffer_cpus, 0, buffer_mem, rc.max_restarts)
        wait_for_buffer(endpoints(cfg.transport, run_dir, side="connect")["control"], client_keys(cfg),
                        children["buffer"], 120)
        if rc.learner_placement == "per_rank":
            children["learner"] = start_ranks(cfg, cfg_path, remote_cfg, client_key_files(cfg), run_dir, resume,
                                              driver_node, driver_ip, host_cls)
        else:
            learner_argv = component_argv("learner", str(cfg_path), str(run_dir), python=PYTHON, resume=resume,
                                          ranks=cfg.learner.num_ranks)
            children["learner"] = on_driver("learner", learner_argv, rc.learner_cpus, rc.learner_gpus,
                                            rc.learner_memory_gb, 0, rc.learner_resources)
        secret = actor_secret(actor_secret_path(cfg.transport, run_dir))   # the run's (the buffer reads it there)
        children["actors"] = Fleets(start_fleets(cfg, fleet_cfg, host_cls, secret))
        if cfg.logging.serve_tensorboard:
            children["tensorboard"] = start_tensorboard(cfg, run_dir)
    except BaseException:
        for child in reversed(list(children.values())):
            child.stop(timeout_s=10)
        raise
    return children


def placement(children: dict[str, Any]) -> dict:
    """The nodes each component has run on (``ray list nodes`` names them); pending ones have none yet. With
    per-rank learner placement ``learner`` is rank 0's and ``learner_ranks`` / ``learner_dirs`` every rank's."""
    fleets, learner = children["actors"].fleets, children["learner"]
    out = {"buffer": children["buffer"].nodes, "learner": learner.nodes if not isinstance(learner, RankGroup)
           else learner.ranks[0].nodes, "fleets": [f.nodes for f in fleets], "fleet_dirs": [f.workdir for f in fleets]}
    if isinstance(learner, RankGroup):
        out.update(learner_ranks=[r.nodes for r in learner.ranks], learner_dirs=[r.workdir for r in learner.ranks])
    return out


def start_fleets(cfg: Config, fleet_cfg: Config, host_cls: Any, secret: bytes) -> list[RayProcess]:
    """``ray.fleets`` fleets of ``actor.num_actors`` actors (ids i*n ..), each in a node-local directory holding
    the config, the run's actor secret (``secret``, async_vla/learner_secret.py; never the learner's) and the
    client side of the CURVE keys."""
    rc, n = cfg.ray, cfg.actor.num_actors
    files = {"config.yaml": dump_config(fleet_cfg).encode(), "actor.secret": secret, **client_key_files(cfg)}
    eps = endpoints(fleet_cfg.transport, None, side="connect")
    fleets, token = [], uuid.uuid4().hex[:8]   # this launch's fleets never reuse an earlier one's directory
    for i in range(rc.fleets):
        workdir = f"/tmp/async_vla-{cfg.run.name}-{token}-fleet{i}"   # node-local
        argv = component_argv("actors", f"{workdir}/config.yaml", f"{workdir}/run", python=PYTHON, num=n,
                              first_id=i * n, connect=f"{eps['trajectory']},{eps['control']}",
                              overrides=[f"transport.actor_secret_file={workdir}/actor.secret"]
                              + ([f"transport.curve_dir={workdir}/keys"] if cfg.transport.curve else []))
        opts: dict = dict(num_cpus=rc.fleet_cpus or n * cfg.actor.torch_threads, num_gpus=rc.fleet_gpus,
                          resources=dict(rc.fleet_resources), max_restarts=rc.max_restarts, max_task_retries=-1)
        if rc.fleet_memory_gb:
            opts["memory"] = int(rc.fleet_memory_gb * 1024**3)
        if rc.fleet_spread:
            opts["scheduling_strategy"] = "SPREAD"
        handle = host_cls.options(**opts).remote(f"fleet{i}", argv, workdir, files, {}, True)
        fleets.append(RayProcess(f"fleet{i}", handle))
    return fleets


class RayRun(LaunchedRun):
    """LaunchedRun whose buffer and fleets Ray restarts and whose per-rank learner it starts again (``restart_ranks``):
    it fails only when the learner fails past its restarts, or Ray gave up on the buffer or every fleet."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool):
        super().__init__(cfg, run_dir, resume)
        self.rank_restarts: list[dict] = []          # summary.json's ray.learner_restarts
        self.ranks_started_at: Optional[float] = None   # time.monotonic() when the first rank group ran

    def learner_stopped(self) -> bool:
        learner = self.children["learner"]
        if isinstance(learner, RankGroup):
            # One look at the ranks per round: a second alive() could be the one that finds the rank lost, and
            # the run would end on it instead of restarting (seen under load in the restart test).
            if learner.alive():
                return False
            if learner.failure is not None:
                self.restart_ranks(learner)   # a new group in children["learner"], or the run ends with this one
        return super().learner_stopped()

    def restart_ranks(self, failed: RankGroup) -> None:
        """Start the failed group's ranks again (``failed.start_again``: --resume, a new placement group) if
        ``ray.learner_restarts`` allows; its ranks are already stopped and its placement group released. The run
        record follows the learner back to the checkpoint, as at a ``bin/train --resume``."""
        import ray

        from learner.checkpoint_names import latest_version

        version = latest_version(self.run_dir / "checkpoints")   # what rank 0 (on this node, the run dir) resumes
        restart, line = restart_decision(failed.failure, len(self.rank_restarts), self.cfg.ray.learner_restarts,
                                         version)
        print(line, flush=True)
        if not restart or failed.start_again is None:
            return
        self.rank_restarts.append({"rank": failed.failure.rank, "node": failed.failure.node,
                                   "what": failed.failure.what, "from_version": version or 0,
                                   "wall_s": round(self.recorder.wall(), 1)})
        self.rewind(version or 0)
        try:
            # The nodes left must hold the ranks at all; waiting out the placement timeout would not change that.
            check_rank_placement(self.cfg, ray.nodes(), ray.get_runtime_context().get_node_id())
            self.children["learner"] = failed.start_again()
        except (ValueError, RuntimeError) as exc:   # the run ends with the failed group (its return code)
            print(f"[train] the learner's ranks could not be started again: {exc}", flush=True)

    def rewind(self, version: int) -> None:
        """The learner goes on from its checkpoint at ``version``: eval and train points and milestone exports past it
        leave the record (updates that died with the failed ranks); the evaluator scores the next milestone past
        ``version``."""
        from async_vla.weights.export import milestones

        self.recorder.mark_resumed(version)
        self.recorder.save_progress(force=True)
        for v, path in milestones(self.run_dir / "weights"):
            if v > version:
                path.unlink(missing_ok=True)
        self.evaluator.version = min(self.evaluator.version, version)

    def out_of_time(self) -> bool:
        """After a restart: ``run.max_wall_s`` is over, counted from the first rank group's start. The learner
        counts it from its own start, so a restarted group alone would grant itself the whole budget again."""
        if not self.rank_restarts or self.ranks_started_at is None:
            return False   # the learner's own clock ends the run, as with every launcher
        if time.monotonic() - self.ranks_started_at <= self.cfg.run.max_wall_s:
            return False
        print(f"[train] run.max_wall_s={self.cfg.run.max_wall_s:g} reached (counted from the learner's first "
              "start, before its restart): stopping the run", flush=True)
        return True

    def children_healthy(self) -> bool:
        children = self.children
        if self.learner_stopped() or self.out_of_time():
            return False
        for name in ("buffer", "actors"):
            if not children[name].alive():
                print(f"[train] {name}: Ray gave up after ray.max_restarts={self.cfg.ray.max_restarts}:\n"
                      f"{children[name].tail()}", flush=True)
                self.failed = True
        return not self.failed


def resolve_master_port(cfg: Config, driver_ip: str) -> Config:
    """``ray.learner_master_port``: 0 becomes a free port of the driver's node (rank 0's); a given one must be
    free there. Checked here, as the transport's ports are by bin/train's preflight."""
    from async_vla.hosts import free_port
    from runner.preflight import busy_ports

    if cfg.ray.learner_master_port == 0:
        cfg.ray.learner_master_port = free_port(driver_ip)
    elif problems := busy_ports(driver_ip, [("ray.learner_master_port", cfg.ray.learner_master_port)]):
        raise RuntimeError("; ".join(problems))
    return cfg


def main_ray(cfg: Config, run_dir: Path, resume: bool = False) -> Optional[dict]:
    """Async / sync run on a Ray cluster; evaluated and reported from this host as by runner.launch.main_launch."""
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray = join_cluster(cfg)
    if cfg.transport.weights_fetch_port is None:   # fleets elsewhere fetch exports from the buffer's node
        cfg.transport.weights_fetch_port = 0
    if placed(cfg):   # Ray hands each learner and fleet its GPUs (ray.learner_gpus, ray.fleet_gpus)
        print("[train] run.launcher=ray: the placement section is ignored (Ray assigns the devices)", flush=True)
        cfg = cfg.model_copy(update={"placement": type(cfg.placement)()})
    cfg = resolve_ports(cfg)
    if cfg.ray.learner_placement == "per_rank":   # before anything starts: can the cluster hold the ranks at all?
        driver_node, driver_ip = driver_address()
        try:
            check_rank_placement(cfg, ray.nodes(), driver_node)
            cfg = resolve_master_port(cfg, driver_ip)
        except (ValueError, RuntimeError) as exc:
            ray.shutdown()
            raise CannotStart(str(exc)) from None
    cfg_path = write_resolved(cfg, run_dir)
    load_config(cfg_path)
    stop, restore_signals = stop_on_signals()
    run = RayRun(cfg, run_dir, resume)
    try:
        run.evaluate_start()
        resources = ray.cluster_resources()
        print(f"[train] Ray cluster {cfg.ray.address}: {len([n for n in ray.nodes() if n['Alive']])} nodes, "
              f"{resources.get('CPU', 0):.0f} CPUs, {resources.get('GPU', 0):.0f} GPUs", flush=True)
        run.children = start_ray_children(cfg, run_dir, cfg_path, resume)
        run.ranks_started_at = time.monotonic()
        driver_node = ray.get_runtime_context().get_node_id()
        last_where: dict = {}

        def record_where() -> None:   # <run>/ray.json: where each component runs now (children_healthy notes it)
            nonlocal last_where
            if (now := placement(run.children)) != last_where:
                last_where = json.loads(json.dumps(now))
                (run_dir / "ray.json").write_text(json.dumps({"driver_node": driver_node, **now}, indent=1))

        run.supervise(stop, tick=record_where)
    finally:
        run.stop_children()
        restore_signals()
    fleets, learner = run.children.get("actors"), run.children.get("learner")
    where = {"fleet_nodes": [f.nodes for f in fleets.fleets], "fleet_restarts": fleets.restarts()} \
        if isinstance(fleets, Fleets) else {}
    if isinstance(learner, RankGroup):   # the last group's ranks; each restart: which rank failed, where, from
        where.update(learner_rank_nodes=[r.nodes for r in learner.ranks], learner_restarts=run.rank_restarts)
    summary = run.finish(extra={"launcher": "ray", "ray": where})
    ray.shutdown()
    return summary
