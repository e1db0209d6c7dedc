"""run.launcher=ray on a local multi-node Ray cluster (several raylets with distinct resources on this machine):
buffer and learner on the driver's node, two actor fleets spread over two actor nodes; one actor node is removed
mid-run, Ray restarts its fleet on the other, whose actor fetches the current weights export from the buffer's
node (no shared run directory), training goes on, and a Ctrl-C ends the run with summary and ledger intact. And a
learner of two ranks placed one Ray actor per rank (ray.learner_placement=per_rank) on two nodes: losing rank 1's
node ends the run, or with ray.learner_restarts=1 the ranks start again from the checkpoint and the run goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster

from timing import slack

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "env.num_train_init_states=8", "env.num_eval_init_states=2", "buffer.groups_per_batch=2",
    "actor.group_size=4", "env.envs_per_actor=4", "learner.lr=1e-4", "transport.trajectory_port=0",
    "transport.control_port=0",
    "transport.batch_port=0", "transport.weights_port=0", "logging.status_every_s=2", "run.eval_every=0",
    "buffer.dynamic_sampling=false", "learner.micro_batch_trajectories=8", "run.max_wall_s=400",
]
GIB = 1024**3


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "memory": 3 * GIB,
                                                      "resources": {"learner_node": 1}})
    actor_nodes = [c.add_node(num_cpus=2, memory=2 * GIB, resources={"actor_node": 2}) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, actor_nodes
    finally:
        c.shutdown()


def wait_for(pred, timeout_s: float, proc: subprocess.Popen, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.kill()
    out, _ = proc.communicate()
    raise AssertionError(f"{what} did not happen:\n{out[-4000:]}")


@pytest.mark.slow
@pytest.mark.timeout(900)   # ~5 min on this 2-core machine under a load average of 20-30 (3 raylets + a run)
def test_ray_launcher_survives_losing_an_actor_node(tmp_path, cluster):
    c, actor_nodes = cluster
    argv = [sys.executable, str(REPO / "bin" / "train"), str(REPO / "configs" / "quickstart.yaml"),
            f"run.out_dir={tmp_path}", "run.name=ray", "run.mode=async", "run.max_versions=1000", *SMALL,
            "run.launcher=ray", f"ray.address={c.address}", "ray.fleets=2", "actor.num_actors=1",
            "ray.fleet_resources={actor_node: 1}", "ray.buffer_memory_gb=0.5"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    try:
        run_and_lose_a_node(c, actor_nodes, proc, tmp_path / "ray")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def placed(rd: Path):
    """<run>/ray.json once every component runs somewhere."""
    try:
        p = json.loads((rd / "ray.json").read_text())
    except (OSError, ValueError):
        return None
    return p if p["buffer"] and p["learner"] and all(p["fleets"]) else None


def restarted_actor_fetch(rd: Path) -> list[int]:
    """Versions fleet0's actor fetched from the buffer's node since its last start (its log is node-local)."""
    log = Path(json.loads((rd / "ray.json").read_text())["fleet_dirs"][0]) / "run" / "logs" / "actor_0.log"
    try:
        since_restart = log.read_text().split("==== fleet: starting actor 0")[2:]
    except OSError:
        return []
    return [int(line.split("fetched export v")[1].split()[0]) for part in since_restart
            for line in part.splitlines() if "fetched export v" in line]


def run_and_lose_a_node(c, actor_nodes, proc, rd: Path):
    placement = wait_for(lambda: placed(rd), 400, proc, "placement")
    fleet_nodes = [nodes[-1] for nodes in placement["fleets"]]
    ids = {n.node_id for n in actor_nodes}
    assert set(fleet_nodes) == ids, (fleet_nodes, ids)              # one fleet on each actor node (SPREAD)
    assert placement["buffer"] == placement["learner"] == [placement["driver_node"]]

    def version() -> int:
        try:
            return int((rd / "weights" / "latest").read_text().strip()[1:].split(".")[0])
        except (OSError, ValueError):
            return 0

    wait_for(lambda: version() >= 2, 400, proc, "version 2")
    lost = next(n for n in actor_nodes if n.node_id == fleet_nodes[0])
    c.remove_node(lost)                                            # fleet0's node goes away mid-run
    # Ray restarts fleet0 on the node left; with no access to the run directory its actor fetches the current
    # export from the buffer's node instead of starting from the initial weights; training goes on.
    fetched = wait_for(lambda: restarted_actor_fetch(rd), 400, proc, "the restarted actor's weights fetch")
    assert fetched[0] >= 2
    at_fetch = version()
    wait_for(lambda: version() >= at_fetch + 2, 400, proc, "two more versions")
    proc.send_signal(signal.SIGINT)                                # stop the run as Ctrl-C does
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["final_version"] >= at_fetch + 2 and summary["launcher"] == "ray"
    survivor = next(n.node_id for n in actor_nodes if n is not lost)
    assert summary["ray"]["fleet_restarts"] >= 1, summary["ray"]
    assert summary["ray"]["fleet_nodes"][0][-1] == survivor        # restarted on the node that is left
    assert "fleet0 restarted by Ray" in out
    ledger = json.loads((rd / "ledger.json").read_text())
    assert ledger["received"] == sum(ledger["ledger"].values())
    assert ledger["ledger"]["trained"] >= summary["final_version"] * 2 * 4


@pytest.fixture
def two_learner_nodes():
    """The driver's (head) node and one more, each with one learner_node slot: a rank asking for one per rank
    puts rank 0 on the head (the driver's node) and rank 1 on the other, where the actor fleet runs too."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "memory": 3 * GIB,
                                                      "resources": {"learner_node": 1}})
    other = c.add_node(num_cpus=2, memory=2 * GIB, resources={"learner_node": 1, "actor_node": 1})
    c.wait_for_nodes()
    try:
        yield c, other
    finally:
        c.shutdown()


def trained_versions(path: Path) -> list[tuple[int, str]]:
    """(version, learner lineage) of each batch a rank trained, from its learner_lags_rank<k>.jsonl."""
    return [(r["version"], r["lineage"]) for r in map(json.loads, path.read_text().splitlines())]


def per_rank_train(c, tmp_path: Path, name: str, *extra: str) -> list[str]:
    """bin/train of a learner of two ranks, one Ray actor each on a node with a learner_node slot (rank 0 on the
    driver's), and one fleet of one actor on an actor_node; ``extra`` overrides come last (they win)."""
    return [sys.executable, str(REPO / "bin" / "train"), str(REPO / "configs" / "quickstart.yaml"),
            f"run.out_dir={tmp_path}", f"run.name={name}", "run.mode=async", *SMALL, "run.eval_at_start=false",
            "learner.num_ranks=2", "run.launcher=ray", f"ray.address={c.address}", "ray.learner_placement=per_rank",
            "ray.learner_resources={learner_node: 1}", "ray.fleets=1", "actor.num_actors=1",
            "ray.fleet_resources={actor_node: 1}", "ray.buffer_memory_gb=0.5", *extra]


TRAIN_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


@pytest.mark.slow
@pytest.mark.timeout(900)   # a Ray cluster of two raylets, a buffer, two ranks and a fleet on this 2-core machine
def test_ray_learner_ranks_on_two_nodes(tmp_path, two_learner_nodes):
    c, other = two_learner_nodes
    argv = per_rank_train(c, tmp_path, "ranks", "run.max_versions=3")
    # A per-rank request that no node can hold for rank 0 is refused before anything starts, as a preflight error.
    too_big = subprocess.run(argv + ["run.name=too_big", "ray.learner_resources={learner_node: 2}"],
                             capture_output=True, text=True, cwd=REPO, env=TRAIN_ENV, timeout=slack(300))
    assert too_big.returncode == 2, too_big.stdout[-3000:] + too_big.stderr[-3000:]
    assert "cannot start:" in too_big.stderr and "ray.learner_resources" in too_big.stderr, too_big.stderr[-3000:]
    assert "Traceback" not in too_big.stderr
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=TRAIN_ENV)
    try:
        out, _ = proc.communicate(timeout=slack(600))   # the run ends itself at run.max_versions
    finally:
        if proc.poll() is None:
            proc.kill()
            out, _ = proc.communicate()
    rd = tmp_path / "ranks"
    assert proc.returncode == 0, out[-6000:]
    where = json.loads((rd / "ray.json").read_text())
    rank_nodes = [nodes[-1] for nodes in where["learner_ranks"]]
    assert rank_nodes == [where["driver_node"], other.node_id], where   # rank 0 with the run directory
    assert where["learner"] == where["learner_ranks"][0]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["final_version"] == 3 and summary["launcher"] == "ray"
    assert [nodes[-1] for nodes in summary["ray"]["learner_rank_nodes"]] == rank_nodes
    assert summary["ray"]["learner_restarts"] == []
    # Both ranks trained the same batches, versions 0, 1, 2, in one lineage (their lock-step all-reduces).
    rank0, rank1 = (trained_versions(rd / f"learner_lags_rank{k}.jsonl") for k in (0, 1))
    assert [v for v, _ in rank0] == [0, 1, 2] and rank1 == rank0
    # Rank 1 ran from its node-local directory (config shipped there, removed when it stopped: the log stays) and
    # stopped cleanly, checkpointed.
    rank1_dir = Path(where["learner_dirs"][1])
    assert rank1_dir != rd and not (rank1_dir / "config.yaml").exists()
    assert "stopped at version 3" in (rank1_dir / "logs" / "learner_rank1.log").read_text()
    assert "stopped at version 3" in (rd / "logs" / "learner_rank0.log").read_text()


def batches_trained(path: Path) -> int:
    try:
        return len(trained_versions(path))
    except (OSError, ValueError):   # not there yet, or a line being written
        return 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_losing_a_learner_ranks_node_ends_the_run_naming_the_rank(tmp_path, two_learner_nodes):
    """Without ray.learner_restarts (the default, 0): rank 1's node goes, the run ends (rank 0 stopped), failed,
    and says which rank and node."""
    c, other = two_learner_nodes
    proc = subprocess.Popen(per_rank_train(c, tmp_path, "lost", "run.max_versions=1000"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=TRAIN_ENV)
    rd = tmp_path / "lost"
    try:
        wait_for(lambda: batches_trained(rd / "learner_lags_rank1.jsonl"), slack(400), proc, "a first trained batch")
        c.remove_node(other)                                   # rank 1's node goes away mid-run
        out, _ = proc.communicate(timeout=slack(400))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out[-6000:]
    # Rank 1 is named with its node: as lost, or (when rank 0's broken collective is seen first) beside rank 0's
    # error as lost / not answering.
    failure = next(line for line in out.splitlines() if "[train] learner rank" in line)
    assert f"rank 1 on node {other.node_id[:12]}" in failure, out[-6000:]
    assert "lost" in failure or "not answering" in failure, failure
    assert "the run ends (ray.learner_restarts=0" in out, out[-6000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["failed"] and summary["stopped_on"] == "failed"


@pytest.fixture
def three_learner_nodes():
    """The driver's (head) node, with one learner_node slot and the actor fleet, and two more nodes with one
    learner_node slot each: rank 1 runs on one of them, and once that node is lost a restarted rank 1 fits on the
    other (a placement group places all ranks on the nodes alive)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "memory": 3 * GIB,
                                                      "resources": {"learner_node": 1, "actor_node": 1}})
    others = [c.add_node(num_cpus=1, memory=GIB, resources={"learner_node": 1}) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, others
    finally:
        c.shutdown()


def checkpointed_and_past(rd: Path) -> int:
    """The latest checkpoint's version once rank 1 has trained a batch from it (so every rank has written its part:
    a rank checkpoints before its next step, whose collectives wait for every rank). Each line of the lag log names
    the version its batch started at; a batch started at the checkpoint's version counts, so the condition holds
    for about half of the run (checkpoint_every=2), not only between a batch and the next checkpoint."""
    try:
        tag = (rd / "checkpoints" / "latest").read_text().strip()
        trained = trained_versions(rd / "learner_lags_rank1.jsonl")
    except (OSError, ValueError):
        return 0
    return int(tag[1:]) if tag[1:].isdigit() and trained and trained[-1][0] >= int(tag[1:]) else 0


@pytest.mark.slow
@pytest.mark.timeout(900)   # three raylets, a buffer, two ranks started twice and a fleet on this 2-core machine
def test_with_a_restart_losing_a_learner_ranks_node_resumes_the_ranks_from_the_checkpoint(tmp_path,
                                                                                          three_learner_nodes):
    """ray.learner_restarts=1: rank 1's node goes after a checkpoint; both ranks start again, rank 1 on the node
    left, from that checkpoint; the buffer and the fleet keep running; the run reaches run.max_versions."""
    c, others = three_learner_nodes
    argv = per_rank_train(c, tmp_path, "restart", "run.max_versions=20", "run.checkpoint_every=2",
                          "ray.learner_restarts=1", "run.max_wall_s=800")   # counted from the first start
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=TRAIN_ENV)
    rd = tmp_path / "restart"
    try:
        at_loss = wait_for(lambda: checkpointed_and_past(rd), slack(400), proc, "a checkpoint trained past")
        where = json.loads((rd / "ray.json").read_text())
        lost = next(n for n in others if n.node_id == where["learner_ranks"][1][-1])
        c.remove_node(lost)                                    # rank 1's node goes away mid-run
        out, _ = proc.communicate(timeout=slack(600))          # the run ends itself at run.max_versions
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-6000:]
    failure = next(line for line in out.splitlines() if "[train] learner rank" in line)
    assert f"rank 1 on node {lost.node_id[:12]}" in failure, out[-6000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert not summary["failed"] and summary["final_version"] == 20, out[-6000:]
    (restart,) = summary["ray"]["learner_restarts"]
    c_version = restart["from_version"]
    assert c_version >= at_loss >= 2 and summary["resumed_at"] == [c_version]
    assert f"restart 1 of 1) from checkpoint v{c_version}," in out, out[-6000:]
    # The ranks again: rank 0 on the driver's node, rank 1 on the node left.
    survivor = next(n.node_id for n in others if n is not lost)
    after = json.loads((rd / "ray.json").read_text())
    assert [nodes[-1] for nodes in after["learner_ranks"]] == [after["driver_node"], survivor], after
    # Rank 0's batches: the first lineage up to the loss, then a second from the checkpoint's version on to the end,
    # trained in lock-step with the restarted rank 1 (whose node-local log is on the node left).
    rank0 = trained_versions(rd / "learner_lags_rank0.jsonl")
    second = rank0[-1][1]
    assert rank0[0][1] != second
    assert [v for v, s in rank0 if s == second] == list(range(c_version, 20))
    assert [r for r in trained_versions(rd / "learner_lags_rank1.jsonl") if r[1] == second] == \
        [r for r in rank0 if r[1] == second]
    assert "stopped at version 20" in (rd / "logs" / "learner_rank0.log").read_text()
    ledger = json.loads((rd / "ledger.json").read_text())
    assert ledger["received"] == sum(ledger["ledger"].values())
