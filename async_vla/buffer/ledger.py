"""The buffer's ledger: where every received trajectory is. ``GroupBuffer`` owns one and tells it each transition;
everyone else reads it. Invariant: ``received == sum(counts().values())``, every trajectory in exactly one of
``STATES`` (docs/CONTRACTS.md "The buffer"). A subclass that overrides the transition methods sees each trajectory's
fate as it happens (``runner/faults/audit.py`` does, replaying a recording)."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Sequence

STATES = ("trained", "filtered_uniform", "filtered_difficulty", "stale", "expired_partial", "duplicate",
          "malformed", "ahead", "pending")


class Ledger:
    """Counts by state, reasons for malformed input, group-level outcomes, and the lag of trained trajectories."""

    def __init__(self) -> None:
        self.received = 0
        self.pending = 0
        self.malformed_by_reason: collections.Counter = collections.Counter()
        self.group_counts: collections.Counter = collections.Counter()   # group-level outcomes
        self.lag_histogram: collections.Counter = collections.Counter()  # lag -> trajectories trained at it
        self._terminal: collections.Counter = collections.Counter()      # every state but pending

    # ------------------------------------------------------------------ transitions (GroupBuffer calls these)
    def receive(self, traj=None) -> None:
        """One input arrived: a trajectory, or (``traj`` None) a frame the receiver could not decode."""
        self.received += 1

    def settle(self, state: str, n: int = 1) -> str:
        """``n`` trajectories that never joined a group end in ``state`` (a duplicate, a late straggler)."""
        self._terminal[state] += n
        return state

    def malformed(self, reason: str) -> str:
        self.malformed_by_reason[reason] += 1
        return self.settle("malformed")

    def join(self, traj, version: int) -> None:
        """A trajectory entered its group (pending until its group is dropped or trained)."""
        self.pending += 1

    def drop_group(self, members: Sequence, state: str, version: int) -> str:
        """An untrained group leaves: filtered, stale, or expired while partial."""
        n = len(members)
        self._terminal[state] += n
        self.pending -= n
        self.group_counts[state] += 1
        return state

    def admit_group(self, members: Sequence, version: int) -> None:
        self.group_counts["accepted"] += 1

    def expire_empty_group(self) -> None:
        """A granted group expired before any member arrived: no trajectory, only a group outcome."""
        self.group_counts["expired_empty"] += 1

    def reclaim_group(self) -> None:
        """A granted group taken back from an actor that stopped heart-beating before any member arrived."""
        self.group_counts["reclaimed"] += 1

    def use_group(self, members: Sequence, version: int, first_use: bool) -> None:
        """A group was put in the batch for learner ``version`` (``first_use``: it becomes "trained")."""
        if first_use:
            n = len(members)
            self._terminal["trained"] += n
            self.pending -= n
            self.group_counts["trained"] += 1
        for t in members:
            self.lag_histogram[version - t.behaviour_version] += 1

    def untrain_group(self, members: Sequence, batch_version: int, version: int) -> None:
        """The batch of ``batch_version`` died with its learner: its group is pending again (``version``: now)."""
        n = len(members)
        self._terminal["trained"] -= n
        self.pending += n
        self.group_counts["trained"] -= 1
        for t in members:
            lag = batch_version - t.behaviour_version
            self.lag_histogram[lag] -= 1
            if not self.lag_histogram[lag]:
                del self.lag_histogram[lag]

    # ------------------------------------------------------------------ reading
    def counts(self) -> dict[str, int]:
        """Trajectory counts by state (all nine, pending included)."""
        out = {s: int(self._terminal[s]) for s in STATES}
        out["pending"] = self.pending
        return out

    def lag_stats(self) -> tuple[float, int]:
        """(mean, max) behaviour-version lag over trained trajectory uses (0, 0 before any)."""
        n = sum(self.lag_histogram.values())
        if not n:
            return 0.0, 0
        return sum(k * c for k, c in self.lag_histogram.items()) / n, max(self.lag_histogram)

    def snapshot(self) -> dict:
        """The ledger's part of ``ledger.json``."""
        lag_mean, lag_max = self.lag_stats()
        return {
            "received": self.received, "ledger": self.counts(),
            "malformed_by_reason": dict(sorted(self.malformed_by_reason.items())),
            "groups": dict(sorted(self.group_counts.items())),
            "lag_histogram": {str(k): v for k, v in sorted(self.lag_histogram.items())},
            "lag_mean": lag_mean, "lag_max": lag_max,
        }


def write_json_atomic(path: Path, data: dict) -> Path:
    """Write ``data`` as JSON through a temporary file and a rename (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path
