"""Per-trajectory audit of a run from the buffer's recordings (``buffer.record=true``): replayed with ``Tracer`` as the
ledger, they tell which trajectories were in flight at a moment and what became of each, and whether two buffer
incarnations (``recording-<n>/``, ``recording/``) admitted one trajectory."""

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
        self.received_ids: list[str] = []                                # of this run, in arrival order
        self._last: Optional[str] = None

    def receive(self, traj=None) -> None:
        self._last = None
        if traj is not None and traj.run_id == self.run_id:  # a hostile frame can claim any actor id, not our run
            self.received_from[traj.actor_id] += 1
            self.received_ids.append(traj.traj_id)
            self._last = traj.traj_id
        super().receive(traj)

    def settle(self, state: str, n: int = 1) -> str:
        if self._last is not None:   # a trajectory that never joined a group (duplicate, late, ahead, malformed)
            self.fate.setdefault(self._last, (state, -1))
        return super().settle(state, n)

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
    """Counts of what became of the trajectories in flight when the current recording held ``records_at`` records:
    where they were (assembling / ready / in the learner's batch) and how each ended (trained, stale, expired, pending;
    ``retrained_after_resume``, ``taken_by_dead_learner``)."""
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


def learner_lags(run_dir: Path) -> collections.Counter:
    """lag -> trajectories trained at it, from every learner rank's own log (``learner_lags_rank<r>.jsonl``,
    written as each batch is trained, across restarts): the learner's witness beside the buffer's ledgers."""
    out: collections.Counter = collections.Counter()
    for path in sorted(Path(run_dir).glob("learner_lags_rank*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.update({int(k): int(v) for k, v in json.loads(line)["lags"].items()})
            except (ValueError, KeyError, TypeError):   # a line cut short by a kill -9
                continue
    return out


def sent_vs_received(run_dir: Path, cfg=None, extra_sent: Optional[dict[str, list[str]]] = None) -> dict:
    """What actors sent (``<run>/actors/sent_<id>.log`` plus ``extra_sent``) against what each buffer incarnation's
    recording received, and how each sent trajectory ended: a terminal state, "pending" where it was received, or
    lost in transit. Trusts no counter the buffer keeps for itself."""
    from actors.status import read_sent_logs

    cfg = _cfg(run_dir, cfg)
    sent = read_sent_logs(run_dir)
    for k, ids in (extra_sent or {}).items():
        sent.setdefault(k, []).extend(ids)
    sent_ids = {t for ids in sent.values() for t in ids}
    fate: dict[str, str] = {}
    seen: collections.Counter = collections.Counter()
    per = []
    for rec in recordings(run_dir):
        tracer, _ = replay(rec, cfg)
        ids = set(tracer.received_ids)
        seen.update(ids)
        for t in ids & sent_ids:
            fate[t] = tracer.fate.get(t, ("pending", 0))[0]
        per.append({"recording": rec.name, "received": tracer.received, "of_sent": len(ids & sent_ids),
                    "ledger": tracer.counts(), "balanced": tracer.received == sum(tracer.counts().values())})
    outcome = collections.Counter(fate.values())
    outcome["lost_in_transit"] = len(sent_ids - set(fate))
    return {
        "sent": len(sent_ids), "sent_lines": sum(len(ids) for ids in sent.values()),
        "sent_by_incarnation": {k: len(v) for k, v in sent.items()},
        "received": len(set(fate)), "received_by_two_incarnations": sum(1 for t in sent_ids if seen[t] > 1),
        "outcome": dict(sorted(outcome.items())), "incarnations": per,
    }
