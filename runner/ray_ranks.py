"""The learner's ranks as Ray actors, one per rank (``ray.learner_placement=per_rank``): each a ``ProcessHost``
running ``bin/learner`` with torchrun's variables (``rank_env``), all reserved as one placement group with rank 0
on the driver's node. A failed or lost rank stops the group; it starts again from the latest checkpoint while
``ray.learner_restarts`` allows (``restart_decision``). Placement, outputs and failures: docs/ARCHITECTURE.md
"Learner ranks as Ray actors"."""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from async_vla.config import Config, dump_config
from async_vla.learner_secret import learner_secret, secret_path
from runner.commands import component_argv
from runner.ray_host import CALL_TIMEOUT_S, PYTHON, RayProcess, ReturnCode

log = logging.getLogger("runner.ray_ranks")
PLACEMENT_TIMEOUT_S = 120.0   # the ranks' placement group must be reserved, and every rank started, within this
GIB = 1024**3


def rank_env(rank: int, world: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The torchrun-style variables of rank ``rank`` of ``world``; every rank is local rank 0 of its own devices."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def rank_request(cfg: Config) -> dict[str, float]:
    """One rank's Ray resources (a placement-group bundle): CPU, GPU, memory (bytes) and the custom ones."""
    rc = cfg.ray
    request = {"CPU": rc.learner_cpus, "GPU": rc.learner_gpus,
               "memory": float(int(rc.learner_memory_gb * GIB)) if rc.learner_memory_gb else 0.0,
               **rc.learner_resources}
    return {k: v for k, v in request.items() if v > 0}   # Ray refuses zero amounts in a bundle


def ranks_that_fit(request: dict[str, float], resources: dict[str, float]) -> int:
    """How many ranks asking ``request`` a node with ``resources`` (its totals) holds."""
    return min(int(resources.get(k, 0.0) / v + 1e-9) for k, v in request.items())


def _describe(request: dict[str, float]) -> str:
    return ", ".join(f"{k}={v / GIB:g} GiB" if k == "memory" else f"{k}={v:g}" for k, v in request.items())


def check_rank_placement(cfg: Config, nodes: list[dict], driver_node: str) -> None:
    """Raise ValueError (naming the fields and the fix) if the cluster's alive nodes (``ray.nodes()`` entries),
    even idle, cannot hold ``learner.num_ranks`` ranks of ``rank_request(cfg)`` with rank 0 on ``driver_node``."""
    n, request = cfg.learner.num_ranks, rank_request(cfg)
    fields = ("ray.learner_cpus / ray.learner_gpus / ray.learner_memory_gb / ray.learner_resources")
    alive = [node for node in nodes if node.get("Alive", True)]
    driver = next((node for node in alive if node["NodeID"] == driver_node), None)
    if driver is None:
        raise ValueError(f"the driver's node {driver_node[:12]} is not among the cluster's alive nodes")
    if ranks_that_fit(request, driver["Resources"]) < 1:
        short = {k: driver["Resources"].get(k, 0.0) for k, v in request.items() if driver["Resources"].get(k, 0.0) < v}
        raise ValueError(
            f"ray.learner_placement=per_rank runs learner rank 0 on the driver's node (where bin/train runs: run "
            f"directory, checkpoints), but each rank asks for {_describe(request)} ({fields}) and that node has "
            f"only {_describe(short) or 'none of it'}: run bin/train on a node that has them (e.g. a GPU node), "
            "or lower the per-rank request")
    held = {node["NodeID"]: ranks_that_fit(request, node["Resources"]) for node in alive}
    if sum(held.values()) < n:
        where = ", ".join(f"{node_id[:12]}: {k}" for node_id, k in held.items())
        raise ValueError(
            f"ray.learner_placement=per_rank: learner.num_ranks={n} ranks of {_describe(request)} each ({fields}), "
            f"but the cluster's nodes hold {sum(held.values())} even when idle ({where}): lower learner.num_ranks "
            "(buffer.groups_per_batch must stay a multiple of it), ask for less per rank, or add nodes")


@dataclass(frozen=True)
class RankFailure:
    """The rank that failed a rank group, its node (``RankGroup.node_of``) and what happened to it."""
    rank: int
    node: str
    what: str

    def __str__(self) -> str:
        return f"learner rank {self.rank} on node {self.node} {self.what}"


def restart_decision(failure: RankFailure, done: int, allowed: int,
                     checkpoint: Optional[int]) -> tuple[bool, str]:
    """Whether a failed rank group starts again after ``done`` of ``allowed`` restarts, from checkpoint version
    ``checkpoint`` (None: from version 0, as a resume of the run would), and the line that says so."""
    if done >= allowed:
        why = f"ray.learner_restarts={allowed} used up" if allowed else \
            "ray.learner_restarts=0: Ray restarts no learner rank"
        return False, f"[train] {failure}: the run ends ({why})"
    start = f"checkpoint v{checkpoint}" if checkpoint is not None else \
        "the start, version 0 (no checkpoint written yet)"
    return True, (f"[train] {failure}: restarting the learner's ranks (restart {done + 1} of {allowed}) from "
                  f"{start}, in a new placement group; the buffer and fleets keep running")


class RankGroup:
    """The learner's ranks as one child of the launcher (alive, stop, tail, proc.returncode): alive until every rank
    exited 0, or one failed or was lost (then the others are stopped, ``failure`` names it, ``proc.returncode`` is its
    code). ``start_again`` starts a new group of the same ranks with ``--resume``."""

    def __init__(self, ranks: list[Any], pg: Any, bundle_nodes: dict[int, str]):
        self.ranks, self.pg, self.bundle_nodes = ranks, pg, bundle_nodes
        self.name = "learner"
        self.proc = ReturnCode()
        self.failed_rank: Optional[int] = None
        self.failure: Optional[RankFailure] = None
        self.stopped = False
        self.start_again: Optional[Callable[[], "RankGroup"]] = None

    def node_of(self, rank: int) -> str:
        r = self.ranks[rank]
        node = r.nodes[-1] if r.nodes else self.bundle_nodes.get(rank, "?")
        return f"{node[:12]}" + (f" ({r.host})" if getattr(r, "host", "") else "")

    def alive(self) -> bool:
        if self.proc.returncode is not None:
            return False
        states = [r.state() for r in self.ranks]   # a list: poll every rank
        failed = [k for k, (r, state) in enumerate(zip(self.ranks, states))
                  if state == "dead" or (state == "exited" and r.proc.returncode != 0)]
        if failed:
            # A lost rank first: the others' errors (a collective with it broke) follow from it.
            k = min(failed, key=lambda k: (states[k] != "dead", k))
            r = self.ranks[k]
            what = "was lost (its actor or node died)" if states[k] == "dead" else \
                f"exited with code {r.proc.returncode}"
            others = "; ".join(f"rank {j} on node {self.node_of(j)}: {self.describe(j, states[j])}"
                               for j in range(len(self.ranks)) if j != k and states[j] != "running")
            print(f"[train] learner rank {k} on node {self.node_of(k)} {what}"
                  f"{f' ({others})' if others else ''}: stopping the other ranks", flush=True)
            self.failed_rank, self.failure = k, RankFailure(k, self.node_of(k), what)
            self.stop(timeout_s=30)
            self.proc.returncode = r.proc.returncode if states[k] == "exited" else 1
            return False
        if all(state == "exited" for state in states):
            self.proc.returncode = 0
            return False
        return True

    def describe(self, rank: int, state: str) -> str:
        if state == "exited":
            return f"exited with code {self.ranks[rank].proc.returncode}"
        return {"dead": "lost", "restarting": "not answering (its node may be lost)"}.get(state, state)

    def tail(self, n: int = 20) -> str:
        order = sorted(range(len(self.ranks)), key=lambda k: k != self.failed_rank)   # the failed rank's first
        return "\n".join(f"--- rank {k} on node {self.node_of(k)}\n{self.ranks[k].tail(n)}" for k in order)

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGTERM to every rank at once (they stop together, checkpointed, when none is lost), then the actors
        and the placement group go."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.stopped:
            return self.proc.returncode
        self.stopped = True
        pending = []
        for r in self.ranks:
            try:
                pending.append((r, r.handle.stop.remote(timeout_s)))
            except Exception as exc:   # noqa: BLE001 - a lost rank's actor cannot be asked: it is gone already
                log.info("%s: stop found it gone (%s)", r.name, type(exc).__name__)
        for r, ref in pending:
            try:
                code = ray.get(ref, timeout=timeout_s + CALL_TIMEOUT_S)
                r.proc.returncode = code if r.proc.returncode is None else r.proc.returncode
            except Exception as exc:   # noqa: BLE001 - stopping what is already gone is not an error
                log.info("%s: stop found it gone (%s)", r.name, type(exc).__name__)
        for r in self.ranks:
            ray.kill(r.handle, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        return self.proc.returncode


def rank_files(cfg: Config, rank_cfg: Config, workdir: str, key_files: dict[str, bytes],
               secret: bytes) -> tuple[dict, Config]:
    """The files a rank off the driver's node gets in its node-local ``workdir`` and the config it runs (which
    points at them): config.yaml, the learner secret (``secret``: the run's, async_vla/learner_secret.py), the
    client CURVE keys, the DeepSpeed JSON if ``learner.deepspeed_config``."""
    out = rank_cfg.model_copy(deep=True)
    files = {**key_files, "learner.secret": secret}
    out.transport.learner_secret_file = f"{workdir}/learner.secret"
    if cfg.transport.curve:
        out.transport.curve_dir = f"{workdir}/keys"
    if cfg.learner.deepspeed_config:
        files["deepspeed.json"] = Path(cfg.learner.deepspeed_config).read_bytes()
        out.learner.deepspeed_config = f"{workdir}/deepspeed.json"
    files["config.yaml"] = dump_config(out).encode()
    return files, out


def start_ranks(cfg: Config, cfg_path: Path, rank_cfg: Config, key_files: dict[str, bytes], run_dir: Path,
                resume: bool, driver_node: str, driver_ip: str, host_cls: Any) -> RankGroup:
    """Reserve the ranks' placement group (bundle 0 on the driver's node), start one ProcessHost per rank in it,
    and wait until every rank runs; RuntimeError (everything started is stopped) if that does not happen within
    PLACEMENT_TIMEOUT_S. main_ray has run ``check_rank_placement`` before starting anything."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n, rc, request = cfg.learner.num_ranks, cfg.ray, rank_request(cfg)
    pg = placement_group([request] * n, strategy="PACK", name=f"async_vla-{cfg.run.name}-learner",
                         bundle_label_selector=[{"ray.io/node-id": driver_node}] + [{}] * (n - 1))
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"ray.learner_placement=per_rank: {n} learner ranks of {_describe(request)} each (rank 0 on the "
            f"driver's node) could not be reserved within {PLACEMENT_TIMEOUT_S:.0f} s; free now: "
            f"{_describe(ray.available_resources())}. Other work holds them (the buffer and fleets too ask for "
            "CPUs): free them, lower the per-rank request (ray.learner_cpus / learner_gpus / learner_memory_gb / "
            "learner_resources), or add nodes") from None
    bundle_nodes = {int(k): v for k, v in placement_group_table(pg)["bundles_to_node_id"].items()}
    token = uuid.uuid4().hex[:8]   # this launch's ranks never reuse an earlier one's directory
    secret = learner_secret(secret_path(cfg.transport, run_dir))   # the run's (rank 0 and the buffer read it there)
    ranks: list[Any] = []
    for k in range(n):
        env = rank_env(k, n, driver_ip, rc.learner_master_port)
        if k == 0:   # the run directory is on this node: the resolved config as it is
            workdir, files, config_file = str(run_dir), {}, str(cfg_path)
        else:
            workdir = f"/tmp/async_vla-{cfg.run.name}-{token}-rank{k}"   # node-local
            files, _ = rank_files(cfg, rank_cfg, workdir, key_files, secret)
            config_file = f"{workdir}/config.yaml"
        argv = component_argv("learner", config_file, str(run_dir), python=PYTHON, resume=resume)
        opts: dict = dict(num_cpus=rc.learner_cpus, num_gpus=rc.learner_gpus, resources=dict(rc.learner_resources),
                          max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                              pg, placement_group_bundle_index=k))
        if rc.learner_memory_gb:
            opts["memory"] = int(rc.learner_memory_gb * GIB)
        handle = host_cls.options(**opts).remote(f"learner_rank{k}", argv, workdir, files, env, False)
        ranks.append(RayProcess(f"learner rank {k}", handle))
    group = RankGroup(ranks, pg, bundle_nodes)
    try:
        ray.get([r.handle.where.remote() for r in ranks], timeout=PLACEMENT_TIMEOUT_S)
    except Exception as exc:   # noqa: BLE001 - any way a rank fails to start: say which, stop the rest
        group.stop(timeout_s=10)
        raise RuntimeError(f"learner ranks did not all start within {PLACEMENT_TIMEOUT_S:.0f} s "
                           f"({type(exc).__name__}: {exc}):\n{group.tail()}") from exc
    # A restart is this launch again, resumed: same config, ports (MASTER_PORT: rank 0 runs on this node again)
    # and files; a new placement group and new node-local directories.
    group.start_again = functools.partial(start_ranks, cfg, cfg_path, rank_cfg, key_files, run_dir, True,
                                          driver_node, driver_ip, host_cls)
    return group
