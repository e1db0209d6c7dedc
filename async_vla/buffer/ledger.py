"""The buffer's books, read-only: ledger counts, invariants, lag statistics, TensorBoard scalars and
``ledger.json``. A mixin of ``GroupBuffer`` (async_vla/buffer/group_buffer.py), which owns the state these read; kept apart
so the admission logic there stays readable."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

STATES = ("trained", "filtered_uniform", "filtered_difficulty", "stale", "expired_partial", "duplicate",
          "malformed", "pending")


class LedgerReports:
    """Reporting half of ``GroupBuffer``; every attribute used here is set by ``GroupBuffer.__init__``."""

    @property
    def ledger(self) -> dict[str, int]:
        """Trajectory counts by state (all eight, pending included)."""
        out = {s: int(self._counts[s]) for s in STATES}
        out["pending"] = self._pending
        return out

    def check_invariants(self) -> None:
        """Recompute pending and held bytes from the structures; AssertionError if the books disagree."""
        pending = sum(len(g.members) for g in self._open.values())
        pending += sum(len(g.members) for g in self._ready if not g.trained)
        held = {id(g): g for g in self._open.values()}
        held.update((id(g), g) for g in self._ready)
        held.update((id(g), g) for b in self._batches.values() for g in b.groups)
        held_bytes = sum(g.nbytes for g in held.values())
        assert pending == self._pending, (pending, self._pending)
        assert held_bytes == self.held_bytes, (held_bytes, self.held_bytes)
        assert self.received == sum(self.ledger.values()), (self.received, self.ledger)

    def lag_stats(self) -> tuple[float, int]:
        """(mean, max) behaviour-version lag over trained trajectory uses (0, 0 before any)."""
        n = sum(self.lag_histogram.values())
        if not n:
            return 0.0, 0
        return sum(k * c for k, c in self.lag_histogram.items()) / n, max(self.lag_histogram)

    def metrics(self) -> dict[str, float]:
        """Scalars for TensorBoard under buffer/*."""
        lag_mean, lag_max = self.lag_stats()
        m = {f"buffer/{s}": float(v) for s, v in self.ledger.items()}
        m.update({
            "buffer/received": float(self.received), "buffer/lag_mean": lag_mean, "buffer/lag_max": float(lag_max),
            "buffer/groups_in_flight": float(len(self._open)), "buffer/held_bytes": float(self.held_bytes),
            "buffer/max_staleness": float(self.max_staleness), "buffer/groups_ready": float(len(self._ready)),
            "buffer/groups_accepted": float(self.accepted_groups), "buffer/batches": float(self.batches_formed),
            "buffer/pacing_capacity": float(self.pacing_capacity()), "buffer/learner_version": float(self.version),
            "buffer/grants_refused_behind": float(self.grants_refused_behind),
        })
        return m

    def ledger_snapshot(self) -> dict:
        """Everything about the books, JSON-able (ledger.json)."""
        lag_mean, lag_max = self.lag_stats()
        return {
            "run_id": self.run_id, "received": self.received, "ledger": self.ledger,
            "malformed_by_reason": dict(sorted(self.malformed_by_reason.items())),
            "groups": dict(sorted(self.group_counts.items())),
            "lag_histogram": {str(k): v for k, v in sorted(self.lag_histogram.items())},
            "lag_mean": lag_mean, "lag_max": lag_max, "learner_version": self.version,
            "max_staleness": self.max_staleness, "eta_changes": list(self.eta_changes),
            "batches_formed": self.batches_formed, "rollbacks": list(self.rollbacks),
            "grants_refused_behind": self.grants_refused_behind,
            "groups_in_flight": len(self._open),
            "groups_ready": len(self._ready), "held_bytes": self.held_bytes,
        }

    def write_ledger(self, run_dir, extra: Optional[dict] = None) -> Path:
        """Write ``<run_dir>/ledger.json`` atomically (a reader never sees half a file)."""
        path = Path(run_dir) / "ledger.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        snap = self.ledger_snapshot()
        snap.update(extra or {})
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(snap, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return path
