"""Admission: the buffer's one pacing and staleness rule (AReaL's staleness manager, in the buffer's terms).

A tag outside the followed learner lineage's history is dead; a group whose lag (version - its oldest policy) exceeds
eta is stale. ``capacity = (eta + version - v_base + 1) * B - running - accepted`` groups may be granted now, an
actor holding the learner's own v + 1 is judged at v + 1 (the race), and each of n live identities may hold at most
``max(1, (capacity + running) // n)`` groups. The owner reports every group's start, finish, acceptance and later
drop (``on_*``). The rule in full: docs/CONTRACTS.md "The buffer".
"""

from __future__ import annotations

import collections
import time
from typing import Optional

from async_vla.messages import Lineage, PolicyTag

MAX_LEFT = 64     # lineages left behind that are remembered (their late batch requests are refused)


class Admission:
    """Pacing and staleness for one buffer; ``cfg``: the ``buffer`` section, ``eta``: max_staleness at the start."""

    def __init__(self, cfg, eta: int):
        self.cfg, self.B = cfg, cfg.groups_per_batch
        self.eta = self._checked_eta(eta)
        self.version = 0
        self.lineage: Optional[Lineage] = None      # the learner's, once a batch request said so
        self.v_base = 0
        self.running = 0
        self.accepted = 0
        self.heard = False                          # has the learner spoken (v_base set)?
        self._left: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.eta_changes: list[dict] = []

    # ------------------------------------------------------------------ the rule
    def is_stale(self, oldest_version: int) -> bool:
        """Is data whose oldest policy is ``oldest_version`` more than eta versions behind the learner?"""
        return self.version - int(oldest_version) > self.eta

    def is_dead(self, tag: PolicyTag) -> bool:
        """Is ``tag`` (a group's newest policy) outside the learner's history?"""
        return self.lineage is not None and not self.lineage.holds(tag)

    def judge(self, tag: PolicyTag) -> str:
        """Why nothing sampled with ``tag`` could be trained: "dead", "behind" (stale already), or ""."""
        if self.is_dead(tag):
            return "dead"
        return "behind" if self.is_stale(tag.version) else ""

    def capacity(self, tag: Optional[PolicyTag] = None) -> int:
        """New groups that may be granted now to an actor holding ``tag`` (may be negative)."""
        version = self.version
        if tag is not None and self.lineage is not None and tag == PolicyTag(self.lineage.id, version + 1):
            version += 1      # the race: the learner published v + 1, its request for it is on the way
        return (self.eta + version - self.v_base + 1) * self.B - self.running - self.accepted

    def grantable(self, tag: Optional[PolicyTag], want: int, held: int = 0, identities: int = 1) -> int:
        """How many of ``want`` groups an actor holding ``tag`` (None: not judged by weights) and ``held`` open
        groups may start now, with ``identities`` live actors (itself included) sharing the budget."""
        if tag is not None and self.judge(tag):
            return 0
        if not self.cfg.pacing:
            return max(0, want)
        return max(0, min(want, self.capacity(tag), self.share(identities, tag) - held))

    def share(self, identities: int, tag: Optional[PolicyTag] = None) -> int:
        """Open groups one of ``identities`` live actors may hold (see "Fair share")."""
        return max(1, (self.capacity(tag) + self.running) // max(1, identities))

    # ------------------------------------------------------------------ the learner
    def follow(self, version: int, lineage: Optional[Lineage] = None) -> bool:
        """The learner asks at ``version`` as ``lineage`` (None: the one followed so far). Returns True when that
        is a new lineage (the owner drops what became dead); ValueError for a lineage left behind (a dead
        learner's late request) or, within one lineage, a version older than ours."""
        version = int(version)
        if lineage is not None and lineage.id in self._left:
            raise ValueError(f"batch request from learner lineage {lineage.id[:12]!r}, which a newer learner "
                             "replaced: refused")
        new = lineage is not None and (self.lineage is None or lineage.id != self.lineage.id)
        if not self.heard:
            self.v_base, self.heard = version, True
        elif new:
            self.v_base += version - self.version
        elif version < self.version:
            raise ValueError(f"batch request for version {version}, older than the learner's {self.version}")
        if new and self.lineage is not None:
            self._left[self.lineage.id] = None
            while len(self._left) > MAX_LEFT:
                self._left.popitem(last=False)
        self.version = version
        if lineage is not None:
            self.lineage = lineage
        return new

    def set_eta(self, eta: int, source: str = "api") -> bool:
        """Change eta live (kept in eta_changes); True if it changed. ValueError outside its limit."""
        eta = self._checked_eta(eta)
        if eta == self.eta:
            return False
        self.eta_changes.append({"t": time.time(), "version": self.version, "old": self.eta, "new": eta,
                                 "source": source})
        del self.eta_changes[:-100]
        self.eta = eta
        return True

    def _checked_eta(self, eta: int) -> int:
        eta, limit = int(eta), self.cfg.max_staleness_limit
        if not 0 <= eta <= limit:
            raise ValueError(f"max_staleness must be in [0, buffer.max_staleness_limit={limit}], got {eta}")
        return eta

    # ------------------------------------------------------------------ what happened to groups
    def on_started(self, n: int = 1) -> None:
        """``n`` groups were granted (nothing else opens a group)."""
        self.running += n

    def on_finished(self) -> None:
        """A group left assembly: complete, expired, reclaimed or dropped."""
        self.running -= 1

    def on_accepted(self) -> None:
        """A complete group passed the filters and was fresh: it waits for a batch."""
        self.accepted += 1

    def on_dropped(self) -> None:
        """An accepted group was dropped untrained (stale or dead): its slot is free again."""
        self.accepted -= 1
