"""Helpers shared by an actor process and the fleet (no torch): an actor writes ``<run>/actors/actor_<i>.json``
atomically on every heartbeat (pid, time, state, version, counters); the fleet reads these to find hung actors
and for its status line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse


def status_path(run_dir: os.PathLike | str, actor_id: int) -> Path:
    """Where actor ``actor_id`` writes its heartbeat status."""
    return Path(run_dir) / "actors" / f"actor_{actor_id}.json"


def sent_log_path(run_dir: os.PathLike | str, actor_id: int) -> Path:
    """Where actor ``actor_id`` appends one line per trajectory its socket accepted: "<buffer incarnation> <traj_id>"
    (across restarts; the incarnation is the one whose grant the actor heard last, "-" before any)."""
    return Path(run_dir) / "actors" / f"sent_{actor_id}.log"


def read_sent_logs(run_dir: os.PathLike | str) -> dict[str, list[str]]:
    """Every actor's sent log: buffer incarnation -> trajectory ids, in the order they were sent."""
    out: dict[str, list[str]] = {}
    for path in sorted((Path(run_dir) / "actors").glob("sent_*.log")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split(" ")
            if len(parts) == 2:        # a line cut short by a kill -9 mid-write is not a send
                out.setdefault(parts[0], []).append(parts[1])
    return out


def log_path(run_dir: os.PathLike | str, actor_id: int) -> Path:
    """The one log file of actor ``actor_id`` (appended to across restarts)."""
    return Path(run_dir) / "logs" / f"actor_{actor_id}.log"


def write_status(path: Path, data: dict) -> None:
    """Write atomically (tmp + rename) so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_status(path: Path) -> Optional[dict]:
    """The last status an actor wrote, or None if there is none (yet) or it is unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def parse_connect(connect: str) -> dict[str, str]:
    """``--connect`` value -> {"trajectory": ep, "control": ep}: ``tcp://HOST:PORT`` (control on PORT+1),
    ``TRAJ_EP,CONTROL_EP``, or ``ipc://DIR`` (``DIR/trajectory`` and ``DIR/control``)."""
    parts = [p.strip() for p in connect.split(",") if p.strip()]
    if len(parts) == 2:
        return {"trajectory": parts[0], "control": parts[1]}
    if len(parts) != 1:
        raise ValueError(f"--connect {connect!r}: expected tcp://HOST:PORT or TRAJ_ENDPOINT,CONTROL_ENDPOINT")
    ep = parts[0]
    if ep.startswith("ipc://"):
        base = ep[len("ipc://"):].rstrip("/")
        return {"trajectory": f"ipc://{base}/trajectory", "control": f"ipc://{base}/control"}
    url = urlparse(ep)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"--connect {connect!r}: expected tcp://HOST:PORT (PORT = trajectory port, PORT+1 = control)")
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    return {"trajectory": f"tcp://{host}:{url.port}", "control": f"tcp://{host}:{url.port + 1}"}
