"""Per-trajectory audit of a run from the buffer's recordings (``buffer.record=true``).

A recording replays into a fresh GroupBuffer with the same ledger (``async_vla.buffer.recording.replay``); replaying
it with ``Tracer`` as the buffer's ledger, which notes each trajectory's fate as it happens, answers what the
aggregate ledger cannot:
which trajectories were in flight at a moment (say, when the learner was killed) and what became of each one,
and whether any trajectory was admitted by two buffer incarnations (a restarted buffer has its own recording
directory: ``recording-<n>/`` is the n-th previous one, ``recording/`` the current one).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Optional

from async_vla.buffer.ledger import Ledger
from async_vla.buffer.recording import replay as replay_into_buffer
from async_vla.config import load_config


class Tracer(Ledger):
    """A ledger that also notes every trajectory's fate as it happens: traj_id -> (state, learner version)."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id
        self.fate: dict[str, tuple[str, int]] = {}
        self.admitted: list[str] = []                                     # joined a group, in order
        self.received_from: collections.Counter = collections.Counter()  # actor id -> trajectories of this run
        self.formed: collections.Counter = collections.Counter()         # traj_id -> batches it was put in

    def receive(self, traj=None) -> None:
        if traj is not None and traj.run_id == self.run_id:  # a hostile frame can claim any actor id, not our run
            self.received_from[traj.actor_id] += 1
        super().receive(traj)

    def join(self, traj, version: int) -> None:
        self.admitted.append(traj.traj_id)
        self.fate.setdefault(traj.traj_id, ("pending", version))
        super().join(traj, version)

    def drop_group(self, members, state: str, version: int) -> str:
        for t in members:
            self.fate[t.traj_id] = (state, version)
        return super().drop_group(members, state, version)

    def use_group(self, members, version: int, first_use: bool) -> None:
        for t in members:
            self.formed[t.traj_id] += 1
            if self.fate.get(t.traj_id, ("",))[0] != "trained":
                self.fate[t.traj_id] = ("trained", int(version))
        super().use_group(members, version, first_use)

    def untrain_group(self, members, batch_version: int, version: int) -> None:
        for t in members:
            self.fate[t.traj_id] = ("pending", version)
        super().untrain_group(members, batch_version, version)


def recordings(run_dir: Path) -> list[Path]:
    """Recording directories of every buffer incarnation, oldest first."""
    run_dir = Path(run_dir)
    old = sorted(run_dir.glob("recording-*"), key=lambda p: int(p.name.split("-")[1]))
    cur = run_dir / "recording"
    return [p for p in [*old, cur] if (p / "meta.json").is_file()]


def replay(rec_dir: Path, cfg, snapshot_at: Optional[int] = None) -> tuple[Tracer, Optional[dict]]:
    """Replay one recording; with ``snapshot_at`` (a record count), also return the in-flight map as of that many
    records (the buffer's state when its stats reported ``recorded_records == snapshot_at``)."""
    meta = json.loads((Path(rec_dir) / "meta.json").read_text())
    tracer = Tracer(meta["run_id"])
    snapshot = {"in_flight": {}, "version": 0} if snapshot_at == 0 else None

    def each(n: int, buf) -> None:
        nonlocal snapshot
        if n == snapshot_at:
            snapshot = {"in_flight": buf.in_flight(), "version": buf.version}

    replay_into_buffer(rec_dir, cfg, ledger=tracer, each=each)
    return tracer, snapshot


def _cfg(run_dir: Path, cfg):
    return cfg if cfg is not None else load_config(Path(run_dir) / "config.yaml")


def fates_of_in_flight(run_dir: Path, records_at: int, checkpoint_version: int, cfg=None) -> dict:
    """What became of the trajectories in flight when the current recording held ``records_at`` records.

    Returns counts: where they were (assembling / ready / in the learner's batch) and how each ended (trained by
    version v, stale, expired_partial, still pending). The batch the dead learner was training goes back to the
    queue and is trained again if it was for a version beyond the checkpoint, or is served again if it was for the
    checkpoint's own version (``retrained_after_resume``); ``taken_by_dead_learner`` counts what was not.
    """
    cfg = _cfg(run_dir, cfg)
    buf, snap = replay(recordings(run_dir)[-1], cfg, snapshot_at=records_at)
    if snap is None:
        return {"error": f"recording ends before record {records_at}"}
    where = collections.Counter()
    end = collections.Counter()
    for tid, place in snap["in_flight"].items():
        where[place.split(" ")[0]] += 1
        state, version = buf.fate.get(tid, ("pending", 0))
        if place.startswith("batch"):
            again = int(place.split("v")[1]) <= checkpoint_version or buf.formed[tid] >= 2
            end["retrained_after_resume" if again else "taken_by_dead_learner"] += 1
        else:
            end["trained_after_resume" if state == "trained" else state] += 1
    return {"in_flight": sum(where.values()), "where": dict(where), "outcome": dict(end),
            "version_at_kill": snap["version"]}


def admitted_twice(run_dir: Path, cfg=None) -> dict:
    """Trajectory ids admitted (entered a group) by more than one incarnation, or twice by one: must be 0."""
    cfg = _cfg(run_dir, cfg)
    seen: collections.Counter = collections.Counter()
    per = []
    for rec in recordings(run_dir):
        buf, _ = replay(rec, cfg)
        per.append(len(buf.admitted))
        seen.update(buf.admitted)
    twice = [t for t, n in seen.items() if n > 1]
    return {"incarnations": len(per), "admitted": per, "admitted_twice": len(twice), "examples": twice[:5]}


def received_from(run_dir: Path, min_actor_id: int = 0, cfg=None) -> int:
    """Trajectories the current buffer received (and recorded) from actors with id >= ``min_actor_id``."""
    cfg = _cfg(run_dir, cfg)
    buf, _ = replay(recordings(run_dir)[-1], cfg)
    return sum(n for a, n in buf.received_from.items() if a >= min_actor_id)
