"""A Slurm heterogeneous-job script for a config (component 0: buffer and learner ranks; component 1: one actor fleet
per node), the commands of runner/commands.py, no shared filesystem needed (config, actor-side CURVE keys and the
actor secret streamed over ``srun``'s stdin). ``render_sbatch`` is pure; ``bin/slurm`` writes it. Details:
docs/ARCHITECTURE.md "Slurm script"."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from async_vla.config import Config
from runner.commands import REPO, component_argv, shell_join

MARGIN_S = 3600   # the wall-time limit leaves this much past run.max_wall_s for checkpoint, export and final eval


@dataclass
class SlurmLayout:
    """Where things run. ``learner_gpus`` = learner ranks on the learner node (learner.num_ranks)."""

    actor_nodes: int = 1
    actors_per_node: Optional[int] = None      # None: actor.num_actors
    learner_gpus: Optional[int] = None         # None: learner.num_ranks
    actor_gpus_per_node: int = 1
    learner_cpus: int = 16
    actor_cpus_per_node: int = 32
    partition: Optional[str] = None
    repo: str = str(REPO)
    run_dir: Optional[str] = None              # on the learner node; None: <run.out_dir>/<run.name> in REPO


def slurm_time(seconds: float) -> str:
    """Slurm's D-HH:MM:SS for a wall-time limit, rounded up to the minute."""
    minutes = -(-int(seconds) // 60)
    days, minutes = divmod(minutes, 24 * 60)
    return f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"


def render_sbatch(cfg: Config, layout: SlurmLayout) -> str:
    """The sbatch script (bash) that runs ``cfg`` with ``layout``."""
    ranks = layout.learner_gpus or cfg.learner.num_ranks
    if ranks != cfg.learner.num_ranks:
        cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"num_ranks": ranks})})
    if not cfg.transport.weights_fetch_port:   # actor nodes fetch exports from the buffer: a port they know
        cfg = cfg.model_copy(update={"transport": cfg.transport.model_copy(update={"weights_fetch_port": 5558})})
    per_node = layout.actors_per_node or cfg.actor.num_actors
    run_dir = layout.run_dir or str(Path(layout.repo) / cfg.run.out_dir / cfg.run.name)
    config_text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    marker = "ASYNC_VLA_CONFIG"
    if marker in config_text:
        raise ValueError(f"the config contains the here-document marker {marker!r}: rename what contains it")
    q = shlex.quote
    server = ["${SERVER[@]}"]   # the learner node's: serve beyond loopback, with CURVE
    buffer = shell_join(component_argv("buffer", "$CONFIG", "$RUN_DIR", overrides=server, python=None, repo="$REPO"))
    learner = shell_join(component_argv("learner", "$CONFIG", "$RUN_DIR", overrides=server, python=None,
                                        repo="$REPO", ranks=ranks))
    # On each actor node: $0 the checkout, $1 the node-local directory, $2 the learner node's host name.
    actors = shell_join(component_argv(
        "actors", "$1/config.yaml", "$1/run", python=None, repo="$0", num=per_node,
        first_id=f"$((SLURM_PROCID * {per_node}))",
        overrides=["transport.connect_host=$2", "transport.curve=true", "transport.curve_dir=$1/keys",
                   "transport.actor_secret_file=$1/secrets/actors", "weights.fetch=true"]))

    def sbatch(lines: list[str], gpus: int) -> list[str]:
        out = [f"#SBATCH {line}" for line in lines]
        if gpus:
            out.append(f"#SBATCH --gpus-per-node={gpus}")
        if layout.partition:
            out.append(f"#SBATCH --partition={layout.partition}")
        return out

    head = [
        "#!/bin/bash",
        f"# async_vla run {cfg.run.name}: buffer + {ranks} learner rank(s) on one node (component 0),",
        f"# {per_node} actor(s) on each of {layout.actor_nodes} node(s) (component 1). Rendered by bin/slurm.",
        f"#SBATCH --job-name={cfg.run.name}",
        f"#SBATCH --time={slurm_time(cfg.run.max_wall_s + MARGIN_S)}",
        "#SBATCH --output=slurm-%j.out",
        *sbatch(["--nodes=1", "--ntasks=1", f"--cpus-per-task={layout.learner_cpus}"], ranks),
        "#SBATCH hetjob",
        *sbatch([f"--nodes={layout.actor_nodes}", "--ntasks-per-node=1",
                 f"--cpus-per-task={layout.actor_cpus_per_node}"], layout.actor_gpus_per_node),
    ]
    body = f"""
set -euo pipefail

REPO={q(layout.repo)}   # the same checkout (and .venv) on every node
RUN_DIR={q(run_dir)}   # on the learner node
ACTOR_DIR="/tmp/async_vla-$SLURM_JOB_ID"   # node-local scratch on each actor node
CONFIG="$RUN_DIR/config.yaml"
mkdir -p "$RUN_DIR"
cat > "$CONFIG" <<'{marker}'
{config_text}{marker}

LEARNER_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)"
"$REPO/bin/keys" "$RUN_DIR/keys" --force
# The run's actor secret (async_vla/learner_secret.py: 32 random bytes, hex, 0600 in a 0700 folder), made here
# since the actor bundle needs it before the buffer starts; the learner's secret never leaves this node.
(umask 077 && mkdir -p "$RUN_DIR/secrets" && if [ ! -s "$RUN_DIR/secrets/actors" ]; then
    od -An -N32 -tx1 /dev/urandom | tr -d ' \\n' > "$RUN_DIR/secrets/actors"; fi)
# The config, the actor secret and the actor side of the keys to every actor node, over srun's stdin.
tar -C "$RUN_DIR" -cf "$RUN_DIR/actor-bundle.tar" config.yaml secrets/actors keys/server.key keys/client.key keys/client.key_secret
# shellcheck disable=SC2016  # $1 is expanded by the bash on each actor node
srun --het-group=1 --ntasks-per-node=1 --input=all \\
    bash -c 'mkdir -p "$1" && tar -xf - -C "$1"' _ "$ACTOR_DIR" < "$RUN_DIR/actor-bundle.tar"

# The weight-rendezvous store has no authentication of its own: only the actor nodes may reach it.
ACTOR_PEERS="$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1" | xargs -n 1 getent ahostsv4 \\
    | awk '{{print $1}}' | sort -u | paste -sd, -)"
SERVER=(transport.host=0.0.0.0 transport.curve=true "transport.curve_dir=$RUN_DIR/keys"
        "transport.weights_allowed_peers=[$ACTOR_PEERS]")
srun --het-group=0 --ntasks=1 --overlap {buffer} > "$RUN_DIR/buffer.log" 2>&1 &
BUFFER_PID=$!
sleep 10   # the buffer binds its sockets; actors and learner ranks would retry anyway
srun --het-group=0 --ntasks=1 --overlap {learner} > "$RUN_DIR/learner.log" 2>&1 &
LEARNER_PID=$!
# One fleet per node; node i's actors have ids i*{per_node} .. (SLURM_PROCID: the task's index in this step).
# shellcheck disable=SC2016  # expanded by the bash on each actor node
srun --het-group=1 --ntasks-per-node=1 bash -c {q("exec " + actors)} "$REPO" "$ACTOR_DIR" "$LEARNER_HOST" \\
    > "$RUN_DIR/actors.log" 2>&1 &
ACTORS_PID=$!

# The learner ends the run (run.max_versions / run.max_wall_s); then actors, then the buffer (final ledger).
set +e
wait "$LEARNER_PID"
LEARNER_RC=$?
kill -TERM "$ACTORS_PID" 2>/dev/null
wait "$ACTORS_PID"
kill -TERM "$BUFFER_PID" 2>/dev/null
wait "$BUFFER_PID"
set -e
if [ "$LEARNER_RC" -eq 0 ]; then
  # greedy held-out success of the final policy
  "$REPO/bin/eval" "$RUN_DIR/policy" "$CONFIG" --json > "$RUN_DIR/final_eval.json" 2> "$RUN_DIR/eval.log"
fi
exit "$LEARNER_RC"
"""
    return "\n".join(head) + "\n" + body
