"""A live async system on this host whose parts can be killed and restarted one by one: ``LiveSystem`` starts
``bin/buffer``, ``bin/learner`` and ``bin/actors`` (runner/commands.py) from one ``<run>/config.yaml`` without the
launcher's supervision; ``kill`` is SIGKILL, ``start_*`` brings a part back (the learner with ``--resume``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from actors.status import read_status, status_path
from async_vla.config import load_config, write_resolved
from async_vla.transport import endpoints
from runner.commands import REPO, component_argv
from runner.launch import Child, buffer_stats, client_keys, resolve_ports

DEFAULT_CONFIG = REPO / "configs" / "chaos.yaml"


class LiveSystem:
    """buffer + learner + actor fleet as separate processes; each one can be killed (-9) and started again."""

    def __init__(self, run_dir: Path, overrides: Optional[list[str]] = None, config: Optional[Path] = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = load_config(str(config or DEFAULT_CONFIG), list(overrides or []))
        self.cfg = resolve_ports(cfg)
        self.cfg_path = write_resolved(self.cfg, self.run_dir)
        eps = endpoints(self.cfg.transport, self.run_dir, side="connect")
        self.control = eps["control"]
        self.keys = client_keys(self.cfg)
        self.trajectory = eps["trajectory"]
        self.children: dict[str, Child] = {}
        self.starts: dict[str, int] = {}
        self.killed: set[str] = set()
        self.t0 = time.monotonic()

    # ---------------------------------------------------------------- processes
    def _start(self, name: str, argv: list[str]) -> Child:
        self.starts[name] = self.starts.get(name, 0) + 1
        child = Child(name if self.starts[name] == 1 else f"{name}.{self.starts[name]}", argv, self.run_dir)
        self.children[name] = child
        self.killed.discard(name)
        return child

    def start_buffer(self, timeout_s: float = 60) -> None:
        child = self._start("buffer", component_argv("buffer", str(self.cfg_path), str(self.run_dir)))
        self.wait(lambda: self.stats(0.5) is not None, timeout_s, "the buffer to answer", child=child)

    def start_learner(self, resume: bool = False) -> None:
        self._start("learner", component_argv("learner", str(self.cfg_path), str(self.run_dir), resume=resume))

    def start_actors(self) -> None:
        self._start("actors", component_argv("actors", str(self.cfg_path), str(self.run_dir),
                                             num=self.cfg.actor.num_actors,
                                             connect=f"{self.trajectory},{self.control}"))

    def start(self, min_version: int = 1, timeout_s: float = 240) -> None:
        """Buffer, learner, actors; returns once the learner has produced ``min_version``."""
        self.start_buffer()
        self.start_learner()
        self.start_actors()
        self.wait_version(min_version, timeout_s)

    def alive(self, name: str) -> bool:
        return name in self.children and self.children[name].alive()

    def pid(self, name: str) -> int:
        return self.children[name].proc.pid

    def kill(self, name: str) -> int:
        """SIGKILL a part (the whole process group: a learner's ranks, a fleet's actors die with it)."""
        child = self.children[name]
        self.killed.add(name)
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(30)
        child.stop()  # closes its log file
        return child.proc.returncode

    def stop(self) -> dict[str, Optional[int]]:
        """Ordered clean stop, as bin/train does: actors, learner (final checkpoint), buffer (final ledger)."""
        codes = {}
        for name in ("actors", "learner", "buffer"):
            if name in self.children:
                codes[name] = self.children[name].stop(timeout_s=60 if name == "learner" else 30)
        return codes

    def tail(self, name: str, n: int = 30) -> str:
        return self.children[name].tail(n) if name in self.children else ""

    # ---------------------------------------------------------------- observation
    def stats(self, timeout_s: float = 2.0) -> Optional[dict]:
        """The buffer's ledger, counters and metrics (None if it does not answer)."""
        return buffer_stats(self.control, timeout_s, self.keys)

    def version(self) -> int:
        s = self.stats()
        return int(s["learner_version"]) if s else -1

    def wait(self, pred: Callable[[], Any], timeout_s: float, what: str, every: float = 0.2,
             child: Optional[Child] = None) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            watched = [child] if child is not None else [c for n, c in self.children.items() if n not in self.killed]
            for c in watched:
                if c.proc.poll() not in (None, 0):
                    raise RuntimeError(f"{c.name} died (exit {c.proc.returncode}) while waiting for {what}:\n"
                                       + c.tail())
            time.sleep(every)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n--- learner:\n"
                           f"{self.tail('learner')}\n--- buffer:\n{self.tail('buffer', 10)}")

    def wait_version(self, v: int, timeout_s: float) -> int:
        return self.wait(lambda: (x := self.version()) >= v and x, timeout_s, f"learner version {v}")

    def actor_status(self) -> dict[int, dict]:
        out = {}
        for i in range(self.cfg.actor.num_actors):
            st = read_status(status_path(self.run_dir, i))
            if st is not None:
                out[i] = st
        return out

    def actor_pids(self) -> dict[int, int]:
        """Actor id -> pid of the process playing it now (from its status file, checked to be running)."""
        return {i: st["pid"] for i, st in self.actor_status().items()
                if psutil.pid_exists(st["pid"]) and st.get("state") != "stopped"}

    def rss_mb(self, name: str) -> float:
        try:
            return psutil.Process(self.pid(name)).memory_info().rss / 2**20
        except psutil.Error:
            return float("nan")

    def ledgers(self, archived_only: bool = False) -> list[dict]:
        """Every buffer incarnation's ledger, oldest first (a restarted buffer moves the old one aside)."""
        paths = sorted(self.run_dir.glob("ledger-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        if not archived_only:
            paths.append(self.run_dir / "ledger.json")
        return [json.loads(p.read_text()) for p in paths if p.is_file()]

    def listening(self) -> list[tuple[str, str, int]]:
        """(process, address, port) of every listening TCP socket of the live processes and their children."""
        out = []
        for name, child in self.children.items():
            if not child.alive():
                continue
            root = psutil.Process(child.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    conns = p.net_connections(kind="tcp")
                except psutil.Error:
                    continue
                out += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
        return out


def staleness_violations(ledgers: list[dict]) -> int:
    """Trained trajectory uses whose lag exceeded the buffer's max_staleness (from the ledgers' histograms)."""
    return sum(n for led in ledgers for lag, n in led.get("lag_histogram", {}).items()
               if int(lag) > int(led.get("max_staleness", 0)))


def unbalanced(ledgers: list[dict]) -> int:
    """Sum over incarnations of |received - sum(states)|: 0 when every received trajectory is accounted for."""
    return sum(abs(led["received"] - sum(led["ledger"].values())) for led in ledgers)
